"""Group-relative advantages (GRPO, Dr.GRPO): pure functions of reward arrays.

GRPO (Shao et al. 2024, "DeepSeekMath", sec. 4.1.2) samples K responses per prompt and scores
each against its group:

    A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

Dr.GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training") drops the division by the group
std, whose effect is to up-weight prompts that are nearly always (or never) solved:

    A_i = r_i - mean(r_group)

The std is the population std (ddof=0) by default, so a group of two rewards {0, 1} gets
advantages {-1, +1}. verl and TRL use the unbiased std (ddof=1); pass `ddof=1` to match them.
`eps` (1e-6) is added to the std, not to the variance. A group with equal rewards gets advantage
exactly 0 (never NaN, and no float residue divided by eps): rewards are shifted by the group max
before the mean is taken, so equal rewards centre to exact zeros.

The advantage is per sequence; `broadcast_to_tokens` copies it onto each response token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _as_float(rewards: jax.Array) -> jax.Array:
  rewards = jnp.asarray(rewards)
  if not jnp.issubdtype(rewards.dtype, jnp.floating):
    rewards = rewards.astype(jnp.float32)
  return rewards


def _check_ddof(ddof: int) -> None:
  if ddof not in (0, 1):
    raise ValueError(f"ddof must be 0 or 1, got {ddof!r}")


def group_advantages(rewards: jax.Array, *, normalize_std: bool = True, eps: float = 1e-6,
                     ddof: int = 0) -> jax.Array:
  """GRPO / Dr.GRPO advantages for groups of equal size.

  Args:
    rewards: [G, K] one row per prompt group, K responses each.
    normalize_std: True for GRPO, (r - mean) / (std + eps); False for Dr.GRPO, r - mean.
    eps: added to the group std (GRPO only).
    ddof: 0 for the population std (default), 1 for the unbiased std (as verl, TRL).

  Returns:
    advantages: [G, K], float.
  """
  rewards = _as_float(rewards)
  assert rewards.ndim == 2, f"rewards must be [G, K], got shape {rewards.shape}"
  _check_ddof(ddof)
  group_size = rewards.shape[1]
  # Shifting by a member of the group first makes equal rewards centre to exactly 0: the float
  # mean of K copies of r need not be r, and (r - mean) / (std + eps) would then be O(1).
  shifted = rewards - jnp.max(rewards, axis=1, keepdims=True)
  centred = shifted - jnp.mean(shifted, axis=1, keepdims=True)
  if not normalize_std:
    return centred
  var = jnp.sum(centred * centred, axis=1, keepdims=True) / max(group_size - ddof, 1)
  return centred / (jnp.sqrt(var) + eps)


def grouped(rewards: jax.Array, group_size: int) -> jax.Array:
  """Reshapes rewards [B] laid out group by group (K contiguous responses) to [B // K, K]."""
  rewards = jnp.asarray(rewards)
  assert rewards.ndim == 1, f"rewards must be [B], got shape {rewards.shape}"
  if not isinstance(group_size, int) or group_size < 1:
    raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
  if rewards.shape[0] % group_size:
    raise ValueError(
        f"group_size={group_size} does not divide the batch of {rewards.shape[0]} rewards")
  return rewards.reshape(rewards.shape[0] // group_size, group_size)


def advantages_from_flat(rewards: jax.Array, group_ids: jax.Array, num_groups: int, *,
                         normalize_std: bool = True, eps: float = 1e-6,
                         ddof: int = 0) -> jax.Array:
  """GRPO / Dr.GRPO advantages for groups given by id, in any order and of any size.

  Same equations as `group_advantages`, with group statistics from segment sums, so groups may
  be ragged (e.g. after a sample of a group was dropped) and interleaved. A row whose id lies
  outside [0, num_groups) (padding, e.g. -1) gets advantage 0 and does not enter any group.

  Args:
    rewards: [B] one reward per response.
    group_ids: [B] int, the response's group in [0, num_groups).
    num_groups: static int, an upper bound on the number of groups (segment count).
    normalize_std, eps, ddof: as in `group_advantages`.

  Returns:
    advantages: [B], float.
  """
  rewards = _as_float(rewards)
  group_ids = jnp.asarray(group_ids)
  assert rewards.ndim == 1, f"rewards must be [B], got shape {rewards.shape}"
  assert group_ids.shape == rewards.shape, (
      f"group_ids {group_ids.shape} must match rewards {rewards.shape}")
  assert jnp.issubdtype(group_ids.dtype, jnp.integer), (
      f"group_ids must be int, got {group_ids.dtype}")
  _check_ddof(ddof)
  valid = (group_ids >= 0) & (group_ids < num_groups)
  safe_ids = jnp.where(valid, group_ids, 0)
  weight = valid.astype(rewards.dtype)

  def segment_total(values):
    return jax.ops.segment_sum(values * weight, safe_ids, num_segments=num_groups)

  count = segment_total(jnp.ones_like(rewards))
  # Shift by the group max first, so equal rewards centre to exactly 0 (see group_advantages).
  group_max = jax.ops.segment_max(jnp.where(valid, rewards, -jnp.inf), safe_ids,
                                  num_segments=num_groups)
  shifted = jnp.where(valid, rewards - group_max[safe_ids], 0.0)
  mean = segment_total(shifted) / jnp.maximum(count, 1.0)
  centred = shifted - mean[safe_ids]
  if normalize_std:
    var = segment_total(centred * centred) / jnp.maximum(count - ddof, 1.0)
    centred = centred / (jnp.sqrt(var)[safe_ids] + eps)
  return jnp.where(valid, centred, 0.0)


def broadcast_to_tokens(advantages: jax.Array, mask: jax.Array) -> jax.Array:
  """Per-sequence advantages [B] -> per-token [B, T]: A[b] on valid tokens, 0 on padding.

  Args:
    advantages: [B].
    mask: [B, T] bool or {0, 1}, 1 on response tokens that enter the loss.
  """
  advantages = jnp.asarray(advantages)
  mask = jnp.asarray(mask)
  assert advantages.ndim == 1, f"advantages must be [B], got shape {advantages.shape}"
  assert mask.ndim == 2 and mask.shape[0] == advantages.shape[0], (
      f"mask must be [B, T] with B={advantages.shape[0]}, got shape {mask.shape}")
  return jnp.where(mask > 0, advantages[:, None], jnp.zeros((), advantages.dtype))
