"""Token sampling: temperature, top-k, top-p, with the behaviour logprob of the drawn token.

The recorded logprob is log softmax(logits / temperature)[token], over the untruncated
distribution, which is what the learner recomputes (`losses.token_logprobs` with the same
temperature). Top-k / top-p truncation changes which tokens can be drawn but is not reflected in
the recorded logprob; keep them off (the defaults) where exact importance ratios matter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl_async.config_types import check_field_types


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  temperature: float = 1.0  # 0 = greedy
  top_k: int = 0  # 0 = off
  top_p: float = 1.0  # 1 = off

  def __post_init__(self):
    check_field_types(self)
    if self.temperature < 0:
      raise ValueError(f"temperature must be >= 0, got {self.temperature}")
    if self.top_k < 0:
      raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_token(logits: jax.Array, key: jax.Array, config: SamplingConfig):
  """logits: [V] float32, key: a PRNG key -> (token int32 [], behaviour logprob float32 [])."""
  assert logits.ndim == 1, logits.shape
  if config.temperature == 0.0:
    token = jnp.argmax(logits).astype(jnp.int32)
    return token, jax.nn.log_softmax(logits)[token]
  scaled = logits / config.temperature
  logprobs = jax.nn.log_softmax(scaled)
  masked = scaled
  if config.top_k:
    kth = jax.lax.top_k(scaled, config.top_k)[0][-1]
    masked = jnp.where(scaled < kth, -jnp.inf, masked)
  if config.top_p < 1.0:
    order = jnp.argsort(-masked)
    sorted_probs = jax.nn.softmax(masked[order])
    # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
    keep_sorted = (jnp.cumsum(sorted_probs) - sorted_probs) < config.top_p
    keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
    masked = jnp.where(keep, masked, -jnp.inf)
  token = jax.random.categorical(key, masked).astype(jnp.int32)
  return token, logprobs[token]
