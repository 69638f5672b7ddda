"""Replays a recorded async run (`schedule_record.py`) from its initial state, in one process.

- `level='learner'`: the recorded batches through the learner, in order, with the same update
  (version, index in the window, the window's anchor params); at each interval's end the state
  is compared with the run's checkpoint of that version, where it is still on disk. On the
  platform that ran it, every leaf is equal bit for bit: the update is a deterministic XLA
  program of the same inputs.
- `level='full'`: the samples are drawn again (`regenerate.py`) from their recorded keys, each
  segment under its recorded version's params as this replay's learner makes them, scored
  again, then trained. Identical tokens are expected; the logprobs and hence the params
  are equal where the engine's program computes exactly as the rollout's did (same platform and
  thread layout); otherwise they differ by float rounding, reported as the largest difference.
- `as_sync=True`: the same groups (prompts, keys) in the same updates, but each version's groups
  generated whole with that version's params (on-policy), scored, then trained: the run as the
  sync baseline would have made it, so that the effect of staleness shows by difference.

`until`: stop once version `until` is made. Returns a report (plain JSON data).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxrl_async.checkpoint import RunCheckpointer
from jaxrl_async.learner.step import TrainState
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.rollout.generation import GenerationRequest
from jaxrl_async.run.build import Parts, copy_params, learner_update
from jaxrl_async.run.loop import ShardPrompts
from jaxrl_async.run.regenerate import Trace, compare_tokens, regenerate
from jaxrl_async.run.schedule_read import Interval, read_schedule

LEVELS = ("learner", "full")


def abstract_state(state: TrainState) -> TrainState:
  """Shapes, dtypes and shardings of `state` (a restore target that outlives donation)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                      state)


def compare_states(replayed: TrainState, recorded: TrainState) -> dict:
  """Leaf by leaf: whether every leaf is equal bit for bit, how many differ, the largest
  absolute difference."""
  differing, largest = 0, 0.0
  for a, b in zip(jax.tree.leaves(_state_tree(replayed)), jax.tree.leaves(_state_tree(recorded)),
                  strict=True):
    a, b = np.asarray(a), np.asarray(b)
    if a.tobytes() != b.tobytes():
      differing += 1
      largest = max(largest, float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))))
  return {"bitwise_equal": differing == 0, "leaves_differing": differing,
          "max_abs_diff": largest}


def _state_tree(state: TrainState):
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


class CheckpointReader:
  """The run's checkpoints (`<run_dir>/checkpoints`), restored into a fixed target."""

  def __init__(self, run_dir, target: TrainState, log):
    self.checkpointer = RunCheckpointer(f"{run_dir}/checkpoints", log=log)
    self.steps = set(self.checkpointer.steps())
    self.target = target

  def state(self, version: int) -> TrainState | None:
    if version not in self.steps:
      return None
    return self.checkpointer.restore(self.target, ShardPrompts(), version)[0]

  def close(self) -> None:
    self.checkpointer.close()


def replay(parts: Parts, run_dir, *, level: str = "learner", until: int | None = None,
           as_sync: bool = False, log=print) -> dict:
  """Replays the run recorded in `run_dir` on `parts` (built from the run's config) -> the
  report."""
  if level not in LEVELS:
    raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
  if until is not None and until < 1:
    raise ValueError(f"until must be a policy version >= 1, got {until}")
  intervals = read_schedule(run_dir, until)
  strategy = intervals[0].header.get("partial_strategy", "reprefill")
  learner, began = parts.learner, time.perf_counter()
  state = copy_params(learner.initial_state)  # the update donates it: `parts` stay reusable
  reader = CheckpointReader(run_dir, abstract_state(state), log)
  generator = None
  if level == "full" or as_sync:
    generator = _Generator(parts, intervals, until, strategy, as_sync)
  checkpoints, versions, window_params, learner_version = [], {}, None, None
  try:
    for interval in intervals:
      stopped = False
      for update in interval.updates:
        if until is not None and update.version >= until:
          stopped = True
          break
        groups = update.groups
        if update.local == 0:
          window_params = (copy_params(state.params) if parts.config.needs_window_params
                           else None)
        if generator is not None:
          if update.version != learner_version:  # this version's params: draw its segments
            generator.at_version(update.version, state.params)
          groups = generator.groups_of(update)
        learner_version = update.version
        state, _ = learner_update(learner, state, groups, window_params, update.version,
                                  update.local)
        versions.setdefault(update.version + 1, []).extend(
            s.reward for group in groups for s in group)
      if stopped:
        break
      recorded = reader.state(interval.end_version)
      if recorded is not None:
        checkpoints.append({"version": interval.end_version, **compare_states(state, recorded)})
        log(f"replay: version {interval.end_version}: {checkpoints[-1]}")
  finally:
    reader.close()
  report = {"level": level, "as_sync": as_sync, "until": until,
            "versions": max(versions, default=0), "learner_step": int(state.step),
            "updates": int(state.step), "checkpoints": checkpoints,
            "bitwise_equal": bool(checkpoints) and all(c["bitwise_equal"] for c in checkpoints),
            "schedule": schedule_figures(intervals),
            "reward_mean": {v: float(np.mean(r)) for v, r in sorted(versions.items())},
            "seconds": time.perf_counter() - began}
  if generator is not None:
    report["tokens"] = generator.token_report()
  if as_sync:
    report["side_by_side"] = side_by_side(run_dir, report["reward_mean"])
  return report


def schedule_figures(intervals: list[Interval]) -> dict:
  samples = sum(i.header["samples"] for i in intervals)
  size = sum(i.bytes for i in intervals)
  return {"files": len(intervals), "bytes": size, "samples": samples,
          "tokens": sum(i.header["tokens"] for i in intervals),
          "bytes_per_sample": size / samples if samples else float("nan")}


def side_by_side(run_dir, replayed: dict) -> list[dict]:
  """Per version: the run's training reward beside the `as_sync` replay's."""
  recorded = {r["policy_version"]: r["result/reward_mean"]
              for r in read_jsonl(f"{run_dir}/metrics.jsonl") if "result/reward_mean" in r}
  return [{"policy_version": v, "run_reward_mean": recorded.get(v),
           "as_sync_reward_mean": reward} for v, reward in sorted(replayed.items())]


class _Generator:
  """The samples a full or `as_sync` replay trains on, drawn as the learner reaches each
  version."""

  def __init__(self, parts: Parts, intervals, until, strategy: str, as_sync: bool):
    self.parts, self.strategy, self.as_sync = parts, strategy, as_sync
    self.engine = parts.rollout.engine
    self.updates = [u for i in intervals for u in i.updates
                    if until is None or u.version < until]
    self.traces = {}  # (group id, member) -> Trace
    self.drawn: dict = {}  # group id -> the group as drawn and scored
    self.window_of: dict = {}  # as_sync: group id -> the version that drew it
    if not as_sync:
      for update in self.updates:
        for group, keys in zip(update.groups, update.keys, strict=True):
          for sample, key in zip(group, keys, strict=True):
            self.traces[sample.uid] = Trace.of(sample, key)

  def at_version(self, version: int, params) -> None:
    params = self.engine.load_params(copy_params(params))
    if self.as_sync:
      self._sync_window(version, params)
    else:
      regenerate(self.engine, params, version, self.traces.values(),
                 partial_strategy=self.strategy)

  def _sync_window(self, version: int, params) -> None:
    """Every group of the window at `version`, generated whole with its params."""
    batcher = self.parts.rollout.new_batcher()
    batcher.set_params(params, version)
    window = [(g, k) for u in self.updates if u.version == version
              for g, k in zip(u.groups, u.keys, strict=True)]
    requests = []
    for group, keys in window:
      for sample, key in zip(group, keys, strict=True):
        fresh = Trace.of(sample, key).sample()
        fresh.response_tokens = np.zeros((0,), np.int32)
        fresh.behaviour_logprobs = np.zeros((0,), np.float32)
        fresh.token_versions = np.zeros((0,), np.int32)
        requests.append(GenerationRequest(fresh, np.asarray(key, np.uint32)))
    done = {s.uid: s for s in batcher.run_to_completion(requests)}
    scored = {s.uid: s for s in self.parts.rollout.rewards.score_all(list(done.values()))}
    for group, _ in window:
      self.drawn[group[0].group_id] = [scored[s.uid] for s in group]
      self.window_of[group[0].group_id] = version

  def groups_of(self, update) -> list:
    if not self.as_sync:
      for group in update.groups:
        if group[0].group_id not in self.drawn:
          regenerated = [self.traces[s.uid].sample() for s in group]
          self.drawn[group[0].group_id] = self.parts.rollout.rewards.score_all(regenerated)
    return [self.drawn[group[0].group_id] for group in update.groups]

  def token_report(self) -> dict:
    if not self.as_sync:
      return compare_tokens(self.traces.values())
    recorded = {s.uid: (u.version, s) for u in self.updates for g in u.groups for s in g}
    drawn = [s for group in self.drawn.values() for s in group]
    return {"samples": len(drawn),
            "off_policy": sum(bool(np.any(s.token_versions != self.window_of[s.group_id]))
                              for s in drawn),
            "off_policy_in_run": sum(bool(np.any(s.token_versions != v))
                                     for v, s in recorded.values()),
            "tokens_differ_from_run": sum(
                not np.array_equal(s.response_tokens, recorded[s.uid][1].response_tokens)
                for s in drawn)}
