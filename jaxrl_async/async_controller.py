"""The async modes: Rollouter, Learner and ParameterSynchronizer as concurrent roles.

Roles run as threads in one process and meet only at the VersionedBuffer (samples) and the
weight channel (versions). The main thread watches them: a failure in one role stops the run
with that role's error, and Ctrl-C stops every role within seconds and leaves a checkpoint.
"""

from __future__ import annotations

import os
import shutil

import jax

from jaxrl_async.buffer.groups import decode_sample, encode_sample
from jaxrl_async.checkpoint import RunCheckpointer
from jaxrl_async.controller import (
  Parts,
  async_version_record,
  eval_record,
  ledger_audit,
  make_buffer,
  make_group_requests,
  make_learner_role,
  progress_bar,
  reward_metrics,
  run_services,
  short_gil_switch,
  show_version,
)
from jaxrl_async.learner.learner import LearnerRole
from jaxrl_async.ledger import LEDGER_FILE, SampleLedger, log_offsets, rewind_logs
from jaxrl_async.rollout.rollouter import Rollouter
from jaxrl_async.sync.channel import DeviceTransferChannel, OrbaxStoreChannel
from jaxrl_async.watchdog import Watchdog

JOIN_TIMEOUT_S = 30.0


class RoleFailed(RuntimeError):
  """A role raised; the message names the role, the cause is chained."""


def make_channel(parts: Parts, run_dir):
  if parts.config.sync_backend == "store":
    # The store is transport, not a checkpoint: versions left by an earlier (resumed) run
    # would be newer than the restored learner, so they are cleared.
    shutil.rmtree(os.path.join(run_dir, "weights"), ignore_errors=True)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                            parts.state.params)
    return OrbaxStoreChannel(os.path.join(run_dir, "weights"), abstract, parts.logical_axes,
                             parts.rollout_mesh)
  # With a rollout mesh (placement), publish copies the weights onto the rollout devices.
  return DeviceTransferChannel(parts.logical_axes, parts.rollout_mesh)


def run_async(parts: Parts, run_dir, *, resume: bool, progress: bool, log=print) -> dict:
  with short_gil_switch():
    return _run_async(parts, run_dir, resume=resume, progress=progress, log=log)


def _run_async(parts: Parts, run_dir, *, resume: bool, progress: bool, log=print) -> dict:
  cfg = parts.config
  checkpointer = RunCheckpointer(os.path.join(run_dir, "checkpoints"), log=log)
  buffer = make_buffer(parts)
  channel = make_channel(parts, run_dir)
  state, version = parts.state, 0
  totals = {"consumed": 0, "tokens": 0}
  rollout_state = {"next_group_id": 0, "inflight": []}
  taken, last_eval, evaluated = None, {}, [None]  # evaluated[0]: the version last evaluated
  restored = checkpointer.restore_latest(state, parts.prompt_iterator) if resume else None
  rewind_logs(run_dir, restored[1] if restored is not None else None)
  if restored is not None:
    state, run_state, _ = restored
    version = run_state["policy_version"]
    totals = {"consumed": run_state["consumed_samples"], "tokens": run_state["consumed_tokens"]}
    buffer.set_state(run_state["buffer"])
    rollout_state = run_state["rollout"]
    taken = [[decode_sample(data) for data in group] for group in run_state.get("taken", [])]
    last_eval = dict(run_state.get("last_eval", {}))
    evaluated[0] = run_state.get("evaluated_version")
  timer, writer, evaluator = run_services(parts, run_dir)
  ledger = SampleLedger(os.path.join(run_dir, LEDGER_FILE))
  if restored is not None:
    timer.start -= run_state.get("wall_s", 0.0)
    log(f"resumed from {checkpointer.directory} at policy_version {version}"
        + (f" with {len(taken)} groups taken for the next update" if taken else ""))

  rollouter = Rollouter(
      batcher=parts.new_batcher(), prompts=parts.prompt_iterator, rewards=parts.rewards,
      buffer=buffer, channel=channel, timer=timer,
      make_requests=lambda problem, gid, members: make_group_requests(
          problem, gid, cfg.group_size, cfg.seed, members),
      group_size=cfg.group_size, partial_rollout=cfg.partial_rollout,
      partial_strategy=cfg.partial_strategy, next_group_id=rollout_state["next_group_id"],
      reissue=rollout_state["inflight"])
  bar = progress_bar(cfg.num_versions, version, progress)

  def run_state_now(at_version: int) -> dict:
    """Call with the rollouter paused (or stopped): the buffer, the prompts in flight, the
    groups the learner has taken and the logs' lengths then form one consistent point."""
    ledger.dropped_log(buffer.take_drop_log())
    return {"policy_version": at_version, "consumed_samples": totals["consumed"],
            "consumed_tokens": totals["tokens"], "wall_s": timer.wall_s(),
            "buffer": buffer.get_state(), "rollout": rollouter.snapshot(),
            "taken": [[encode_sample(s) for s in group] for group in learner.taken or []],
            "last_eval": last_eval, "evaluated_version": evaluated[0],
            **log_offsets(run_dir, ledger)}

  def save_checkpoint(at_version: int, learner_state) -> None:
    rollouter.pause()
    try:
      with timer.excluded():
        checkpointer.save(at_version, learner_state, parts.prompt_iterator,
                          run_state_now(at_version))
    finally:
      rollouter.resume()

  def run_eval(at_version: int, learner_state) -> None:
    rollouter.pause()
    try:
      with timer.excluded():
        last_eval.update(evaluator(learner_state.params, at_version))
      evaluated[0] = at_version
      writer.write(eval_record(at_version, learner_state, totals["consumed"], timer, last_eval))
    finally:
      rollouter.resume()

  def on_version(at_version, learner_state, groups, accumulated, staleness):
    watchdog.progress()
    totals["consumed"] += sum(len(g) for g in groups)
    totals["tokens"] += sum(s.num_response_tokens for g in groups for s in g)
    ledger.consumed(at_version, groups)
    record = async_version_record(
        parts, timer, at_version, learner_state, groups, accumulated, staleness, totals, buffer,
        channel, learner.wait_s, {**{f"rollout/{k}": v for k, v in rollouter.counts.items()},
                                  **reward_metrics(parts.rewards)})
    writer.write(record)
    show_version(bar, record, last_eval)
    if learner.stopping:  # Ctrl-C: the controller saves once both roles have stopped
      return
    if at_version % cfg.eval_every_versions == 0:
      run_eval(at_version, learner_state)
    if at_version % cfg.checkpoint_every_versions == 0 or at_version == cfg.num_versions:
      save_checkpoint(at_version, learner_state)
    watchdog.progress()  # an evaluation or a checkpoint that finished is progress too

  learner = make_learner_role(parts, state, buffer, channel, timer, start_version=version,
                              on_version=on_version, taken=taken)

  def stop_roles() -> None:
    learner.stop()
    rollouter.stop()
    buffer.close()
    try:
      learner.join(JOIN_TIMEOUT_S)
      rollouter.join(JOIN_TIMEOUT_S)
    finally:
      bar.close()

  def rescue() -> None:  # the watchdog's: stop everything, then save if both roles stopped
    stop_roles()
    save_after_stop()
    log(f"watchdog: checkpoint at policy_version {learner.version} in {checkpointer.directory}")

  def save_after_stop() -> None:
    """Both roles have stopped, so the snapshot is consistent. The groups in flight are
    re-issued on resume. If a checkpoint of this version exists, it is itself a consistent
    point (it holds the groups the learner had taken), and what came after it is replayed."""
    rollouter.take_drop_log()  # its shutdown drops are in the snapshot, re-issued on resume
    if checkpointer.latest_step() == learner.version:
      return
    if learner.window_groups:  # updates of a cut-short window stay in the state
      totals["consumed"] += sum(len(g) for g in learner.window_groups)
      ledger.consumed(learner.version, learner.window_groups)
    checkpointer.save(learner.version, learner.state, parts.prompt_iterator,
                      run_state_now(learner.version))

  def describe() -> str:
    return (f"learner version {learner.version}, buffer {buffer.counts}, rollout "
            f"{rollouter.counts}, ledger {ledger.offset()} bytes")

  watchdog = Watchdog(cfg.watchdog_timeout_s, startup_s=cfg.watchdog_startup_s,
                      describe=describe, rescue=rescue)
  if not last_eval:
    with timer.excluded():
      last_eval.update(evaluator(state.params, version))
    evaluated[0] = version
    writer.write(eval_record(version, state, totals["consumed"], timer, last_eval))
  interrupted = False
  with watchdog:
    try:
      learner.start()
      rollouter.start()
      _watch(learner, rollouter)
    except KeyboardInterrupt:
      interrupted = True
      log("interrupted: stopping roles and saving a checkpoint")
    finally:
      stop_roles()
    if interrupted:
      save_after_stop()
      for closing in (writer, ledger, checkpointer, channel):
        closing.close()
      raise KeyboardInterrupt
    _raise_role_errors(learner, rollouter)
  final_state = learner.state
  if evaluated[0] != learner.version:  # the last version may have been evaluated already
    with timer.excluded():
      last_eval.update(evaluator(final_state.params, learner.version))
    writer.write(eval_record(learner.version, final_state, totals["consumed"], timer, last_eval))
  queued = buffer.discard_queued("shutdown")
  if not rollouter.wait_rewards(JOIN_TIMEOUT_S):
    log(f"warning: samples still in the reward pool after {JOIN_TIMEOUT_S} s")
  ledger.dropped_log(buffer.take_drop_log() + rollouter.take_drop_log())
  buffer.check_invariants()
  audit = ledger_audit(ledger, cfg.group_size, next_group_id=rollouter.next_group_id)
  summary = {**timer.summary(), **last_eval, **buffer.metrics(), **channel.metrics(),
             **reward_metrics(parts.rewards), **audit,
             "mode": cfg.mode, "policy_version": learner.version,
             "learner_step": int(final_state.step), "consumed_samples": totals["consumed"],
             "system/samples_per_s": totals["consumed"] / max(timer.wall_s(), 1e-9),
             "system/tokens_per_s": totals["tokens"] / max(timer.wall_s(), 1e-9),
             "queue/discarded_at_end": queued,
             "rollout/shutdown_dropped": rollouter.counts["shutdown"],
             "rollout/next_group_id": rollouter.next_group_id,
             "run_dir": os.path.abspath(run_dir), "checkpoint_dir": checkpointer.directory,
             **{f"rollout/{k}": v for k, v in rollouter.counts.items()}}
  for closing in (writer, ledger, checkpointer, channel):
    closing.close()
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
