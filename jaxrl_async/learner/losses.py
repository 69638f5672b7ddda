"""Policy-gradient losses for LM post-training: pure functions of per-token arrays.

Axes: B sequences, T response tokens, V vocabulary. `mask: [B, T]` (bool or {0, 1}) marks the
tokens that enter the loss; values at masked positions never reach the loss, its gradient or a
metric, even when they are inf or NaN.

Every loss returns `(loss, metrics)`. A metric value is either
- a `(sum, count)` pair of scalar arrays: the reduction over micro-batches or devices adds both
  entries, and the logger divides once (token-level quantities count tokens; a per-call scalar
  such as 'pg_loss' counts 1, so it is averaged over micro-batches), or
- a scalar whose key ends in '_max' (e.g. 'is_weight_max'): reduced by maximum.

Mode selectors (`agg_mode`, `kind`, `is_cap_mode`, `source`) are Python strings, static under jit.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from jaxrl_async.learner.aggregation import AGG_MODES, aggregate, aggregate_parts  # noqa: F401
from jaxrl_async.learner.checks import check_choice, check_number, check_tokens, is_zero

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
IS_CAP_MODES = ("mask", "clamp")


def _pair(values: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum over valid tokens, number of valid tokens)."""
  valid = mask > 0
  return (jnp.sum(jnp.where(valid, values, 0.0)).astype(jnp.float32),
          jnp.sum(valid).astype(jnp.float32))


# ---- PPO surrogate ------------------------------------------------------------------------------
def _check_clip(clip_low, clip_high, dual_clip) -> None:
  check_number("clip_low", clip_low, 0.0)
  if isinstance(clip_low, numbers.Real) and clip_low > 1.0:
    raise ValueError(f"clip_low must be <= 1, got {clip_low!r}")
  check_number("clip_high", clip_high, 0.0)
  if dual_clip is not None:
    check_number("dual_clip", dual_clip, 1.0, low_inclusive=False)


def _ppo_token_loss(log_ratio, advantages, clip_low, clip_high, dual_clip):
  """Per-token clipped surrogate -> (loss, ratio, clipped, dual_clipped), all [B, T]."""
  ratio = jnp.exp(log_ratio)
  unclipped_loss = -ratio * advantages
  clipped_loss = -jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
  clipped = clipped_loss > unclipped_loss
  loss = jnp.maximum(unclipped_loss, clipped_loss)
  if dual_clip is None:
    return loss, ratio, clipped, jnp.zeros_like(clipped)
  dual_bound = -dual_clip * advantages
  dual_clipped = (advantages < 0) & (loss > dual_bound)
  return jnp.where(dual_clipped, dual_bound, loss), ratio, clipped, dual_clipped


def clipped_policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array,
                        mask: jax.Array, *, clip_low: float = 0.2, clip_high: float = 0.2,
                        dual_clip: float | None = None, agg_mode: str = "token-mean",
                        max_length: int | None = None, sequence_ids: jax.Array | None = None,
                        num_sequences: int | None = None) -> tuple[jax.Array, dict]:
  """PPO clipped surrogate (Schulman et al. 2017, eq. 7) with asymmetric and dual clipping.

  Per token, with r = exp(logp - old_logp):

      l = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)

  clip_high > clip_low is DAPO's clip-higher (Yu et al. 2025, sec. 3.1). With dual_clip = c > 1,
  tokens with A < 0 are also bounded below in the objective (dual-clip PPO, Ye et al. 2020,
  "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"):

      objective = max(min(r A, clip(r) A), c A)   i.e.   l = min(l, -c A)   for A < 0.

  Args:
    logp: [B, T] log pi_theta(token), differentiated.
    old_logp: [B, T] log pi_old(token), data (gradient stopped).
    advantages: [B, T] per-token advantages (see advantages.broadcast_to_tokens).
    mask: [B, T] bool or {0, 1}.
    clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
    dual_clip: c > 1, or None for no dual clip.
    agg_mode: one of AGG_MODES; max_length, sequence_ids, num_sequences: see `aggregate`.

  Returns:
    loss: scalar.
    metrics: (sum, count) pairs over valid tokens: 'clipfrac' (the clipped term was the minimum,
      so the token has no gradient), 'dual_clip_frac', 'ratio_mean', 'approx_kl' (k1 estimate of
      KL(pi_old || pi_theta), mean of old_logp - logp).
  """
  logp, old_logp, advantages, mask = map(jnp.asarray, (logp, old_logp, advantages, mask))
  check_tokens(mask, logp=logp, old_logp=old_logp, advantages=advantages)
  check_choice("agg_mode", agg_mode, AGG_MODES)
  _check_clip(clip_low, clip_high, dual_clip)
  valid = mask > 0
  log_ratio = jnp.where(valid, logp - jax.lax.stop_gradient(old_logp), 0.0)
  advantages = jnp.where(valid, jax.lax.stop_gradient(advantages), 0.0)
  token_loss, ratio, clipped, dual_clipped = _ppo_token_loss(
      log_ratio, advantages, clip_low, clip_high, dual_clip)
  metrics = {
      "clipfrac": _pair(clipped, mask),
      "dual_clip_frac": _pair(dual_clipped, mask),
      "ratio_mean": _pair(jax.lax.stop_gradient(ratio), mask),
      "approx_kl": _pair(jax.lax.stop_gradient(-log_ratio), mask),
  }
  return aggregate(token_loss, mask, agg_mode, max_length=max_length, sequence_ids=sequence_ids,
                   num_sequences=num_sequences), metrics


def decoupled_policy_loss(logp: jax.Array, proximal_logp: jax.Array, behaviour_logp: jax.Array,
                          advantages: jax.Array, mask: jax.Array, *, clip_low: float = 0.2,
                          clip_high: float = 0.2, dual_clip: float | None = None,
                          is_cap: float | None = 5.0, is_cap_mode: str = "mask",
                          agg_mode: str = "token-mean", max_length: int | None = None,
                          sequence_ids: jax.Array | None = None,
                          num_sequences: int | None = None) -> tuple[jax.Array, dict]:
  """Decoupled PPO: trust region around pi_prox, importance weight for pi_behav.

  Hilton et al. 2022 ("Batch size-invariance for policy optimization") and AReaL (Fu et al. 2025).
  Per token, with r = exp(logp - proximal_logp) and the behaviour weight
  w = exp(proximal_logp - behaviour_logp) (data, gradient stopped):

      l = w * l_ppo(r, A)     (l_ppo as in `clipped_policy_loss`)

  The weight is capped at is_cap: 'clamp' uses min(w, is_cap); 'mask' gives tokens with
  w > is_cap weight 0. A masked token stays in the aggregation's denominator (as in AReaL), so
  masking removes its contribution without up-weighting the other tokens. With
  proximal_logp == behaviour_logp, w = 1 and this equals `clipped_policy_loss` exactly.

  Args:
    logp: [B, T] log pi_theta, differentiated.
    proximal_logp: [B, T] log pi_prox (see `proximal_logprob`), data.
    behaviour_logp: [B, T] log pi_behav, the logprob the rollout sampled with, data.
    advantages, mask, clip_low, clip_high, dual_clip, agg_mode, max_length, sequence_ids,
      num_sequences: as in `clipped_policy_loss`.
    is_cap: cap on w (>= 1), or None for no cap.
    is_cap_mode: 'mask' or 'clamp'.

  Returns:
    loss: scalar.
    metrics: those of `clipped_policy_loss` (ratio against pi_prox), and over valid tokens
      'is_weight_mean' (sum, count) of the uncapped w, 'is_weight_max' the largest uncapped w (a
      scalar reduced by max; 0 without valid tokens), 'capped_fraction' (w > is_cap) and
      'masked_fraction' (tokens removed by 'mask'; 0 for 'clamp').
  """
  logp, proximal_logp, behaviour_logp, advantages, mask = map(
      jnp.asarray, (logp, proximal_logp, behaviour_logp, advantages, mask))
  check_tokens(mask, logp=logp, proximal_logp=proximal_logp, behaviour_logp=behaviour_logp,
                advantages=advantages)
  check_choice("agg_mode", agg_mode, AGG_MODES)
  check_choice("is_cap_mode", is_cap_mode, IS_CAP_MODES)
  _check_clip(clip_low, clip_high, dual_clip)
  if is_cap is not None:
    check_number("is_cap", is_cap, 1.0)
  valid = mask > 0
  log_ratio = jnp.where(valid, logp - jax.lax.stop_gradient(proximal_logp), 0.0)
  advantages = jnp.where(valid, jax.lax.stop_gradient(advantages), 0.0)
  token_loss, ratio, clipped, dual_clipped = _ppo_token_loss(
      log_ratio, advantages, clip_low, clip_high, dual_clip)

  behaviour_weight = jnp.exp(jax.lax.stop_gradient(
      jnp.where(valid, proximal_logp - behaviour_logp, 0.0)))
  if is_cap is None:
    capped = jnp.zeros_like(valid)
    weight = behaviour_weight
  else:
    capped = valid & (behaviour_weight > is_cap)
    replacement = 0.0 if is_cap_mode == "mask" else is_cap
    weight = jnp.where(capped, jnp.asarray(replacement, behaviour_weight.dtype), behaviour_weight)
  masked = capped if is_cap_mode == "mask" else jnp.zeros_like(capped)
  token_loss = weight * token_loss  # weight is 0, not an overflowed inf, on masked tokens

  metrics = {
      "clipfrac": _pair(clipped, mask),
      "dual_clip_frac": _pair(dual_clipped, mask),
      "ratio_mean": _pair(jax.lax.stop_gradient(ratio), mask),
      "approx_kl": _pair(jax.lax.stop_gradient(-log_ratio), mask),
      "is_weight_mean": _pair(behaviour_weight, mask),
      "is_weight_max": jnp.max(jnp.where(valid, behaviour_weight, 0.0)).astype(jnp.float32),
      "capped_fraction": _pair(capped, mask),
      "masked_fraction": _pair(masked, mask),
  }
  return aggregate(token_loss, mask, agg_mode, max_length=max_length, sequence_ids=sequence_ids,
                   num_sequences=num_sequences), metrics


# ---- per-token quantities from logits -----------------------------------------------------------
def kl_penalty(logp: jax.Array, ref_logp: jax.Array, kind: str = "k3") -> jax.Array:
  """Per-token estimators of KL(pi_theta || pi_ref) on tokens sampled from pi_theta [B, T].

  With d = ref_logp - logp (Schulman 2020, "Approximating KL Divergence"):
  - 'k1': -d (unbiased, high variance, can be negative);
  - 'k2': d^2 / 2 (biased, low variance);
  - 'k3': exp(d) - d - 1 (unbiased, >= 0; the GRPO penalty, Shao et al. 2024, eq. 4);
  - 'low_var_kl': k3 with d clipped to [-20, 20] and the result to [-10, 10] (verl), so a token
    the reference finds impossible cannot overflow the loss.
  """
  check_choice("kind", kind, KL_KINDS)
  logp, ref_logp = jnp.asarray(logp), jnp.asarray(ref_logp)
  assert logp.shape == ref_logp.shape, f"logp {logp.shape} and ref_logp {ref_logp.shape} differ"
  log_ratio = ref_logp - logp
  if kind == "k1":
    return -log_ratio
  if kind == "k2":
    return 0.5 * jnp.square(log_ratio)
  if kind == "low_var_kl":
    log_ratio = jnp.clip(log_ratio, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)
  return jnp.exp(log_ratio) - log_ratio - 1.0


def _scaled_logits(logits: jax.Array, temperature: float) -> jax.Array:
  check_number("temperature", temperature, 0.0, low_inclusive=False)
  return jnp.asarray(logits).astype(jnp.float32) / temperature


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
  """log softmax(logits / temperature)[targets], in float32, [B, T].

  Computed as z[target] - max(z) - log sum exp(z - max(z)), the same arithmetic as
  jax.nn.log_softmax gathered at the targets, without materialising the [B, T, V] log-softmax.
  The rollout engine and the learner both call this function, so that an on-policy token's
  behaviour and current logprobs agree to rounding.

  Args:
    logits: [B, T, V], any float dtype.
    targets: [B, T] int in [0, V) (fill padding with any valid id, e.g. 0).
    temperature: > 0, the sampling temperature.
  """
  logits, targets = jnp.asarray(logits), jnp.asarray(targets)
  assert logits.ndim == 3, f"logits must be [B, T, V], got shape {logits.shape}"
  assert targets.shape == logits.shape[:2], (
      f"targets must be [B, T] = {logits.shape[:2]}, got {targets.shape}")
  scaled = _scaled_logits(logits, temperature)
  shifted = scaled - jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
  target_shifted = jnp.take_along_axis(shifted, targets[..., None].astype(jnp.int32), axis=-1)
  return target_shifted[..., 0] - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))


def entropy_from_logits(logits: jax.Array, mask: jax.Array | None = None,
                        temperature: float = 1.0) -> jax.Array:
  """Per-token entropy H = -sum_v p_v log p_v of softmax(logits / temperature), [B, T], float32.

  From log_softmax, so large logits do not overflow; vocabulary entries with logit -inf
  (p = 0) contribute 0, with a finite gradient. Zero where mask is 0.

  Args:
    logits: [B, T, V].
    mask: [B, T] bool or {0, 1}, or None.
    temperature: > 0.
  """
  logits = jnp.asarray(logits)
  assert logits.ndim == 3, f"logits must be [B, T, V], got shape {logits.shape}"
  log_probs = jax.nn.log_softmax(_scaled_logits(logits, temperature), axis=-1)
  probs = jnp.exp(log_probs)
  entropy = -jnp.sum(probs * jnp.where(probs > 0, log_probs, 0.0), axis=-1)
  if mask is None:
    return entropy
  mask = jnp.asarray(mask)
  assert mask.shape == logits.shape[:2], f"mask must be [B, T] = {logits.shape[:2]}"
  return jnp.where(mask > 0, entropy, 0.0)


def _check_chunk_size(chunk_size) -> None:
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
    raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")


def chunked_logprobs_and_entropy(hidden: jax.Array, head: jax.Array, targets: jax.Array,
                                 project, temperature: float = 1.0,
                                 chunk_size: int = 64) -> tuple[jax.Array, jax.Array]:
  """`token_logprobs` and `entropy_from_logits` from hidden states, chunk_size positions at a time.

  The [B, T, V] logits never exist at once: the positions are cut into chunks (the last one
  padded), and each chunk's [B, chunk_size, V] logits are computed, reduced to a logprob and an
  entropy per token, and dropped (`jax.lax.map`). Each chunk is wrapped in `jax.checkpoint`, so
  the backward pass recomputes its logits instead of storing them: memory for the logits is
  O(B * chunk_size * V) in both passes. The arithmetic per token is that of the unchunked
  functions, so the results agree to float32 rounding.

  Args:
    hidden: [B, T, D] final hidden states (after the final norm).
    head: the unembedding, as `project` takes it ([D, V], or a tied embedding's [V, D]).
    targets: [B, T] int in [0, V).
    project: (hidden [B, c, D], head) -> float32 logits [B, c, V] (`model.project_logits`).
    temperature: > 0.
    chunk_size: positions per chunk, >= 1 (need not divide T).

  Returns:
    (logprobs [B, T], entropy [B, T]), float32, unmasked.
  """
  check_number("temperature", temperature, 0.0, low_inclusive=False)
  _check_chunk_size(chunk_size)
  hidden, head, targets = jnp.asarray(hidden), jnp.asarray(head), jnp.asarray(targets)
  assert hidden.ndim == 3, f"hidden must be [B, T, D], got shape {hidden.shape}"
  assert targets.shape == hidden.shape[:2], (
      f"targets must be [B, T] = {hidden.shape[:2]}, got {targets.shape}")
  batch, length, dim = hidden.shape
  chunk_size = max(1, min(chunk_size, length))  # no padding beyond one short sequence
  chunks = -(-length // chunk_size)
  pad = chunks * chunk_size - length
  hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets.astype(jnp.int32), ((0, 0), (0, pad)))
  hidden = hidden.reshape(batch, chunks, chunk_size, dim).transpose(1, 0, 2, 3)
  targets = targets.reshape(batch, chunks, chunk_size).transpose(1, 0, 2)

  @jax.checkpoint
  def one_chunk(head, hidden_chunk, target_chunk):
    logits = project(hidden_chunk, head)
    return (token_logprobs(logits, target_chunk, temperature),
            entropy_from_logits(logits, None, temperature))

  logp, entropy = jax.lax.map(lambda xs: one_chunk(head, *xs), (hidden, targets))

  def unchunk(x):
    return x.transpose(1, 0, 2).reshape(batch, chunks * chunk_size)[:, :length]

  return unchunk(logp), unchunk(entropy)


# ---- the learner's objective --------------------------------------------------------------------
def policy_loss(logp: jax.Array, old_logp: jax.Array, advantages: jax.Array, mask: jax.Array, *,
                behaviour_logp: jax.Array | None = None, ref_logp: jax.Array | None = None,
                entropy: jax.Array | None = None, kl_coef: float = 0.0, kl_kind: str = "k3",
                entropy_coef: float = 0.0, clip_low: float = 0.2, clip_high: float = 0.2,
                dual_clip: float | None = None, is_cap: float | None = 5.0,
                is_cap_mode: str = "mask", agg_mode: str = "token-mean",
                max_length: int | None = None, sequence_ids: jax.Array | None = None,
                num_sequences: int | None = None) -> tuple[jax.Array, dict]:
  """total = pg_loss + kl_coef * agg(KL) - entropy_coef * agg(entropy), with agg = agg_mode.

  The policy term is `clipped_policy_loss` against old_logp, or, when behaviour_logp is given,
  `decoupled_policy_loss` with old_logp as the proximal logprob. The KL penalty in the loss is
  GRPO's (Shao et al. 2024, eq. 3).

  Args:
    logp: [B, T] log pi_theta, differentiated.
    old_logp: [B, T] the ratio's anchor: behaviour logprob (PPO) or proximal logprob (decoupled).
    advantages: [B, T]; mask: [B, T].
    behaviour_logp: [B, T] or None; selects the decoupled loss.
    ref_logp: [B, T] reference-policy logprob, or None; needed when kl_coef != 0.
    entropy: [B, T] per-token entropy (`entropy_from_logits`), or None; needed when
      entropy_coef != 0. Its gradient, if any, flows into the bonus.
    kl_coef, kl_kind, entropy_coef: weights and KL estimator (see `kl_penalty`).
    clip_low, clip_high, dual_clip, is_cap, is_cap_mode, agg_mode, max_length, sequence_ids,
      num_sequences: as in the losses.

  Returns:
    loss: scalar.
    metrics: the policy term's, plus 'pg_loss' (pg_loss, 1), 'kl' (sum, count) when ref_logp is
      given, 'entropy' (sum, count) when entropy is given.
  """
  check_choice("kl_kind", kl_kind, KL_KINDS)
  if not is_zero(kl_coef) and ref_logp is None:
    raise ValueError(f"kl_coef={kl_coef!r} needs ref_logp")
  if not is_zero(entropy_coef) and entropy is None:
    raise ValueError(f"entropy_coef={entropy_coef!r} needs entropy")
  agg_kwargs = dict(max_length=max_length, sequence_ids=sequence_ids,
                    num_sequences=num_sequences)
  clip_kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
                     agg_mode=agg_mode, **agg_kwargs)
  if behaviour_logp is None:
    pg_loss, metrics = clipped_policy_loss(logp, old_logp, advantages, mask, **clip_kwargs)
  else:
    pg_loss, metrics = decoupled_policy_loss(logp, old_logp, behaviour_logp, advantages, mask,
                                             is_cap=is_cap, is_cap_mode=is_cap_mode,
                                             **clip_kwargs)
  total = pg_loss
  metrics["pg_loss"] = (jax.lax.stop_gradient(pg_loss).astype(jnp.float32),
                        jnp.ones((), jnp.float32))
  valid = jnp.asarray(mask) > 0
  if ref_logp is not None:
    ref_logp = jnp.asarray(ref_logp)
    check_tokens(valid, ref_logp=ref_logp)
    # Padding is zeroed before exp(), so its gradient cannot be 0 * inf.
    kl = kl_penalty(jnp.where(valid, logp, 0.0), jnp.where(valid, ref_logp, 0.0), kl_kind)
    metrics["kl"] = _pair(jax.lax.stop_gradient(kl), mask)
    if not is_zero(kl_coef):
      total = total + kl_coef * aggregate(kl, mask, agg_mode, **agg_kwargs)
  if entropy is not None:
    entropy = jnp.asarray(entropy)
    check_tokens(valid, entropy=entropy)
    metrics["entropy"] = _pair(jax.lax.stop_gradient(entropy), mask)
    if not is_zero(entropy_coef):
      total = total - entropy_coef * aggregate(entropy, mask, agg_mode, **agg_kwargs)
  return total, metrics
