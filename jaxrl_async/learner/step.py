"""The jitted, sharded update: `update(state, batch, anchor_logp, ...) -> (state, metrics)`.

The model runs here and only here on the learner side; the loss and the advantages are the pure
functions of `losses` and `advantages`. The step is compiled once per batch shape, with the
state donated and its shardings fixed on the learner mesh (`jaxrl_async.sharding`).

Old logprobs (the ratio's anchor), by `LearnerConfig`:
- use_rollout_log_probs: clipped PPO against the behaviour logprobs from the rollout.
- otherwise the decoupled objective (AReaL) against a proximal policy:
  'recompute' (the anchor passed in, computed with the weights at the start of the version
  window; at the window's first update those are the current weights, and `anchor_logp=None`
  takes the anchor from the update's own forward pass instead of a second one), 'loglinear'
  (interpolated in-graph from behaviour and current logprobs by version), or 'rollout'
  (proximal = behaviour).

Batches may be packed (`batching.pack`): several samples per row, attention kept within a sample
by segment ids, advantages gathered per token from the token's sample.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh

from jaxrl_async import sharding
from jaxrl_async.config_types import check_field_types
from jaxrl_async.learner import advantages as advantages_lib
from jaxrl_async.learner import losses, proximal
from jaxrl_async.learner.batching import TrainBatch
from jaxrl_async.model import apply
from jaxrl_async.model.decoder import head_of, project_logits

PROXIMAL_SOURCES = ("recompute", "loglinear", "rollout")
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclasses.dataclass(frozen=True)
class LearnerConfig:
  learning_rate: float = 3e-4
  weight_decay: float = 0.0
  adam_b1: float = 0.9
  adam_b2: float = 0.99
  grad_clip: float = 1.0
  clip_low: float = 0.2
  clip_high: float = 0.28
  dual_clip: float | None = None
  agg_mode: str = "token-mean"
  normalize_std: bool = True  # False: Dr.GRPO advantages
  kl_coef: float = 0.0
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  temperature: float = 1.0  # must equal the rollout's sampling temperature
  use_rollout_log_probs: bool = False
  proximal_logprob: str = "recompute"
  is_cap: float | None = 5.0
  is_cap_mode: str = "mask"
  # Positions per chunk of the logprob/entropy computation (`losses.chunked_logprobs_and_entropy`):
  # the [R, T, V] float32 logits are never materialised, and the backward pass recomputes each
  # chunk's; its logits take rows x logit_chunk_size x vocab float32 (several live at once).
  # 0: unchunked (the full logits, as the engine computes them).
  logit_chunk_size: int = 16

  def __post_init__(self):
    # Types first: logit_chunk_size keeps its own check (type and range, a ValueError), then the
    # shared check types every field, then the range checks.
    if (isinstance(self.logit_chunk_size, bool) or not isinstance(self.logit_chunk_size, int)
        or self.logit_chunk_size < 0):
      raise ValueError("LearnerConfig.logit_chunk_size must be an int >= 0 (0: unchunked), got "
                       f"{self.logit_chunk_size!r} ({type(self.logit_chunk_size).__name__})")
    check_field_types(self)
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
    if self.weight_decay < 0:
      raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
    if not self.grad_clip > 0:
      raise ValueError(f"grad_clip must be > 0, got {self.grad_clip}")
    if not self.temperature > 0:
      raise ValueError(f"temperature must be > 0 for training, got {self.temperature}")
    if self.proximal_logprob not in PROXIMAL_SOURCES:
      raise ValueError(
          f"proximal_logprob must be one of {PROXIMAL_SOURCES}, got {self.proximal_logprob!r}")
    if self.agg_mode not in AGG_MODES:
      raise ValueError(f"agg_mode must be one of {AGG_MODES}, got {self.agg_mode!r}")
    if self.kl_kind not in losses.KL_KINDS:
      raise ValueError(f"kl_kind must be one of {losses.KL_KINDS}, got {self.kl_kind!r}")
    if self.kl_coef < 0 or self.entropy_coef < 0:
      raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {self.kl_coef}, "
                       f"{self.entropy_coef}")

  @property
  def old_logprob_source(self) -> str:
    return "rollout" if self.use_rollout_log_probs else self.proximal_logprob

  @property
  def needs_reference(self) -> bool:
    return self.kl_coef > 0

  @property
  def needs_recompute(self) -> bool:
    return not self.use_rollout_log_probs and self.proximal_logprob == "recompute"

  def optimizer(self) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(self.grad_clip),
        optax.adamw(self.learning_rate, b1=self.adam_b1, b2=self.adam_b2,
                    weight_decay=self.weight_decay))


@struct.dataclass
class TrainState:
  step: jax.Array  # int32 []: learner updates so far
  params: Any
  opt_state: Any
  tx: optax.GradientTransformation = struct.field(pytree_node=False)


def init_train_state(params, tx: optax.GradientTransformation, mesh: Mesh, logical_axes) -> TrainState:
  """Place params on the learner mesh by their logical axes and build the optimizer state there."""
  param_sh = sharding.param_shardings(logical_axes, params, mesh)
  # An explicit copy: the state is donated at every update, and device_put may alias the
  # caller's buffers (replicated leaves) even with may_alias=False.
  params = jax.device_put(jax.tree.map(jnp.copy, params), param_sh)
  # Optimizer moments take their parameter's sharding, everything else (counts) is replicated;
  # explicit NamedShardings everywhere, so the jitted update sees the same shardings on every call.
  opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, jax.eval_shape(tx.init, params), param_sh,
                                 transform_non_params=lambda _: sharding.replicated(mesh))
  opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), sharding.replicated(mesh))
  return TrainState(step=step, params=params, opt_state=opt_state, tx=tx)


def state_shardings(state: TrainState):
  return jax.tree.map(lambda x: x.sharding, state)


def sequence_logprobs(graphdef, params, tokens, temperature: float, positions=None,
                      segment_ids=None):
  """log pi(tokens[:, t] | its sample's tokens before t) for t >= 1, as [R, T] with column 0 = 0.

  positions / segment_ids: for packed rows (see `batching.pack`), else None.
  """
  positions = None if positions is None else positions[:, :-1]
  segment_ids = None if segment_ids is None else segment_ids[:, :-1]
  logits, _ = apply(graphdef, params, tokens[:, :-1], positions, segment_ids=segment_ids)
  logp = losses.token_logprobs(logits, tokens[:, 1:], temperature)
  return jnp.pad(logp, ((0, 0), (1, 0))), logits


def sequence_logprobs_and_entropy(graphdef, params, tokens, temperature: float, positions=None,
                                  segment_ids=None, chunk_size: int = 0):
  """(logprobs [R, T] as `sequence_logprobs`, per-token entropy [R, T - 1] of the distributions
  that predicted tokens[:, 1:], unmasked).

  chunk_size > 0: from the final hidden states, chunk_size positions at a time
  (`losses.chunked_logprobs_and_entropy`), never holding the [R, T, V] logits; 0: from the full
  logits.
  """
  if chunk_size == 0:
    logp, logits = sequence_logprobs(graphdef, params, tokens, temperature, positions,
                                     segment_ids)
    return logp, losses.entropy_from_logits(logits, None, temperature)
  positions = None if positions is None else positions[:, :-1]
  segment_ids = None if segment_ids is None else segment_ids[:, :-1]
  hidden, _ = apply(graphdef, params, tokens[:, :-1], positions, segment_ids=segment_ids,
                    return_hidden=True)
  head, vocab_major = head_of(params)
  project = functools.partial(project_logits, vocab_major=vocab_major)
  logp, entropy = losses.chunked_logprobs_and_entropy(
      hidden, head, tokens[:, 1:], project, temperature, chunk_size)
  return jnp.pad(logp, ((0, 0), (1, 0))), entropy


def _loss_fn(params, graphdef, config: LearnerConfig, batch: TrainBatch, anchor_logp,
             proximal_version, current_version):
  assert batch.tokens.ndim == 2, batch.tokens.shape
  logp, entropy = sequence_logprobs_and_entropy(
      graphdef, params, batch.tokens, config.temperature, batch.positions, batch.segment_ids,
      config.logit_chunk_size)
  logp = logp[:, 1:]
  mask = batch.response_mask[:, 1:]
  behaviour = batch.behaviour_logprobs[:, 1:]
  entropy = jnp.where(mask > 0, entropy, 0.0)
  if config.use_rollout_log_probs:
    anchor, behaviour_arg = behaviour, None
  elif config.proximal_logprob == "loglinear":
    anchor = proximal.loglinear_proximal_logprob(
        behaviour, jax.lax.stop_gradient(logp), batch.token_versions[:, 1:], proximal_version,
        current_version)
    behaviour_arg = behaviour
  elif config.proximal_logprob == "rollout":
    anchor, behaviour_arg = behaviour, behaviour
  elif anchor_logp is None:  # 'recompute' at the window's first update: the current weights
    anchor, behaviour_arg = logp, behaviour
  else:
    anchor, behaviour_arg = anchor_logp[:, 1:], behaviour
  return logp, entropy, anchor, behaviour_arg, mask


def behaviour_kl(logp, batch: TrainBatch, mask):
  """KL(behaviour || current) on the response tokens, as a (sum, count) pair: the k3 estimate
  (exp(d) - d - 1 with d = current - behaviour logprob, >= 0, unbiased on tokens the behaviour
  policy sampled), d clipped as the 'low_var_kl' penalty clips it. How far the weights an
  update trains have moved from the ones that drew its tokens, whatever the loss's anchor."""
  valid = mask > 0
  kl = jnp.maximum(losses.kl_penalty(  # >= 0, also where float rounding of a tiny d is not
      jnp.where(valid, batch.behaviour_logprobs[:, 1:], 0.0),
      jnp.where(valid, jax.lax.stop_gradient(logp), 0.0), "low_var_kl"), 0.0)
  return (jnp.sum(jnp.where(valid, kl, 0.0)).astype(jnp.float32),
          jnp.sum(valid).astype(jnp.float32))


def make_update_fn(graphdef, config: LearnerConfig, group_size: int, state_sh):
  """Build the jitted `update(state, batch, anchor_logp, proximal_version, current_version,
  ref_logp)`.

  anchor_logp: [R, T] recomputed proximal logprobs ('recompute'), or None when the window's
    weights are the current ones (its first update); ignored by the other sources.
  ref_logp: [R, T] reference-policy logprobs for the KL penalty (kl_coef > 0), else None.
  proximal_version / current_version: float scalars for 'loglinear' (versions may be
  fractional: version + local updates / trigger_parameter_sync_step).
  """

  def update(state: TrainState, batch: TrainBatch, anchor_logp, proximal_version,
             current_version, ref_logp=None):
    rewards = batch.rewards.reshape(-1, group_size)
    adv = advantages_lib.group_advantages(rewards, normalize_std=config.normalize_std).reshape(-1)
    sample_of_token = batch.sample_index[:, 1:]

    def loss(params):
      logp, entropy, anchor, behaviour_arg, mask = _loss_fn(
          params, graphdef, config, batch, anchor_logp, proximal_version, current_version)
      token_adv = adv[sample_of_token] * mask
      total, metrics = losses.policy_loss(
          logp, jax.lax.stop_gradient(anchor), token_adv, mask, behaviour_logp=behaviour_arg,
          ref_logp=None if ref_logp is None else ref_logp[:, 1:], kl_coef=config.kl_coef,
          kl_kind=config.kl_kind,
          entropy=entropy, entropy_coef=config.entropy_coef, clip_low=config.clip_low,
          clip_high=config.clip_high, dual_clip=config.dual_clip, is_cap=config.is_cap,
          is_cap_mode=config.is_cap_mode, agg_mode=config.agg_mode,
          sequence_ids=sample_of_token, num_sequences=batch.rewards.shape[0])
      return total, {**metrics, "behaviour_kl": behaviour_kl(logp, batch, mask)}

    (total, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = dict(metrics)
    # algo/kl: KL(old || new) of this update (verl's ppo_kl); the reference-policy KL of the
    # penalty, when there is one, is algo/ref_kl.
    if "kl" in metrics:
      metrics["ref_kl"] = metrics.pop("kl")
    metrics["kl"] = metrics["approx_kl"]
    metrics["loss"] = total
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["advantage_abs_mean"] = jnp.mean(jnp.abs(adv))
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, tx=state.tx)
    return new_state, metrics

  return jax.jit(update, donate_argnums=(0,), out_shardings=(state_sh, None))


def make_logprob_fn(graphdef, temperature: float, chunk_size: int = 0):
  """Jitted `logprobs(params, tokens, positions=None, segment_ids=None) -> [R, T]` (the
  'recompute' anchor, the reference policy and evaluation); packed rows pass positions and
  segment ids. chunk_size: as `LearnerConfig.logit_chunk_size` (0: the full logits)."""
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 0:
    raise ValueError(f"chunk_size must be an int >= 0 (0: unchunked), got {chunk_size!r}")

  def logprobs(params, tokens, positions=None, segment_ids=None):
    if chunk_size == 0:
      return sequence_logprobs(graphdef, params, tokens, temperature, positions, segment_ids)[0]
    return sequence_logprobs_and_entropy(graphdef, params, tokens, temperature, positions,
                                         segment_ids, chunk_size)[0]

  return jax.jit(logprobs)


def batch_logprobs(logprob_fn, params, batch: TrainBatch):
  """`make_logprob_fn`'s function on a TrainBatch, packed or not."""
  return logprob_fn(params, batch.tokens, batch.positions, batch.segment_ids)


def shard_batch(batch: TrainBatch, mesh: Mesh) -> TrainBatch:
  """Put a host batch on the learner mesh, rows over the batch axes."""
  # One device_put of the whole tree: its transfers go out in one batched call.
  return jax.device_put(batch, jax.tree.map(lambda x: sharding.batch_sharding(mesh, x.shape),
                                            batch))
