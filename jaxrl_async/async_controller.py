"""The async modes: Rollouter, Learner and ParameterSynchronizer as concurrent roles.

Roles run as threads in one process and meet only at the VersionedBuffer (samples) and the
weight channel (versions). The main thread watches them: a failure in one role stops the run
with that role's error, and Ctrl-C stops every role within seconds and leaves a checkpoint.
"""

from __future__ import annotations

import os
import shutil
import sys

import jax

from jaxrl_async.buffer import VersionedBuffer, admission_budget
from jaxrl_async.controller import (
  Parts,
  copy_params,
  learner_update,
  make_group_requests,
  progress_bar,
  run_services,
  version_record,
)
from jaxrl_async.learner.learner import LearnerRole
from jaxrl_async.rollout.rollouter import Rollouter
from jaxrl_async.sync.channel import DeviceTransferChannel, OrbaxStoreChannel

JOIN_TIMEOUT_S = 30.0
# Roles hand the GIL to each other around every device call; Python's default 5 ms switch
# interval makes a role wait that long for it (about +7% samples/s at 0.5 ms, async_stale, CPU).
GIL_SWITCH_INTERVAL_S = 0.0005


class RoleFailed(RuntimeError):
  """A role raised; the message names the role, the cause is chained."""


def make_channel(parts: Parts, run_dir):
  if parts.config.sync_backend == "store":
    # The store is transport, not a checkpoint: versions left by an earlier (resumed) run
    # would be newer than the restored learner, so they are cleared.
    shutil.rmtree(os.path.join(run_dir, "weights"), ignore_errors=True)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            parts.state.params)
    return OrbaxStoreChannel(os.path.join(run_dir, "weights"), abstract, parts.logical_axes)
  return DeviceTransferChannel(parts.logical_axes)


def make_buffer(parts: Parts) -> VersionedBuffer:
  cfg = parts.config
  budget = admission_budget(cfg.staleness_threshold, cfg.groups_per_version)
  capacity = max(cfg.buffer_capacity or 0, cfg.group_size * budget)
  return VersionedBuffer(group_size=cfg.group_size, groups_per_version=cfg.groups_per_version,
                         staleness_threshold=cfg.staleness_threshold,
                         max_version_gap=cfg.max_version_gap, capacity=capacity)


def run_async(parts: Parts, run_dir, *, resume: bool, progress: bool, log=print) -> dict:
  previous_interval = sys.getswitchinterval()
  sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
  try:
    return _run_async(parts, run_dir, resume=resume, progress=progress, log=log)
  finally:
    sys.setswitchinterval(previous_interval)


def _run_async(parts: Parts, run_dir, *, resume: bool, progress: bool, log=print) -> dict:
  cfg = parts.config
  timer, writer, checkpointer, evaluator = run_services(parts, run_dir)
  buffer = make_buffer(parts)
  channel = make_channel(parts, run_dir)
  state, version = parts.state, 0
  totals = {"consumed": 0, "tokens": 0}
  rollout_state = {"next_group_id": 0, "inflight": []}
  if resume and checkpointer.latest_step() is not None:
    state, run_state, _ = checkpointer.restore(state, parts.prompt_iterator)
    version = run_state["policy_version"]
    totals = {"consumed": run_state["consumed_samples"], "tokens": run_state["consumed_tokens"]}
    buffer.set_state(run_state["buffer"])
    rollout_state = run_state["rollout"]
    timer.start -= run_state.get("wall_s", 0.0)
    log(f"resumed from {checkpointer.directory} at policy_version {version}")

  rollouter = Rollouter(
      batcher=parts.new_batcher(), prompts=parts.prompt_iterator, rewards=parts.rewards,
      buffer=buffer, channel=channel, timer=timer,
      make_requests=lambda problem, gid, members: make_group_requests(
          problem, gid, cfg.group_size, cfg.seed, members),
      group_size=cfg.group_size, partial_rollout=cfg.partial_rollout,
      partial_strategy=cfg.partial_strategy, next_group_id=rollout_state["next_group_id"],
      reissue=rollout_state["inflight"])
  bar = progress_bar(cfg.num_versions, version, progress)
  last_eval: dict = {}

  def save_checkpoint(at_version: int, learner_state) -> None:
    rollouter.pause()
    try:
      with timer.excluded():
        checkpointer.save(at_version, learner_state, parts.prompt_iterator, {
            "policy_version": at_version, "consumed_samples": totals["consumed"],
            "consumed_tokens": totals["tokens"], "wall_s": timer.wall_s(),
            "buffer": buffer.get_state(), "rollout": rollouter.snapshot()})
    finally:
      rollouter.resume()

  def run_eval(at_version: int, learner_state) -> None:
    rollouter.pause()
    try:
      with timer.excluded():
        last_eval.update(evaluator(learner_state.params, at_version))
      writer.write({"policy_version": at_version, "learner_step": int(learner_state.step),
                    "samples": totals["consumed"], "time_s": timer.wall_s(), **last_eval})
    finally:
      rollouter.resume()

  def on_version(at_version, learner_state, groups, accumulated, staleness):
    totals["consumed"] += sum(len(g) for g in groups)
    totals["tokens"] += sum(s.num_response_tokens for g in groups for s in g)
    sync = channel.metrics()
    record = version_record(parts, timer, at_version, learner_state, groups, accumulated,
                            totals["consumed"], totals["tokens"], {},
                            sync["sync/latency_s"])
    record.update(staleness)
    record.update(buffer.metrics())
    record.update(sync)
    record.update({f"rollout/{k}": v for k, v in rollouter.counts.items()})
    record["learner/wait_s"] = learner.wait_s
    writer.write(record)
    bar.set_postfix(reward=f"{record['result/reward_mean']:.3f}",
                    acc=f"{last_eval.get('eval/accuracy', float('nan')):.3f}",
                    gap=f"{record['algo/version_gap_max']:.0f}")
    bar.update(1)
    if learner.stopping:  # Ctrl-C: the controller saves once both roles have stopped
      return
    if at_version % cfg.eval_every_versions == 0:
      run_eval(at_version, learner_state)
    if at_version % cfg.checkpoint_every_versions == 0 or at_version == cfg.num_versions:
      save_checkpoint(at_version, learner_state)

  learner = LearnerRole(
      state=state, buffer=buffer, channel=channel, timer=timer,
      update_fn=lambda st, groups, window, v, local: learner_update(parts, st, groups, window,
                                                                    v, local),
      copy_params=copy_params, groups_per_update=cfg.groups_per_update,
      trigger_parameter_sync_step=cfg.trigger_parameter_sync_step,
      num_versions=cfg.num_versions, start_version=version,
      on_policy=cfg.staleness_threshold == 0, max_version_gap=cfg.max_version_gap,
      needs_window_params=cfg.needs_window_params, on_version=on_version,
      debug_checks=cfg.debug_checks)

  if version == 0 or not last_eval:
    with timer.excluded():
      last_eval.update(evaluator(state.params, version))
    writer.write({"policy_version": version, "learner_step": int(state.step),
                  "samples": totals["consumed"], "time_s": timer.wall_s(), **last_eval})
  interrupted = False
  try:
    learner.start()
    rollouter.start()
    _watch(learner, rollouter)
  except KeyboardInterrupt:
    interrupted = True
    log("interrupted: stopping roles and saving a checkpoint")
  finally:
    learner.stop()
    rollouter.stop()
    buffer.close()
    try:
      learner.join(JOIN_TIMEOUT_S)
      rollouter.join(JOIN_TIMEOUT_S)
    finally:
      bar.close()
  if interrupted:
    save_checkpoint_after_stop(checkpointer, learner, parts, totals, timer, buffer, rollouter)
    writer.close()
    checkpointer.close()
    channel.close()
    raise KeyboardInterrupt
  _raise_role_errors(learner, rollouter)
  final_state = learner.state
  with timer.excluded():
    last_eval.update(evaluator(final_state.params, learner.version))
  writer.write({"policy_version": learner.version, "learner_step": int(final_state.step),
                "samples": totals["consumed"], "time_s": timer.wall_s(), **last_eval})
  queued = buffer.discard_queued("shutdown")
  buffer.check_invariants()
  summary = {**timer.summary(), **last_eval, **buffer.metrics(), **channel.metrics(),
             "mode": cfg.mode, "policy_version": learner.version,
             "learner_step": int(final_state.step), "consumed_samples": totals["consumed"],
             "system/samples_per_s": totals["consumed"] / max(timer.wall_s(), 1e-9),
             "system/tokens_per_s": totals["tokens"] / max(timer.wall_s(), 1e-9),
             "queue/discarded_at_end": queued,
             "rollout/shutdown_dropped": rollouter.counts["shutdown"],
             "run_dir": os.path.abspath(run_dir), "checkpoint_dir": checkpointer.directory,
             **{f"rollout/{k}": v for k, v in rollouter.counts.items()}}
  writer.close()
  checkpointer.close()
  channel.close()
  parts.state = final_state
  return summary


def _watch(learner: LearnerRole, rollouter: Rollouter, poll_s: float = 0.1) -> None:
  """Block until the learner is done; a role's error stops the run."""
  while not learner.done.wait(poll_s):
    if rollouter.error is not None or not rollouter.alive:
      break
  _raise_role_errors(learner, rollouter)


def _raise_role_errors(learner: LearnerRole, rollouter: Rollouter) -> None:
  for name, role in (("learner", learner), ("rollouter", rollouter)):
    if role.error is not None:
      raise RoleFailed(f"the {name} role failed: {role.error!r}") from role.error


def save_checkpoint_after_stop(checkpointer, learner, parts, totals, timer, buffer, rollouter):
  """After Ctrl-C: both roles have stopped (the rollouter counts as paused once its thread has
  ended), so the snapshot is consistent; the groups in flight are re-issued on resume. Updates
  of a version window cut short are kept in the state and the window restarts on resume."""
  if checkpointer.latest_step() == learner.version:
    return  # saved at this very version just before the stop: that checkpoint is consistent
  snapshot = rollouter.snapshot()
  state = buffer.get_state()
  checkpointer.save(learner.version, learner.state, parts.prompt_iterator, {
      "policy_version": learner.version, "consumed_samples": totals["consumed"],
      "consumed_tokens": totals["tokens"], "wall_s": timer.wall_s(), "buffer": state,
      "rollout": snapshot})
