"""Tests for the family switches of the decoder: Qwen3 q/k norms, Llama 3 RoPE scaling, parameter
dtype, gradient checkpointing (remat)."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import KVCache, ModelConfig, apply, get_config, init_model, split_model
from jaxrl_async.model.config import RopeScaling


def _tokens(batch, length, vocab, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


def test_llama3_frequency_scaling_matches_a_hand_computation():
  scaling = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=64)
  # Wavelengths 2*pi/f: 6.3 (< 64/4 = 16: kept), 32 (between 16 and 64: interpolated),
  # 200 (> 64: divided by the factor).
  freqs = np.array([1.0, 2 * math.pi / 32, 2 * math.pi / 200])
  out = np.asarray(scaling.scale_frequencies(jnp.asarray(freqs, jnp.float32)))
  smooth = (64 / 32 - 1.0) / (4.0 - 1.0)
  expected = [1.0, (1 - smooth) * freqs[1] / 8 + smooth * freqs[1], freqs[2] / 8]
  np.testing.assert_allclose(out, expected, rtol=1e-6)


def test_rope_scaling_and_param_dtype_are_validated_by_name():
  with pytest.raises(ValueError, match=r"RopeScaling.factor must be >= 1"):
    RopeScaling(factor=0.5)
  with pytest.raises(ValueError, match=r"low_freq_factor < high_freq_factor"):
    RopeScaling(low_freq_factor=4.0, high_freq_factor=1.0)
  with pytest.raises(ValueError, match=r"ModelConfig.param_dtype.*'int8'"):
    ModelConfig(param_dtype="int8")
  with pytest.raises(ValueError, match=r"ModelConfig.rope_scaling must be a RopeScaling"):
    ModelConfig(rope_scaling={"factor": 8.0})


@pytest.mark.parametrize("overrides", [
    {"qk_norm": True, "head_dim": 32, "tie_embeddings": True},  # Qwen3-like
    {"rope_scaling": RopeScaling(8.0, 1.0, 4.0, 4)},  # Llama 3-like, scaling within 8 positions
])
def test_family_variants_cache_equals_full_forward(overrides):
  config = get_config("tiny", n_layers=1, **overrides)
  graphdef, params = split_model(init_model(config, seed=2))
  if config.qk_norm:  # norm scales start at 1; make them matter
    attn = params["blocks"][0]["attn"]
    assert attn["q_norm"]["scale"].shape == attn["k_norm"]["scale"].shape == (32,)
    for name in ("q_norm", "k_norm"):
      attn[name]["scale"] = attn[name]["scale"] * jnp.linspace(0.5, 1.5, 32)
  fwd = jax.jit(functools.partial(apply, graphdef))
  tokens = _tokens(2, 8, config.vocab_size, seed=9)
  full, _ = fwd(params, tokens)
  _, cache = fwd(params, tokens[:, :7], None, KVCache.zeros(config, 2, 8))
  last, _ = fwd(params, tokens[:, 7:], jnp.full((2, 1), 7), cache)
  np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, 7]), atol=1e-4)
  # The same weights without the switch give other logits: the switch is really used.
  base = {k: v for k, v in overrides.items() if k not in ("qk_norm", "rope_scaling")}
  plain_graphdef, _ = split_model(init_model(get_config("tiny", n_layers=1, **base)))
  plain_params = _drop_norms(params) if config.qk_norm else params
  plain, _ = jax.jit(functools.partial(apply, plain_graphdef))(plain_params, tokens)
  assert not np.allclose(np.asarray(plain), np.asarray(full), atol=1e-3)  # the switch matters


def _drop_norms(params):
  out = jax.tree.map(lambda x: x, params)
  for block in out["blocks"].values():
    block["attn"].pop("q_norm")
    block["attn"].pop("k_norm")
  return out


def test_bfloat16_parameters_are_stored_and_used_as_bfloat16():
  config = get_config("tiny", param_dtype="bfloat16", dtype="bfloat16", qkv_bias=True,
                      qk_norm=True)
  graphdef, params = split_model(init_model(config, seed=1))
  assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
  graphdef32, _ = split_model(init_model(get_config("tiny", qkv_bias=True, qk_norm=True)))
  tokens = _tokens(2, 8, config.vocab_size, seed=3)
  logits16, _ = jax.jit(functools.partial(apply, graphdef))(params, tokens)
  params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  logits32, _ = jax.jit(functools.partial(apply, graphdef32))(params32, tokens)
  assert logits16.dtype == jnp.float32
  difference = np.max(np.abs(np.asarray(logits16) - np.asarray(logits32)))
  assert 0 < difference < 0.25


def test_remat_gives_the_same_logits_and_gradients():
  config = get_config("tiny", qk_norm=True)
  _, params = split_model(init_model(config, seed=4))
  tokens = _tokens(2, 8, config.vocab_size, seed=5)
  segments = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 2]] * 2, jnp.int32)
  positions = jnp.asarray([[0, 1, 2, 0, 1, 2, 3, 4]] * 2, jnp.int32)

  def loss_and_grads(remat):
    graphdef, _ = split_model(init_model(get_config("tiny", qk_norm=True, remat=remat)))

    def loss(p):
      logits, _ = apply(graphdef, p, tokens, positions, segment_ids=segments)
      return jnp.mean(jax.nn.log_softmax(logits)[..., 3]), logits

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (loss_plain, logits_plain), grads_plain = loss_and_grads(False)
  (loss_remat, logits_remat), grads_remat = loss_and_grads(True)
  np.testing.assert_allclose(np.asarray(logits_remat), np.asarray(logits_plain), atol=1e-6)
  assert float(loss_remat) == pytest.approx(float(loss_plain), abs=1e-6)
  for a, b in zip(jax.tree.leaves(grads_remat), jax.tree.leaves(grads_plain)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
  # Only the remat forward has checkpointed blocks (recomputed in the backward pass).
  for remat in (False, True):
    graphdef, _ = split_model(init_model(get_config("tiny", qk_norm=True, remat=remat)))
    jaxpr = str(jax.make_jaxpr(lambda p, g=graphdef: apply(g, p, tokens)[0])(params))
    assert ("remat" in jaxpr) == remat


def test_remat_cuts_the_memory_of_the_backward_pass():
  """The checkpointed blocks are scanned over, so XLA keeps one block's activations at a time
  (unrolled checkpointed blocks get their recomputation hoisted on the CPU: no saving)."""
  base = dict(vocab_size=256, d_model=128, n_layers=8, n_heads=4, n_kv_heads=2, d_ff=512,
              max_seq_len=128)
  tokens = jnp.zeros((8, 128), jnp.int32)

  def temp_bytes(remat):
    graphdef, params = split_model(init_model(ModelConfig(**base, remat=remat)))

    def loss(p):
      hidden, _ = apply(graphdef, p, tokens, return_hidden=True)
      return jnp.sum(hidden ** 2)

    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  assert temp_bytes(True) < 0.5 * temp_bytes(False)
