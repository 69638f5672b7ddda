"""RoPE frequency scalings (linear, Llama 3.x, YaRN) against numpy references written from the
published formulas: position interpolation divides positions by the factor; Llama 3.1 keeps short
wavelengths, divides long ones and interpolates between; YaRN (Peng et al. 2023) interpolates
dimension by dimension by how often it turns over the original context, and tempers the logits
by (0.1 ln s + 1)^2."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import KVCache, ModelConfig, apply, get_config, init_model, split_model
from jaxrl_async.model.config import (
  LinearRopeScaling,
  RopeScaling,
  YarnRopeScaling,
  linear_frequencies,
  llama3_frequencies,
  rope_inverse_frequencies,
  yarn_attention_factor,
  yarn_frequencies,
  yarn_ramp,
)
from jaxrl_async.model.decoder import rotary_embedding


def _reference_yarn(head_dim, theta, factor, length, beta_fast=32.0, beta_slow=1.0,
                    truncate=True):
  """YaRN's NTK-by-parts, one dimension pair at a time in plain Python.

  Pair i turns length / (2 pi theta^(2i/d)) times over the original context; the pair turning
  r times is i(r) = d ln(length / (2 pi r)) / (2 ln theta). Pairs below i(beta_fast) keep their
  frequency, pairs above i(beta_slow) are divided by the factor, with a linear ramp in i between
  (ends floored / ceiled when truncating, clipped to [0, d - 1]).
  """
  def pair(rotations):
    return head_dim * math.log(length / (2 * math.pi * rotations)) / (2 * math.log(theta))

  low, high = pair(beta_fast), pair(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if high == low:
    high += 0.001
  out = []
  for i in range(head_dim // 2):
    freq = theta ** (-2 * i / head_dim)
    ramp = min(max((i - low) / (high - low), 0.0), 1.0)
    out.append(freq / factor * ramp + freq * (1 - ramp))
  return np.array(out)


def _reference_llama3(head_dim, theta, factor, low_freq_factor, high_freq_factor, length):
  out = []
  for i in range(head_dim // 2):
    freq = theta ** (-2 * i / head_dim)
    wavelength = 2 * math.pi / freq
    if wavelength < length / high_freq_factor:
      out.append(freq)
    elif wavelength > length / low_freq_factor:
      out.append(freq / factor)
    else:
      smooth = (length / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
      out.append((1 - smooth) * freq / factor + smooth * freq)
  return np.array(out)


def test_plain_frequencies_are_theta_to_the_minus_2i_over_d():
  np.testing.assert_allclose(rope_inverse_frequencies(8, 100.0),
                             [1.0, 100 ** -0.25, 100 ** -0.5, 100 ** -0.75], rtol=1e-12)


def test_linear_divides_every_frequency():
  freqs = rope_inverse_frequencies(16, 10_000.0)
  np.testing.assert_allclose(linear_frequencies(freqs, 4.0), freqs / 4.0, rtol=1e-12)
  np.testing.assert_allclose(LinearRopeScaling(4.0).scale_frequencies(freqs), freqs / 4.0)


@pytest.mark.parametrize("head_dim, theta, factor, low, high, length", [
    (16, 10_000.0, 8.0, 1.0, 4.0, 64),  # the parity fixture's llama3 variant
    (128, 500_000.0, 32.0, 1.0, 4.0, 8192),  # Llama 3.2
    (128, 500_000.0, 8.0, 1.0, 4.0, 8192),  # Llama 3.1
])
def test_llama3_matches_the_reference(head_dim, theta, factor, low, high, length):
  freqs = rope_inverse_frequencies(head_dim, theta)
  expected = _reference_llama3(head_dim, theta, factor, low, high, length)
  np.testing.assert_allclose(llama3_frequencies(freqs, factor, low, high, length), expected,
                             rtol=1e-12)
  np.testing.assert_allclose(RopeScaling(factor, low, high, length).scale_frequencies(freqs),
                             expected, rtol=1e-12)


@pytest.mark.parametrize("head_dim, theta, factor, length, fast, slow, truncate", [
    (16, 10_000.0, 4.0, 64, 32.0, 1.0, True),  # ramp over pairs 0..3
    (16, 50_000.0, 2.0, 128, 16.0, 2.0, False),  # fractional ramp ends
    (128, 1_000_000.0, 4.0, 32768, 32.0, 1.0, True),  # Qwen2.5's long-context recipe
    (64, 10_000.0, 8.0, 2048, 32.0, 1.0, True),
])
def test_yarn_matches_the_reference(head_dim, theta, factor, length, fast, slow, truncate):
  freqs = rope_inverse_frequencies(head_dim, theta)
  expected = _reference_yarn(head_dim, theta, factor, length, fast, slow, truncate)
  out = yarn_frequencies(freqs, theta, factor, length, fast, slow, truncate)
  np.testing.assert_allclose(out, expected, rtol=1e-12)
  scaling = YarnRopeScaling(factor, length, fast, slow, truncate=truncate)
  np.testing.assert_allclose(scaling.scale_frequencies(freqs, theta), expected, rtol=1e-12)
  # float32 inputs (the decoder's) stay float32 and close
  out32 = yarn_frequencies(freqs.astype(np.float32), theta, factor, length, fast, slow, truncate)
  assert out32.dtype == np.float32
  np.testing.assert_allclose(out32, expected, rtol=1e-6)


def test_yarn_keeps_fast_pairs_and_divides_slow_ones():
  head_dim, theta, length = 16, 10_000.0, 64
  ramp = yarn_ramp(head_dim, theta, length, 32.0, 1.0)
  # Pair i turns 64 / (2 pi 1e4^(i/8)) times: 10.2, 3.2, 1.0, 0.3, ... over 64 positions;
  # i(32) = -0.99 -> floored to -1 -> clipped to 0, i(1) = 2.02 -> ceiled to 3.
  np.testing.assert_allclose(ramp, [0, 1 / 3, 2 / 3, 1, 1, 1, 1, 1])
  freqs = rope_inverse_frequencies(head_dim, theta)
  out = yarn_frequencies(freqs, theta, 4.0, length)
  assert out[0] == freqs[0]
  np.testing.assert_allclose(out[3:], freqs[3:] / 4.0, rtol=1e-12)


def test_yarn_attention_factor_is_0_1_ln_s_plus_1():
  assert yarn_attention_factor(4.0) == pytest.approx(0.1 * math.log(4.0) + 1)
  assert yarn_attention_factor(1.0) == 1.0
  assert YarnRopeScaling(factor=8.0).attention_factor == pytest.approx(0.1 * math.log(8) + 1)
  assert YarnRopeScaling(factor=8.0, attention_factor=1.5).attention_factor == 1.5
  # the default is resolved at construction, so equal settings compare equal
  assert YarnRopeScaling(factor=2.0) == YarnRopeScaling(factor=2.0,
                                                        attention_factor=0.1 * math.log(2) + 1)


def test_scalings_are_validated_by_name():
  with pytest.raises(ValueError, match=r"LinearRopeScaling.factor must be >= 1, got 0.5"):
    LinearRopeScaling(0.5)
  with pytest.raises(ValueError, match=r"YarnRopeScaling.factor must be >= 1"):
    YarnRopeScaling(factor=0.9)
  with pytest.raises(ValueError, match=r"0 < beta_slow < beta_fast, got 32.0, 1.0"):
    YarnRopeScaling(beta_fast=1.0, beta_slow=32.0)
  with pytest.raises(ValueError, match=r"original_max_position_embeddings must be >= 1"):
    YarnRopeScaling(original_max_position_embeddings=0)
  with pytest.raises(ValueError, match=r"attention_factor must be > 0"):
    YarnRopeScaling(attention_factor=-1.0)
  with pytest.raises(ValueError, match=r"needs theta"):
    YarnRopeScaling().scale_frequencies(np.ones(4))
  with pytest.raises(ValueError, match=r"LinearRopeScaling, YarnRopeScaling or None"):
    ModelConfig(rope_scaling=("yarn", 4.0))


def _rotate(x, position, freqs):
  """Half-split RoPE of one head vector by numpy."""
  half = len(freqs)
  angle = position * freqs
  a, b = x[:half], x[half:]
  return np.concatenate([a * np.cos(angle) - b * np.sin(angle),
                         b * np.cos(angle) + a * np.sin(angle)])


@pytest.mark.parametrize("scaling", [
    LinearRopeScaling(4.0), RopeScaling(8.0, 1.0, 4.0, 64), YarnRopeScaling(4.0, 64),
    YarnRopeScaling(2.0, 128, 16.0, 2.0, attention_factor=1.3, truncate=False)])
def test_rotary_embedding_applies_the_scaled_frequencies_and_attention_factor(scaling):
  theta = 10_000.0
  x = np.random.default_rng(3).normal(size=(1, 4, 2, 16)).astype(np.float32)
  positions = np.array([[0, 1, 37, 200]])
  out = np.asarray(rotary_embedding(jnp.asarray(x), jnp.asarray(positions), theta, scaling))
  freqs = scaling.scale_frequencies(rope_inverse_frequencies(16, theta), theta)
  for t, p in enumerate(positions[0]):
    for h in range(2):
      expected = _rotate(x[0, t, h].astype(np.float64), p, freqs) * scaling.attention_factor
      np.testing.assert_allclose(out[0, t, h], expected, atol=2e-5, rtol=1e-4)


def test_linear_scaling_is_rope_at_positions_over_the_factor():
  x = jnp.asarray(np.random.default_rng(4).normal(size=(1, 3, 1, 8)), jnp.float32)
  positions = jnp.asarray([[0, 6, 100]])
  scaled = rotary_embedding(x, positions, 500.0, LinearRopeScaling(4.0))
  plain = rotary_embedding(x, positions / 4.0, 500.0)
  np.testing.assert_allclose(np.asarray(scaled), np.asarray(plain), atol=1e-5)


@pytest.mark.parametrize("scaling", [LinearRopeScaling(2.0), YarnRopeScaling(4.0, 4)])
def test_scaled_decoder_cache_equals_full_forward(scaling):
  config = get_config("tiny", n_layers=1, rope_scaling=scaling)
  graphdef, params = split_model(init_model(config, seed=5))
  fwd = jax.jit(functools.partial(apply, graphdef))
  tokens = jnp.asarray(np.random.default_rng(6).integers(0, config.vocab_size, (2, 8)),
                       jnp.int32)
  full, _ = fwd(params, tokens)
  _, cache = fwd(params, tokens[:, :7], None, KVCache.zeros(config, 2, 8))
  last, _ = fwd(params, tokens[:, 7:], jnp.full((2, 1), 7), cache)
  np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, 7]), atol=1e-4)
  unscaled_graphdef, _ = split_model(init_model(get_config("tiny", n_layers=1), seed=5))
  unscaled, _ = jax.jit(functools.partial(apply, unscaled_graphdef))(params, tokens)
  assert not np.allclose(np.asarray(unscaled), np.asarray(full), atol=1e-3)  # it does matter
