"""What a run is made of, built once from a `RunConfig` into typed parts.

- `model_spec`: the task and the model's shapes (the one builder both sides use, so they agree);
- `build_rollout_side`: engine, reward pool, a shard of the prompts and the held-out problems,
  built in the process that generates (the controller's process, a rollout server's child
  process or a Ray actor);
- `build_learner_side`: the learner's mesh, its initial state (base policy or checkpoint) and the
  update compiled ahead of time for every packed row count;
- `build`: both sides for the controller's process (`Parts`).

A backend (threads, processes, Ray) only decides where each side runs and how they are joined;
the sync baseline and the async modes use the very same parts and differ only in their barriers.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import grain
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl_async import sharding
from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.checkpoint import RunCheckpointer
from jaxrl_async.config import RunConfig
from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import bucket_length, collate, longest_sequence, pack
from jaxrl_async.learner.compiled import AheadOfTime, precompile_update
from jaxrl_async.learner.sft import cached_base_policy
from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
from jaxrl_async.model.config import ModelConfig
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.evaluate import evaluate
from jaxrl_async.rollout.generation import (
  ContinuousBatcher,
  GenerationRequest,
  sample_keys,
  task_batcher,
)
from jaxrl_async.rollout.rewards import RewardPool
from jaxrl_async.tasks import prompts as prompts_lib
from jaxrl_async.tasks.base import Problem, Task
from jaxrl_async.tasks.reverse import DigitReverseTask
from jaxrl_async.types import Sample

# A buffer call of the sync loop never waits on another role: one that blocks this long is a bug.
ADMISSION_TIMEOUT_S = 60.0


# ---- the model, as both sides see it -------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """The task and the model's structure: graph, logical axes and abstract params."""

  task: Task
  model_config: ModelConfig
  graphdef: nnx.GraphDef
  logical_axes: object  # a pytree of logical axis names, the params' structure
  abstract_params: object  # a pytree of jax.ShapeDtypeStruct, the params' structure

  @property
  def seq_len(self) -> int:
    return self.model_config.max_seq_len


def model_spec(config: RunConfig) -> ModelSpec:
  task = config.task if config.task is not None else DigitReverseTask(config.seed)
  cache_length = config.cache_length or task.max_sequence_len
  if cache_length < task.max_sequence_len:
    raise ValueError(
        f"cache_length={config.cache_length} is shorter than the task's longest prompt + "
        f"response ({task.max_prompt_len} + {task.max_response_len} = "
        f"{task.max_sequence_len} tokens); allowed: >= {task.max_sequence_len} or None")
  if config.checkpoint is not None:  # a Hugging Face checkpoint's shapes
    model_config = checkpoint_model_config(config.checkpoint, task, cache_length)
  else:
    model_config = get_config(config.model, vocab_size=task.tokenizer.vocab_size,
                              max_seq_len=cache_length)
  model = jax.eval_shape(functools.partial(init_model, model_config))
  graphdef, abstract = split_model(model)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  return ModelSpec(task=task, model_config=model_config, graphdef=graphdef,
                   logical_axes=param_logical_axes(model), abstract_params=abstract)


def checkpoint_model_config(checkpoint, task, cache_length: int) -> ModelConfig:
  """The ModelConfig of a Hugging Face checkpoint (`model.weights.HFCheckpoint`), checked
  against the task's tokenizer."""
  if not callable(getattr(checkpoint, "model_config", None)):
    raise TypeError(f"RunConfig.checkpoint must be a model.weights.HFCheckpoint or None, got "
                    f"{checkpoint!r}")
  model_config = checkpoint.model_config(max_seq_len=cache_length)
  if task.tokenizer.vocab_size > model_config.vocab_size:
    raise ValueError(
        f"the task's tokenizer has {task.tokenizer.vocab_size} ids but the checkpoint "
        f"{checkpoint.path} embeds only vocab_size={model_config.vocab_size}: use the "
        "checkpoint's own tokenizer")
  return model_config


# ---- the rollout side ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RolloutSide:
  """What generation needs: engine, reward pool, this shard's prompts, held-out problems."""

  config: RunConfig
  spec: ModelSpec
  engine: Engine
  rewards: RewardPool
  prompts: grain.DatasetIterator
  eval_problems: list[Problem]

  @property
  def task(self) -> Task:
    return self.spec.task

  def new_batcher(self) -> ContinuousBatcher:
    return task_batcher(self.engine, self.spec.task)

  def make_requests(self, problem: Problem, group_id: int, members) -> list[GenerationRequest]:
    return make_group_requests(problem, group_id, self.config.group_size, self.config.seed,
                               members)


def build_rollout_side(config: RunConfig, shard_index: int = 0, shard_count: int = 1, *,
                       spec: ModelSpec | None = None, mesh: Mesh | None = None) -> RolloutSide:
  """The rollout side of server `shard_index` of `shard_count` (its shard of the prompts); the
  engine on `mesh` (a placement's rollout mesh), else on the process's default device."""
  spec = model_spec(config) if spec is None else spec
  task = spec.task
  engine = Engine(spec.graphdef, spec.model_config,
                  max_concurrent_decodes=config.max_concurrent_decodes,
                  max_prefill_length=task.max_sequence_len, sampling=config.sampling,
                  steps_per_call=config.decode_steps_per_call, mesh=mesh,
                  logical_axes=spec.logical_axes)
  if config.precompile_rollout:
    warm_up_engine(engine, spec.abstract_params,
                   resume=config.partial_rollout and config.partial_strategy == "reprefill")
  rewards = RewardPool(task.reward, num_workers=config.reward_workers,
                       timeout_s=config.reward_timeout_s, max_retries=config.reward_retries)
  prompts = iter(prompts_lib.shard_prompt_dataset(task, seed=config.seed,
                                                  shard_index=shard_index,
                                                  shard_count=shard_count))
  return RolloutSide(config=config, spec=spec, engine=engine, rewards=rewards, prompts=prompts,
                     eval_problems=task.eval_set(config.eval_size))


def warm_up_engine(engine: Engine, abstract_params, *, resume: bool) -> None:
  """`Engine.warm_up` on zero weights of the params' shapes (placed as the engine places
  weights), on a decode state dropped after."""
  params = engine.load_params(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                           abstract_params))
  jax.block_until_ready(engine.warm_up(params, engine.init_decode_state(), resume=resume))


# ---- the learner side ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LearnerSide:
  """The learner's mesh, its initial state and its compiled functions. The update donates its
  state: `initial_state` is consumed by the first update of a run."""

  config: RunConfig
  spec: ModelSpec
  mesh: Mesh
  initial_state: step_lib.TrainState
  update: AheadOfTime
  logprobs: AheadOfTime
  ref_params: object | None  # the frozen base policy's params (kl_coef > 0), else None
  # A learner over several processes (`run/multihost.Leader`) on the controller: every step
  # that touches the learner's global arrays goes through it, so the other processes join it.
  multihost: object | None = None

  @property
  def seq_len(self) -> int:
    return self.spec.seq_len


def build_learner_side(config: RunConfig, spec: ModelSpec, mesh: Mesh, *, log=print,
                       params=None, multihost=None) -> LearnerSide:
  """`params`: the initial weights, already on `mesh` (a multi-process learner's); default: the
  config's checkpoint or the cached base policy."""
  if params is not None:
    pass
  elif config.checkpoint is not None:
    log(f"initial weights: {config.checkpoint.path}")
    params = config.checkpoint.load(spec.model_config, mesh, spec.logical_axes)
  else:
    params = cached_base_policy(spec.task, spec.model_config, config.warm_start, mesh, log=log)
  state = step_lib.init_train_state(params, config.learner.optimizer(), mesh,
                                    spec.logical_axes)
  update = AheadOfTime(step_lib.make_update_fn(spec.graphdef, config.learner,
                                               config.group_size,
                                               step_lib.state_shardings(state)))
  logprobs = AheadOfTime(step_lib.make_logprob_fn(spec.graphdef, config.learner.temperature,
                                                  chunk_size=config.learner.logit_chunk_size))
  return LearnerSide(config=config, spec=spec, mesh=mesh, initial_state=state, update=update,
                     logprobs=logprobs,
                     ref_params=copy_params(state.params) if config.learner.needs_reference
                     else None, multihost=multihost)


@dataclasses.dataclass(frozen=True)
class Parts:
  """Both sides, as the controller's process holds them (`build`). The rollout side here is the
  one the threads backend and the sync loop generate with, and every backend evaluates with."""

  config: RunConfig
  learner: LearnerSide
  rollout: RolloutSide
  rollout_mesh: Mesh | None  # the engine's mesh when placed apart from the learner, else None

  @property
  def task(self) -> Task:
    return self.learner.spec.task


def build(config: RunConfig, *, log=print) -> Parts:
  spec = model_spec(config)
  placement = sharding.place_roles(config.learner_mesh, config.rollout_mesh,
                                   learner_device_ids=config.learner_device_ids,
                                   rollout_device_ids=config.rollout_device_ids)
  learner = build_learner_side(config, spec, placement.learner, log=log)
  rollout = build_rollout_side(config, spec=spec, mesh=placement.rollout)
  if config.precompile_updates and config.pack_sequences:
    precompile_updates(learner, rollout.eval_problems, log=log)
  return Parts(config=config, learner=learner, rollout=rollout,
               rollout_mesh=placement.rollout)


def precompile_updates(learner: LearnerSide, eval_problems: list[Problem], *,
                       log=print) -> list[int]:
  """`compiled.precompile_update` for this run's batches (the shortest sample taken as the
  shortest held-out prompt and one response token). Returns the row counts."""
  cfg = learner.config
  shortest = 1 + min((len(p.prompt_tokens) for p in eval_problems), default=1)
  began = time.perf_counter()
  counts = precompile_update(
      learner.update, learner.logprobs, learner.initial_state, mesh=learner.mesh,
      row_length=learner.seq_len, num_samples=cfg.groups_per_update * cfg.group_size,
      shortest_sample=shortest,
      anchored=cfg.learner.needs_recompute and cfg.trigger_parameter_sync_step > 1,
      with_reference=learner.ref_params is not None)
  log(f"learner: the update compiled for row counts {counts} "
      f"({time.perf_counter() - began:.1f} s)")
  return counts


# ---- what the loops share ------------------------------------------------------------------
def run_checkpointer(learner: LearnerSide, directory, *, log=print) -> RunCheckpointer:
  """The run's checkpointer: this process's, or a multi-process learner's (every process writes
  and reads its shards of the learner's state)."""
  if learner.multihost is None:
    return RunCheckpointer(directory, log=log)
  return learner.multihost.checkpointer(directory, log=log)


def make_group_requests(problem: Problem, group_id: int, group_size: int, seed: int,
                        members=None, clock=time.time) -> list[GenerationRequest]:
  """One GRPO group: `group_size` samples of one prompt (or the listed members), each with its
  own key, so a re-issued member is generated exactly as it would have been."""
  now = clock()
  members = list(range(group_size) if members is None else members)
  keys = sample_keys(seed, group_id, members)
  requests = []
  for index, key in zip(members, keys, strict=True):
    sample = Sample(prompt_id=problem.prompt_id, group_id=group_id, group_size=group_size,
                    prompt_tokens=problem.prompt_tokens,
                    meta={**problem.meta, "index_in_group": index})
    sample.stamp("created", now)
    requests.append(GenerationRequest(sample, key))
  return requests


def copy_params(params):
  """A fresh copy (the learner's buffers are donated at every update)."""
  return jax.tree.map(lambda x: x.copy(), params)


def window_copy(learner: LearnerSide, params):
  """A copy of the learner's current params (a version window's anchor); a multi-process
  learner copies on every process."""
  return copy_params(params) if learner.multihost is None else learner.multihost.copy(params)


def rollout_params(learner: LearnerSide, params):
  """The learner's current params as this process's rollout side takes them: as they are, or,
  for a multi-process learner, gathered onto this process's first device."""
  return params if learner.multihost is None else learner.multihost.host(params)


def host_batch(learner: LearnerSide, groups) -> step_lib.TrainBatch:
  """The groups as a host TrainBatch: packed rows (`pack_sequences`), or one row per sample
  padded to the batch's length bucket."""
  cfg = learner.config
  if cfg.pack_sequences:
    return pack(groups, learner.seq_len, num_groups=cfg.groups_per_update,
                row_multiple=learner.mesh.size)
  return collate(groups, bucket_length(longest_sequence(groups), learner.seq_len),
                 num_groups=cfg.groups_per_update)


def make_batch(learner: LearnerSide, groups) -> step_lib.TrainBatch:
  """The groups as a TrainBatch on the learner mesh (`host_batch`, sharded by rows)."""
  return step_lib.shard_batch(host_batch(learner, groups), learner.mesh)


def learner_update(learner: LearnerSide, state, groups, window_params, version: int,
                   local_update: int):
  """One optimizer step on `groups` -> (state, metrics); the anchor follows
  `old_logprob_source`.

  'recompute' at a window's first update (local_update 0) takes the anchor from the update's own
  forward pass: the window's weights are the current ones, so a second pass would be the same.
  """
  if learner.multihost is not None:
    return learner.multihost.update(learner, state, host_batch(learner, groups), window_params,
                                    version, local_update)
  return update_on_batch(learner, state, make_batch(learner, groups), window_params, version,
                         local_update)


def update_on_batch(learner: LearnerSide, state, batch, window_params, version: int,
                    local_update: int):
  """`learner_update` on a batch already on the learner mesh."""
  cfg = learner.config
  anchor = None
  if cfg.learner.needs_recompute and local_update > 0:
    anchor = step_lib.batch_logprobs(learner.logprobs, window_params, batch)
  ref = (None if learner.ref_params is None
         else step_lib.batch_logprobs(learner.logprobs, learner.ref_params, batch))
  current_version = version + local_update / cfg.trigger_parameter_sync_step
  return learner.update(state, batch, anchor, np.float32(version),
                        np.float32(current_version), ref)


class Evaluator:
  """Held-out accuracy on its own decode state (never disturbs the rollout's slots)."""

  def __init__(self, rollout: RolloutSide, learner: LearnerSide | None = None):
    self.rollout = rollout
    self.learner = learner  # whose params it evaluates (a multi-process one's: gathered here)
    self.batcher = rollout.new_batcher()

  def __call__(self, params, version: int) -> dict[str, float]:
    if self.learner is not None:
      params = rollout_params(self.learner, params)
    self.batcher.set_params(copy_params(params), version)
    return evaluate(self.batcher, self.rollout.task, self.rollout.eval_problems,
                    seed=self.rollout.config.seed)


def buffer_kwargs(cfg: RunConfig) -> dict:
  """The VersionedBuffer arguments a RunConfig asks for, the same on every backend."""
  return dict(group_size=cfg.group_size, groups_per_version=cfg.groups_per_version,
              staleness_threshold=cfg.staleness_threshold,
              max_version_gap=cfg.max_version_gap, capacity=cfg.capacity,
              group_filter=cfg.group_filter_fn, drop_truncated=cfg.drop_truncated,
              version_gap_policy=cfg.version_gap_policy)


def buffer_for(cfg: RunConfig) -> VersionedBuffer:
  """The buffer a RunConfig asks for, recording its drops for the sample ledger. In sync mode
  it only assembles groups and counts drops, by the same rules as in the async modes (so both
  keep put == consumed + dropped + queued)."""
  return VersionedBuffer(**buffer_kwargs(cfg), record_drops=True)


def assemble_groups(config: RunConfig, samples: list[Sample], version: int = 0):
  """The whole groups among scored `samples`, by the buffer's rules (a group with a failed
  member is dropped whole), in group id order. For benchmarks and tools that roll out outside
  a run; runs keep their buffer and its drop counts."""
  buffer = VersionedBuffer(**{**buffer_kwargs(config),
                              "capacity": max(config.capacity, len(samples))})
  for sample in samples:
    buffer.put(sample, timeout=ADMISSION_TIMEOUT_S)
  return take_ready(buffer, version)


def take_ready(buffer: VersionedBuffer, version: int) -> list[list[Sample]]:
  """Every whole group the version made (the rest were dropped), in group id order."""
  ready = int(buffer.metrics()["queue/ready_groups"])
  if ready == 0:
    return []
  groups = buffer.get_groups(ready, version, timeout=ADMISSION_TIMEOUT_S)
  return sorted(groups, key=lambda group: group[0].group_id)
