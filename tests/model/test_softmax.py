"""Tests for jaxrl_async.model.softmax: the values of jax.nn.softmax, the gradient of its formula."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model.softmax import softmax


def _scores(shape, seed=0, masked_fraction=0.3):
  """Attention-like scores: normal logits, some entries at float32's minimum (masked keys), and
  the first key of every row visible (as a causal mask leaves it)."""
  rng = np.random.default_rng(seed)
  scores = rng.normal(scale=3.0, size=shape).astype(np.float32)
  masked = rng.random(shape) < masked_fraction
  masked[..., 0] = False
  return jnp.asarray(np.where(masked, np.finfo(np.float32).min, scores))


def test_values_equal_jax_nn_softmax_under_jit():
  scores = _scores((3, 2, 2, 5, 7))
  ours = jax.jit(softmax)(scores)
  np.testing.assert_array_equal(np.asarray(ours),
                                np.asarray(jax.jit(jax.nn.softmax)(scores)))
  np.testing.assert_allclose(np.asarray(jnp.sum(ours, axis=-1)), 1.0, rtol=1e-6)


def test_hand_computed_values_and_gradient():
  scores = jnp.asarray([[0.0, np.log(3.0)]], jnp.float32)  # p = (1/4, 3/4)
  np.testing.assert_allclose(np.asarray(softmax(scores)), [[0.25, 0.75]], rtol=1e-6)
  # d p_1 / d s = p_1 (e_1 - p) = (-3/16, 3/16)
  grad = jax.grad(lambda s: softmax(s)[0, 1])(scores)
  np.testing.assert_allclose(np.asarray(grad), [[-3 / 16, 3 / 16]], rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_matches_autodiff_of_the_formula_under_jit(dtype):
  scores = _scores((4, 2, 3, 6, 6), seed=1).astype(dtype)
  cotangent = jnp.asarray(np.random.default_rng(2).normal(size=scores.shape), dtype)

  def vjp_of(fn):
    return jax.jit(lambda s: jax.vjp(fn, s)[1](cotangent)[0])(scores)

  ours, reference = vjp_of(softmax), vjp_of(lambda s: jax.nn.softmax(s, axis=-1))
  assert ours.dtype == reference.dtype == dtype
  ours, reference = np.asarray(ours, np.float32), np.asarray(reference, np.float32)
  if dtype == jnp.float32:
    np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-6)
  else:  # one bfloat16 rounding of the sum apart
    np.testing.assert_allclose(ours, reference, rtol=2e-2, atol=2e-2)
  masked = np.asarray(scores, np.float32) == np.float32(np.finfo(np.float32).min)
  if dtype == jnp.float32:
    assert np.all(ours[masked] == 0.0)  # masked keys get no gradient


def test_vmap_equals_the_batched_call():
  scores = _scores((5, 3, 4), seed=3)
  cotangent = jnp.asarray(np.random.default_rng(4).normal(size=scores.shape), jnp.float32)

  def grad_fn(s, c):
    return jax.vjp(softmax, s)[1](c)[0]

  np.testing.assert_array_equal(np.asarray(jax.vmap(softmax)(scores)),
                                np.asarray(softmax(scores)))
  np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(grad_fn))(scores, cotangent)),
                             np.asarray(jax.jit(grad_fn)(scores, cotangent)), rtol=1e-6, atol=1e-7)
