"""Wires the roles for a mode and runs them: `run(config, run_dir)`.

`build` makes the parts every mode shares (task, model, engine, learner state, update step,
reward pool, prompt pipeline); the sync baseline and the async modes use the very same parts
and differ only in their barriers. The loops: `sync_controller.py` (the baseline),
`async_controller.py` (the roles as threads; the roles themselves live in
`rollout/rollouter.py`, `learner/learner.py` and `sync/`) and `runtime/processes.py` (rollout
servers as processes or Ray actors).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jax
import numpy as np

from jaxrl_async import sharding
from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.checkpoint import check_run_dir
from jaxrl_async.config import RunConfig
from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import bucket_length, collate, longest_sequence, pack
from jaxrl_async.learner.compiled import AheadOfTime, precompile_update
from jaxrl_async.learner.sft import cached_base_policy
from jaxrl_async.ledger import (
  SampleLedger,
  audit,
  audit_metrics,
  read_events,
)
from jaxrl_async.metrics import RoleTimer, reduce_metrics, staleness_metrics
from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.evaluate import evaluate
from jaxrl_async.rollout.generation import (
  ContinuousBatcher,
  GenerationRequest,
  sample_keys,
  task_batcher,
)
from jaxrl_async.rollout.rewards import RewardPool
from jaxrl_async.sinks import make_writer
from jaxrl_async.tasks import prompts as prompts_lib
from jaxrl_async.tasks.reverse import DigitReverseTask
from jaxrl_async.types import Sample

# Sync mode never waits on another role: a buffer call that blocks this long is a bug.
ADMISSION_TIMEOUT_S = 60.0
# Roles hand the GIL to each other around every device call; Python's default 5 ms switch
# interval makes a role wait that long for it (about +7% samples/s at 0.5 ms, async_stale, CPU).
# The same holds for a process's service threads (the buffer service beside the learner, a
# rollout server's reward and control threads beside its loop).
GIL_SWITCH_INTERVAL_S = 0.0005


@contextmanager
def short_gil_switch() -> Iterator[None]:
  """Python's GIL switch interval at GIL_SWITCH_INTERVAL_S inside, restored after."""
  previous = sys.getswitchinterval()
  sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
  try:
    yield
  finally:
    sys.setswitchinterval(previous)


@dataclasses.dataclass
class Parts:
  """What every mode shares. Built once per run by `build`."""

  config: RunConfig
  task: Any
  model_config: Any
  graphdef: Any
  logical_axes: Any
  mesh: Any
  state: step_lib.TrainState
  update: Any
  logprobs: Any
  engine: Engine
  eval_problems: list
  prompt_iterator: Any
  rewards: RewardPool
  ref_params: Any = None  # the frozen base policy, for the KL penalty (kl_coef > 0)
  rollout_mesh: Any = None  # the engine's mesh when placed apart from the learner, else None

  def new_batcher(self) -> ContinuousBatcher:
    return task_batcher(self.engine, self.task)

  @property
  def seq_len(self) -> int:
    return self.model_config.max_seq_len


def build(config: RunConfig, *, log=print) -> Parts:
  task = config.task if config.task is not None else DigitReverseTask(config.seed)
  cache_length = config.cache_length or task.max_sequence_len
  if cache_length < task.max_sequence_len:
    raise ValueError(
        f"cache_length={config.cache_length} is shorter than the task's longest prompt + "
        f"response ({task.max_prompt_len} + {task.max_response_len} = "
        f"{task.max_sequence_len} tokens); allowed: >= {task.max_sequence_len} or None")
  if config.checkpoint is not None:
    model_config = checkpoint_model_config(config.checkpoint, task, cache_length)
  else:
    model_config = get_config(config.model, vocab_size=task.tokenizer.vocab_size,
                              max_seq_len=cache_length)
  placement = sharding.place_roles(config.learner_mesh, config.rollout_mesh,
                                   learner_device_ids=config.learner_device_ids,
                                   rollout_device_ids=config.rollout_device_ids)
  mesh = placement.learner
  model = jax.eval_shape(lambda: init_model(model_config))
  graphdef, _ = split_model(model)
  logical_axes = param_logical_axes(model)
  if config.checkpoint is not None:
    log(f"initial weights: {config.checkpoint.path}")
    params = config.checkpoint.load(model_config, mesh, logical_axes)
  else:
    params = cached_base_policy(task, model_config, config.warm_start, mesh, log=log)
  state = step_lib.init_train_state(params, config.learner.optimizer(), mesh, logical_axes)
  update = AheadOfTime(step_lib.make_update_fn(graphdef, config.learner, config.group_size,
                                               step_lib.state_shardings(state)))
  engine = Engine(graphdef, model_config, max_concurrent_decodes=config.max_concurrent_decodes,
                  max_prefill_length=task.max_sequence_len, sampling=config.sampling,
                  steps_per_call=config.decode_steps_per_call, mesh=placement.rollout,
                  logical_axes=logical_axes)
  prompt_iterator = iter(prompts_lib.prompt_dataset(task, seed=config.seed))
  rewards = RewardPool(task.reward, num_workers=config.reward_workers,
                       timeout_s=config.reward_timeout_s, max_retries=config.reward_retries)
  parts = Parts(config=config, task=task, model_config=model_config, graphdef=graphdef,
                logical_axes=logical_axes, mesh=mesh, state=state, update=update,
                logprobs=AheadOfTime(step_lib.make_logprob_fn(
                    graphdef, config.learner.temperature,
                    chunk_size=config.learner.logit_chunk_size)),
                engine=engine, rollout_mesh=placement.rollout,
                eval_problems=task.eval_set(config.eval_size),
                prompt_iterator=prompt_iterator, rewards=rewards,
                ref_params=copy_params(state.params) if config.learner.needs_reference
                else None)
  if config.precompile_updates and config.pack_sequences:
    precompile_updates(parts, log=log)
  return parts


def precompile_updates(parts: Parts, *, log=print) -> list[int]:
  """`compiled.precompile_update` for this run's batches (the shortest sample taken as the
  shortest held-out prompt and one response token). Returns the row counts."""
  cfg = parts.config
  shortest = 1 + min((len(p.prompt_tokens) for p in parts.eval_problems), default=1)
  began = time.perf_counter()
  counts = precompile_update(
      parts.update, parts.logprobs, parts.state, mesh=parts.mesh, row_length=parts.seq_len,
      num_samples=cfg.groups_per_update * cfg.group_size, shortest_sample=shortest,
      anchored=cfg.learner.needs_recompute and cfg.trigger_parameter_sync_step > 1,
      with_reference=parts.ref_params is not None)
  log(f"learner: the update compiled for row counts {counts} "
      f"({time.perf_counter() - began:.1f} s)")
  return counts


def checkpoint_model_config(checkpoint, task, cache_length: int):
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


def make_group_requests(problem, group_id: int, group_size: int, seed: int, members=None,
                        clock=time.time):
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


def make_batch(parts: Parts, groups):
  """The groups as a TrainBatch on the learner mesh: packed rows (`pack_sequences`), or one row
  per sample padded to the batch's length bucket."""
  cfg = parts.config
  if cfg.pack_sequences:
    batch = pack(groups, parts.seq_len, num_groups=cfg.groups_per_update,
                 row_multiple=parts.mesh.size)
  else:
    batch = collate(groups, bucket_length(longest_sequence(groups), parts.seq_len),
                    num_groups=cfg.groups_per_update)
  return step_lib.shard_batch(batch, parts.mesh)


def learner_update(parts: Parts, state, groups, window_params, version: int,
                   local_update: int) -> tuple[Any, dict]:
  """One optimizer step on `groups`; the anchor follows `old_logprob_source`.

  'recompute' at a window's first update (local_update 0) takes the anchor from the update's own
  forward pass: the window's weights are the current ones, so a second pass would be the same.
  """
  cfg = parts.config
  batch = make_batch(parts, groups)
  anchor = None
  if cfg.learner.needs_recompute and local_update > 0:
    anchor = step_lib.batch_logprobs(parts.logprobs, window_params, batch)
  ref = (None if parts.ref_params is None
         else step_lib.batch_logprobs(parts.logprobs, parts.ref_params, batch))
  current_version = version + local_update / cfg.trigger_parameter_sync_step
  state, metrics = parts.update(state, batch, anchor, np.float32(version),
                                np.float32(current_version), ref)
  return state, metrics


class Evaluator:
  """Held-out accuracy on its own decode state (never disturbs the rollout's slots)."""

  def __init__(self, parts: Parts):
    self.parts = parts
    self.batcher = parts.new_batcher()

  def __call__(self, params, version: int) -> dict[str, float]:
    self.batcher.set_params(copy_params(params), version)
    return evaluate(self.batcher, self.parts.task, self.parts.eval_problems,
                    seed=self.parts.config.seed)


def run(config: RunConfig, run_dir: str | os.PathLike, *, resume: bool = False,
        progress: bool = True, log=print) -> dict[str, float]:
  """Train in `config.mode`; writes metrics.jsonl, checkpoints/ and summary.json in run_dir."""
  return run_parts(build(config, log=log), run_dir, resume=resume, progress=progress, log=log)


def run_parts(parts: Parts, run_dir: str | os.PathLike, *, resume: bool = False,
              progress: bool = True, log=print) -> dict[str, float]:
  check_run_dir(run_dir, resume)
  os.makedirs(run_dir, exist_ok=True)
  try:
    if parts.config.is_async and parts.config.backend == "processes":
      from jaxrl_async.runtime.processes import run_processes
      summary = run_processes(parts, run_dir, resume=resume, progress=progress, log=log)
    elif parts.config.is_async and parts.config.backend == "ray":
      from jaxrl_async.runtime.ray_run import run_ray
      summary = run_ray(parts, run_dir, resume=resume, progress=progress, log=log)
    elif parts.config.is_async:
      from jaxrl_async.async_controller import run_async
      summary = run_async(parts, run_dir, resume=resume, progress=progress, log=log)
    else:
      from jaxrl_async.sync_controller import run_sync
      summary = run_sync(parts, run_dir, resume=resume, progress=progress, log=log)
  finally:
    parts.rewards.close()
  # Updates on an executable compiled before the run, and updates that compiled a shape of
  # their own (a row count outside the precompiled ones, or precompile_updates off).
  summary.update({f"learner/updates_{path}": count
                  for path, count in getattr(parts.update, "calls", {}).items()})
  data_metrics = getattr(parts.task, "data_metrics", None)
  if data_metrics is not None:  # a task over dataset files: its rows, and bad rows by reason
    summary.update(data_metrics())
  with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  return summary


def progress_bar(total: int, initial: int, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, initial=initial, disable=not enabled, unit="version",
              dynamic_ncols=True)


def run_services(parts: Parts, run_dir):
  """What every mode's loop records with: role timer, metrics sink, evaluator. A resumed run
  makes them after the restore has cut the logs back to the checkpoint (ledger.rewind_logs)."""
  timer = RoleTimer()
  parts.rewards.timer = timer  # reward scoring counts as the 'reward' role's busy time
  return timer, make_writer(run_dir, timer, parts.config.metric_sinks), Evaluator(parts)


def make_buffer(parts: Parts) -> VersionedBuffer:
  """The buffer of every mode: in sync mode it only assembles groups and counts drops, with
  the same rules as in the async modes (so both keep put == consumed + dropped + queued)."""
  return buffer_for(parts.config)


def buffer_kwargs(cfg) -> dict:
  """The VersionedBuffer arguments a RunConfig asks for, the same on every backend."""
  return dict(group_size=cfg.group_size, groups_per_version=cfg.groups_per_version,
              staleness_threshold=cfg.staleness_threshold,
              max_version_gap=cfg.max_version_gap, capacity=cfg.capacity,
              group_filter=cfg.group_filter_fn, drop_truncated=cfg.drop_truncated)


def buffer_for(cfg) -> VersionedBuffer:
  """The buffer a RunConfig asks for, recording its drops for the sample ledger."""
  return VersionedBuffer(**buffer_kwargs(cfg), record_drops=True)


def reward_metrics(rewards: RewardPool) -> dict[str, int]:
  """`reward/retries` and the outcome counts of the reward pool, over the run so far."""
  return {f"reward/{name}": int(count) for name, count in rewards.counts.items()}


def ledger_audit(ledger: SampleLedger, group_size: int, *, next_group_id: int | None = None,
                 groups=None) -> dict:
  """The sample ledger's audit at the end of a run, as `ledger/...` figures; a lost or
  duplicated sample is reported on stderr (the summary says how many). The produced groups:
  ids below `next_group_id`, or `groups` (`ledger.audit`)."""
  result = audit(read_events(ledger.path), next_group_id=next_group_id, group_size=group_size,
                 groups=groups)
  if result["missing"] or result["duplicates"] or result["unknown"]:
    print(f"warning: sample ledger {ledger.path}: {len(result['missing'])} samples lost, "
          f"{len(result['duplicates'])} counted twice, {len(result['unknown'])} unknown "
          f"(first lost: {result['missing'][:5]}, first twice: {result['duplicates'][:5]})",
          file=sys.stderr)
  return audit_metrics(result)


def assemble_groups(parts: Parts, samples: list[Sample], version: int = 0):
  """The whole groups among scored `samples`, by the buffer's rules (a group with a failed
  member is dropped whole), in group id order. For benchmarks and tools that roll out outside
  a run; runs keep their buffer and its drop counts."""
  cfg = parts.config
  buffer = VersionedBuffer(**{**buffer_kwargs(cfg), "capacity": max(cfg.capacity, len(samples))})
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


def eval_record(version: int, state, consumed: int, timer, evaluation: dict) -> dict:
  """The metrics record of a held-out evaluation of `state` at `version`."""
  return {"policy_version": version, "learner_step": int(state.step), "samples": consumed,
          "time_s": timer.wall_s(), **evaluation}


def make_learner_role(parts: Parts, state, buffer, channel, timer, *, start_version: int,
                      on_version, taken=None):
  """The learner role of the async loops (threads, processes, Ray), as the config asks."""
  from jaxrl_async.learner.learner import LearnerRole
  cfg = parts.config
  return LearnerRole(
      state=state, buffer=buffer, channel=channel, timer=timer,
      update_fn=lambda st, groups, window, v, local: learner_update(parts, st, groups, window,
                                                                    v, local),
      copy_params=copy_params, groups_per_update=cfg.groups_per_update,
      trigger_parameter_sync_step=cfg.trigger_parameter_sync_step,
      num_versions=cfg.num_versions, start_version=start_version,
      on_policy=cfg.staleness_threshold == 0, max_version_gap=cfg.max_version_gap,
      needs_window_params=cfg.needs_window_params, on_version=on_version,
      debug_checks=cfg.debug_checks, taken=taken)


def async_version_record(parts: Parts, timer, version: int, state, groups, accumulated,
                         staleness: dict, totals: dict, buffer, channel, learner_wait_s: float,
                         rollout: dict) -> dict:
  """One version's metrics record in an async loop: `version_record`, the staleness of the
  groups, the buffer's and the weight channel's figures, and the rollout side's `rollout`."""
  sync = channel.metrics()
  record = version_record(parts, timer, version, state, groups, accumulated, totals["consumed"],
                          totals["tokens"], {}, sync["sync/latency_s"])
  record.update(staleness)
  record.update(buffer.metrics())
  record.update(sync)
  record.update(rollout)
  record["learner/wait_s"] = learner_wait_s
  return record


def show_version(bar, record: dict, evaluation: dict, *, gap: bool = True) -> None:
  """One version on the progress bar: its reward, the last accuracy (and the largest gap)."""
  postfix = {"reward": f"{record['result/reward_mean']:.3f}",
             "acc": f"{evaluation.get('eval/accuracy', float('nan')):.3f}"}
  if gap:
    postfix["gap"] = f"{record['algo/version_gap_max']:.0f}"
  bar.set_postfix(**postfix)
  bar.update(1)


def version_record(parts, timer, version, state, groups, accumulated, consumed, tokens,
                   dropped, sync_latency) -> dict:
  rewards = [s.reward for g in groups for s in g]
  record = {
      "policy_version": version,
      "learner_step": int(state.step),
      "samples": consumed,
      "time_s": timer.wall_s(),
      "system/samples_per_s": consumed / max(timer.wall_s(), 1e-9),
      "system/tokens_per_s": tokens / max(timer.wall_s(), 1e-9),
      "system/steps_per_hour": int(state.step) * 3600.0 / max(timer.wall_s(), 1e-9),
      "result/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
      "result/accuracy": float(np.mean(np.asarray(rewards) == 1.0)) if rewards else float("nan"),
      "sync/latency_s": sync_latency,
      "sync/bytes": int(sum(x.nbytes for x in jax.tree.leaves(state.params))),
      "sync/interval_steps": parts.config.trigger_parameter_sync_step,
      "algo/old_logprob_source": parts.config.learner.old_logprob_source,
      **staleness_metrics(groups, version - 1),
      **reduce_metrics(accumulated, prefix="algo/"),
      **{f"queue/dropped/{k}": v for k, v in dropped.items()},
  }
  record.update(timer.summary())
  return record
