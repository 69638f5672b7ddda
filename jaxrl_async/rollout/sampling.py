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


# From this vocabulary size up, tokens are drawn by inverting the CDF (one random number per
# draw) instead of Gumbel-max (one per vocabulary entry, which at 150k entries costs more than a
# small model's forward pass on a CPU). Both draw from the same distribution; below the
# threshold Gumbel-max costs little and keeps the token streams of small-vocabulary runs (the
# built-in task, the test models) as they were, so recorded runs replay token for token.
INVERSE_CDF_MIN_VOCAB = 32_768


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
  if masked.shape[0] >= INVERSE_CDF_MIN_VOCAB:
    token = inverse_cdf_draw(key, masked)
  else:
    token = jax.random.categorical(key, masked).astype(jnp.int32)
  return token, logprobs[token]


def inverse_cdf_draw(key: jax.Array, logits: jax.Array, block: int = 1024) -> jax.Array:
  """A token drawn from softmax(logits) [V] (-inf: never drawn) by inverting its CDF.

  One uniform per draw: the cumulative mass is found over blocks of `block` tokens, then inside
  the chosen block. Gumbel-max (`jax.random.categorical`) needs V random numbers per draw,
  which over a 150k vocabulary costs more than the rest of a small model's decode step.
  Only tokens of positive mass can come out, even where float rounding puts u at the very end.
  """
  vocab = logits.shape[0]
  block = min(block, vocab)
  num_blocks = -(-vocab // block)
  weights = jnp.exp(logits - jnp.max(logits))
  weights = jnp.pad(weights, (0, num_blocks * block - vocab)).reshape(num_blocks, block)
  block_mass = weights.sum(axis=1)
  block_cdf = jnp.cumsum(block_mass)
  u = jax.random.uniform(key, (), jnp.float32) * block_cdf[-1]
  chosen = _first_or_last(block_cdf > u, block_mass > 0)
  inner = weights[chosen]
  inner_cdf = jnp.cumsum(inner)
  rest = u - (block_cdf[chosen] - block_mass[chosen])
  index = _first_or_last(inner_cdf > rest, inner > 0)
  return (chosen * block + index).astype(jnp.int32)


def _first_or_last(past: jax.Array, positive: jax.Array) -> jax.Array:
  """The first index that is `past` and `positive`; else the last `positive` one."""
  hits = past & positive
  last_positive = positive.shape[0] - 1 - jnp.argmax(positive[::-1])
  return jnp.where(hits.any(), jnp.argmax(hits), last_positive)
