"""Loss aggregation over tokens (verl's loss_agg_mode), for rows or packed sequences.

A sequence is a row of [B, T], or, in packed rows, the tokens sharing a `sequence_ids` value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl_async.learner.checks import check_choice, check_number, check_tokens

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _sequence_sums(masked, valid, sequence_ids, num_sequences):
  """Per-sequence (sum of values, number of valid tokens): rows, or segments of packed rows."""
  if sequence_ids is None:
    return jnp.sum(masked, axis=-1), jnp.sum(valid, axis=-1).astype(masked.dtype)
  if num_sequences is None:
    raise ValueError("sequence_ids needs num_sequences (the number of sequences in the batch)")
  sequence_ids = jnp.asarray(sequence_ids)
  assert sequence_ids.shape == masked.shape, (
      f"sequence_ids must be [B, T] = {masked.shape}, got {sequence_ids.shape}")
  ids = jnp.where(valid, sequence_ids, num_sequences).reshape(-1)  # invalid tokens: dropped
  sums = jax.ops.segment_sum(masked.reshape(-1), ids, num_segments=num_sequences)
  counts = jax.ops.segment_sum(valid.reshape(-1).astype(masked.dtype), ids,
                               num_segments=num_sequences)
  return sums, counts


def aggregate_parts(values: jax.Array, mask: jax.Array, mode: str, *,
                    max_length: int | None = None, sequence_ids: jax.Array | None = None,
                    num_sequences: int | None = None) -> tuple[jax.Array, jax.Array]:
  """The loss of `aggregate` as (numerator, denominator), so it can be normalised globally.

  Summing both parts over micro-batches (or devices) and dividing once gives the aggregate of the
  whole batch; `aggregate` is numerator / max(denominator, 1).
  """
  check_choice("agg_mode", mode, AGG_MODES)
  values, mask = jnp.asarray(values), jnp.asarray(mask)
  check_tokens(mask, values=values)
  valid = mask > 0
  masked = jnp.where(valid, values, 0.0)
  row_sums, tokens_per_row = _sequence_sums(masked, valid, sequence_ids, num_sequences)
  nonempty_rows = jnp.sum(tokens_per_row > 0).astype(masked.dtype)
  if mode == "token-mean":
    return jnp.sum(row_sums), jnp.sum(tokens_per_row)
  if mode == "seq-mean-token-mean":
    return jnp.sum(row_sums / jnp.maximum(tokens_per_row, 1.0)), nonempty_rows
  if mode == "seq-mean-token-sum":
    return jnp.sum(row_sums), nonempty_rows
  max_length = values.shape[-1] if max_length is None else max_length
  check_number("max_length", max_length, 0, low_inclusive=False)
  return jnp.sum(row_sums) / max_length, jnp.asarray(row_sums.shape[0], masked.dtype)


def aggregate(values: jax.Array, mask: jax.Array, mode: str = "token-mean", *,
              max_length: int | None = None, sequence_ids: jax.Array | None = None,
              num_sequences: int | None = None) -> jax.Array:
  """Reduces per-token values [B, T] to a scalar over the valid tokens (verl's loss_agg_mode).

  - 'token-mean': sum_bt m v / sum_bt m. Every token weighs the same, so long responses are not
    down-weighted (DAPO, Yu et al. 2025, sec. 3.3).
  - 'seq-mean-token-mean': mean over non-empty rows of (sum_t m v / sum_t m), the original GRPO
    objective (Shao et al. 2024, eq. 3).
  - 'seq-mean-token-sum': mean over non-empty rows of sum_t m v.
  - 'seq-mean-token-sum-norm': sum_bt m v / (B * max_length), max_length defaulting to T: a
    constant normaliser independent of the mask (Dr.GRPO, Liu et al. 2025).
  A batch without valid tokens aggregates to 0, not NaN. Rows without valid tokens do not count
  in the seq-mean modes' denominators.

  A sequence is a row, or, for packed rows, the tokens sharing a `sequence_ids` value in
  [0, num_sequences) (then B in 'seq-mean-token-sum-norm' is num_sequences).

  Args:
    values: [B, T].
    mask: [B, T] bool or {0, 1}.
    mode: one of AGG_MODES.
    max_length: static generation budget for 'seq-mean-token-sum-norm'.
    sequence_ids: [B, T] int, the sequence of each token in packed rows, or None (one per row).
    num_sequences: static number of sequences, with sequence_ids.

  Returns:
    scalar.
  """
  numerator, denominator = aggregate_parts(values, mask, mode, max_length=max_length,
                                           sequence_ids=sequence_ids,
                                           num_sequences=num_sequences)
  return numerator / jnp.maximum(denominator, 1.0)
