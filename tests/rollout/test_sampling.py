"""Tests for jaxrl_async.rollout.sampling: greedy, top-k, top-p, frequencies, logprobs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.rollout.sampling import (
  INVERSE_CDF_MIN_VOCAB,
  SamplingConfig,
  inverse_cdf_draw,
  sample_token,
)

LOGITS = jnp.asarray([1.0, 2.5, -0.5, 0.3, 2.0, -1.0, 0.0, 1.2], jnp.float32)


@functools.cache
def _draw(config: SamplingConfig, num: int, seed: int = 0):
  """`num` draws under vmap (one compile per config): (tokens [num], logprobs [num])."""
  keys = jax.random.split(jax.random.PRNGKey(seed), num)
  fn = jax.jit(jax.vmap(functools.partial(sample_token, config=config), in_axes=(None, 0)))
  tokens, logprobs = fn(LOGITS, keys)
  return np.asarray(tokens), np.asarray(logprobs)


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  z = x - x.max()
  return z - np.log(np.exp(z).sum())


def test_greedy_is_argmax_with_the_untempered_logprob():
  for seed in range(3):
    logits = jnp.asarray(np.random.default_rng(seed).normal(size=11), jnp.float32)
    token, logprob = sample_token(logits, jax.random.PRNGKey(seed), SamplingConfig(0.0))
    assert int(token) == int(np.argmax(logits))
    assert token.dtype == jnp.int32
    assert float(logprob) == pytest.approx(_log_softmax(logits)[int(token)], abs=1e-6)
  tokens, _ = _draw(SamplingConfig(temperature=0.0), 64)
  assert set(tokens.tolist()) == {1}


def test_top_k_one_equals_greedy():
  tokens, logprobs = _draw(SamplingConfig(temperature=1.0, top_k=1), 256)
  assert set(tokens.tolist()) == {int(np.argmax(LOGITS))}
  # The recorded logprob is over the untruncated distribution.
  np.testing.assert_allclose(logprobs, _log_softmax(LOGITS)[1], atol=1e-6)


def test_tiny_top_p_keeps_only_the_max_token():
  tokens, _ = _draw(SamplingConfig(temperature=1.5, top_p=1e-6), 256)
  assert set(tokens.tolist()) == {1}


def test_top_k_draws_only_the_k_largest():
  tokens, _ = _draw(SamplingConfig(temperature=2.0, top_k=3), 2000)
  assert set(tokens.tolist()) == {1, 4, 7}  # the three largest logits: 2.5, 2.0, 1.2


def test_top_p_keeps_the_smallest_prefix_reaching_p():
  probs = np.exp(_log_softmax(LOGITS))
  order = np.argsort(-probs)
  top2 = probs[order[:2]].sum()  # tokens 1 and 4
  tokens, _ = _draw(SamplingConfig(temperature=1.0, top_p=float(top2) - 0.01), 2000)
  assert set(tokens.tolist()) == set(order[:2].tolist())
  tokens, _ = _draw(SamplingConfig(temperature=1.0, top_p=float(top2) + 0.01), 2000)
  assert set(tokens.tolist()) == set(order[:3].tolist())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_frequencies_match_softmax_and_logprobs_are_tempered(temperature):
  num = 4000
  tokens, logprobs = _draw(SamplingConfig(temperature=temperature), num, seed=1)
  expected_logp = _log_softmax(np.asarray(LOGITS) / temperature)
  expected = np.exp(expected_logp)
  counts = np.bincount(tokens, minlength=len(expected)) / num
  # 4 standard errors of a binomial frequency; a wrong temperature is off by > 0.05.
  tolerance = 4 * np.sqrt(expected * (1 - expected) / num) + 1e-3
  assert np.all(np.abs(counts - expected) <= tolerance), (counts, expected)
  np.testing.assert_allclose(logprobs, expected_logp[tokens], atol=1e-5)


def test_top_k_frequencies_are_the_renormalised_top_k():
  num = 4000
  tokens, _ = _draw(SamplingConfig(temperature=1.0, top_k=2), num, seed=2)
  top = np.exp(np.asarray(LOGITS)[[1, 4]])
  share_of_1 = top[0] / top.sum()
  assert abs(np.mean(tokens == 1) - share_of_1) < 4 * np.sqrt(share_of_1 * (1 - share_of_1) / num)


def test_same_key_same_token_different_keys_vary():
  config = SamplingConfig(temperature=1.0)
  key = jax.random.PRNGKey(5)
  a = sample_token(LOGITS, key, config)
  b = sample_token(LOGITS, key, config)
  assert int(a[0]) == int(b[0])
  tokens, _ = _draw(config, 64, seed=3)
  assert len(set(tokens.tolist())) > 2


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, r"temperature must be >= 0, got -0.1"),
    ({"top_k": -1}, r"top_k must be >= 0 \(0 = off\), got -1"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
    ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
])
def test_bad_config_names_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    SamplingConfig(**kwargs)


def test_logits_must_be_a_vector():
  with pytest.raises(AssertionError):
    sample_token(jnp.zeros((2, 4)), jax.random.PRNGKey(0), SamplingConfig())


# ---- the inverse-CDF draw of large vocabularies -----------------------------------------------
@pytest.mark.parametrize("vocab, block", [(8, 1024), (37, 4), (40, 8)])
def test_inverse_cdf_frequencies_match_softmax(vocab, block):
  num = 4000
  logits = jnp.asarray(np.random.default_rng(vocab).normal(size=vocab) * 1.5, jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(vocab), num)
  draw = jax.jit(jax.vmap(functools.partial(inverse_cdf_draw, block=block), in_axes=(0, None)))
  tokens = np.asarray(draw(keys, logits))
  expected = np.exp(_log_softmax(logits))
  counts = np.bincount(tokens, minlength=vocab) / num
  tolerance = 4 * np.sqrt(expected * (1 - expected) / num) + 1e-3
  assert np.all(np.abs(counts - expected) <= tolerance), (counts, expected)


def test_inverse_cdf_never_draws_masked_or_padding():
  logits = jnp.full((37,), -jnp.inf).at[jnp.asarray([0, 5, 36])].set(jnp.asarray([0.0, 1.0, 2.0]))
  keys = jax.random.split(jax.random.PRNGKey(0), 2000)
  tokens = np.asarray(jax.vmap(lambda k: inverse_cdf_draw(k, logits, block=8))(keys))
  assert set(tokens.tolist()) == {0, 5, 36}
  one = jnp.full((37,), -jnp.inf).at[36].set(0.0)  # the last token, in the padded block
  assert set(np.asarray(jax.vmap(lambda k: inverse_cdf_draw(k, one, block=8))(keys)).tolist()) == {36}


def test_large_vocabulary_uses_inverse_cdf_with_exact_logprobs():
  vocab = INVERSE_CDF_MIN_VOCAB + 3
  logits = jnp.asarray(np.random.default_rng(0).normal(size=vocab) * 4, jnp.float32)
  keys = jax.random.split(jax.random.PRNGKey(1), 64)
  config = SamplingConfig(temperature=0.7)
  tokens, logprobs = jax.jit(jax.vmap(functools.partial(sample_token, config=config),
                                      in_axes=(None, 0)))(logits, keys)
  expected = jax.vmap(lambda k: inverse_cdf_draw(k, logits / 0.7))(keys)
  np.testing.assert_array_equal(tokens, expected)
  np.testing.assert_allclose(logprobs, _log_softmax(np.asarray(logits) / 0.7)[np.asarray(tokens)],
                             atol=1e-4)
