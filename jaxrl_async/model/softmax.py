"""Softmax over the last axis with the compact backward pass, for attention probabilities.

    p = exp(s - max(s)) / sum(exp(s - max(s)))          (forward, as `jax.nn.softmax`)
    ds = p * (dp - sum(p * dp))                         (backward, over the last axis)

Differentiating the forward formula instead (what `jax.nn.softmax` does unless its custom-JVP
flag is on) goes through the exponentials, the division by the sum and the sum's square: more
elementwise passes over the [B, KV, G, T, S] scores in the learner's backward pass. The forward
values are those of `jax.nn.softmax`; the gradient is the same function, rounded differently.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.custom_vjp
def softmax(scores: jax.Array) -> jax.Array:
  """scores [..., S] (float) -> probabilities [..., S], normalised over the last axis."""
  assert scores.ndim >= 1, scores.shape
  shifted = scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True))
  unnormalized = jnp.exp(shifted)
  return unnormalized / jnp.sum(unnormalized, axis=-1, keepdims=True)


def _softmax_forward(scores):
  probs = softmax(scores)
  return probs, probs


def _softmax_backward(probs, probs_cotangent):
  """ds = p * (dp - <p, dp>) over the last axis; p: [..., S], dp: [..., S]."""
  assert probs.shape == probs_cotangent.shape, (probs.shape, probs_cotangent.shape)
  inner = jnp.sum(probs * probs_cotangent, axis=-1, keepdims=True)
  return (probs * (probs_cotangent - inner),)


softmax.defvjp(_softmax_forward, _softmax_backward)
