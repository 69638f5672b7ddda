"""The async loop, one for every backend: the learner role in this process, the rollout servers
wherever the backend puts them (`backends/`), joined by the buffer and the weight channel.

The loop owns the run's state: the restore (the newest checkpoint that reads back whole), the
groups the learner has taken, the evaluation state, the ledger and the logs' offsets, the
watchdog, the summary and the ledger's audit, in one checkpoint schema that names the backend
that wrote it. Hooks on each new policy version (`on_version`): records, evaluation, checkpoint.
Its main thread sends the fleet's heartbeats; a failure in any role stops the run with that
role's error (`RoleFailed`), and Ctrl-C stops it within seconds and leaves a checkpoint.
"""

from __future__ import annotations

import json
import math
import os

from jaxrl_async.backends import fleet_shape
from jaxrl_async.backends.base import Backend, Connection, RoleFailed
from jaxrl_async.buffer import staleness_control
from jaxrl_async.buffer.groups import decode_sample, encode_sample
from jaxrl_async.checkpoint import RunCheckpointer
from jaxrl_async.learner.learner import LearnerRole
from jaxrl_async.ledger import LEDGER_FILE, SampleLedger, log_offsets, rewind_logs
from jaxrl_async.metrics import RoleTimer
from jaxrl_async.roles import short_gil_switch
from jaxrl_async.run.build import (
  Evaluator,
  Parts,
  learner_update,
  run_checkpointer,
  window_copy,
)
from jaxrl_async.run.handoff import Handoffs
from jaxrl_async.run.records import (
  eval_record,
  ledger_audit,
  progress_bar,
  show_version,
  version_record,
)
from jaxrl_async.run.schedule_record import open_recorder
from jaxrl_async.sinks import make_writer
from jaxrl_async.watchdog import Watchdog

JOIN_TIMEOUT_S = 60.0


class ShardPrompts:
  """The prompt shards' positions, one per server, as the checkpoint's 'prompts' item (grain's
  checkpoint handler saves any object with get_state() -> bytes / set_state(bytes))."""

  def __init__(self, states: list | None = None):
    self.states = list(states or [])

  def get_state(self) -> bytes:
    return json.dumps({"servers": self.states}).encode()

  def set_state(self, state: bytes) -> None:
    self.states = list(json.loads(state.decode())["servers"])

  def start_prefetch(self) -> None:
    return None


def fleet_figures(fleet) -> dict:
  """The rollout side's figures: counts, busy time, reward outcomes and re-issues, and the
  weight swaps' mean fetch and load seconds."""
  counts = fleet.rollout_counts()
  swaps = counts.get("rollout/swaps", 0)
  for stage in ("fetch", "load"):
    total = counts.get(f"rollout/swap_{stage}_s")
    if total is not None:
      counts[f"rollout/swap_{stage}_s_mean"] = total / swaps if swaps else math.nan
  return {**counts, **fleet.server_timers(), **fleet.reward_counts(),
          **fleet.sync_figures(), "fleet/size": fleet.num_servers, **fleet.counts}


def make_learner_role(parts: Parts, state, buffer, channel, timer, *, start_version: int,
                      on_version, taken=None) -> LearnerRole:
  """The learner role, as the config asks."""
  cfg, learner = parts.config, parts.learner
  return LearnerRole(
      state=state, buffer=buffer, channel=channel, timer=timer,
      update_fn=lambda st, groups, window, v, local: learner_update(learner, st, groups, window,
                                                                    v, local),
      copy_params=lambda params: window_copy(learner, params),
      groups_per_update=cfg.groups_per_update,
      trigger_parameter_sync_step=cfg.trigger_parameter_sync_step,
      num_versions=cfg.num_versions, start_version=start_version,
      on_policy=cfg.asserts_on_policy, max_version_gap=cfg.max_version_gap,
      needs_window_params=cfg.needs_window_params, on_version=on_version,
      debug_checks=cfg.debug_checks, taken=taken)


def restore_run(checkpointer: RunCheckpointer, parts: Parts, *, log=print):
  """(state, run_state, per-server restores, (closed group-id segments, each server's first
  group id)) from the newest checkpoint that reads back whole, or None when there is none (then
  the run starts from scratch, and says so). A checkpoint of another number of rollout servers
  is re-dealt to `num_rollout_servers` (`backends.fleet_shape`)."""
  cfg = parts.config
  shards = ShardPrompts()
  restored = checkpointer.restore_latest(parts.learner.initial_state, shards)
  if restored is None:
    log(f"resume: no checkpoint under {checkpointer.directory}; starting from scratch")
    return None
  state, run_state, _ = restored
  rollout = run_state.get("rollout", {})
  servers = rollout.get("servers")
  if servers is None:  # written before each rollout server saved its own state
    raise ValueError(f"the checkpoint under {checkpointer.directory} has no per-server rollout "
                     "state (an older run-state layout, not migrated): it cannot be resumed; "
                     "start a new run in another directory")
  if len(servers) != cfg.num_rollout_servers:
    log(f"resume: the checkpoint was saved by {len(servers)} rollout servers "
        f"({rollout.get('backend')} backend); prompts and unfinished groups are re-dealt to "
        f"{cfg.num_rollout_servers}")
  restores, closed, starts = fleet_shape.resized_restores(rollout, shards.states,
                                                          cfg.num_rollout_servers)
  return state, run_state, restores, (closed, starts)


def restore_staleness(control, cfg, run_state):
  """The adaptive controller's state: the checkpoint's (its s within this run's bounds), or a
  fresh one at `staleness_threshold`; None for 'fixed'."""
  if control is None:
    return None
  saved = (run_state or {}).get("staleness")
  if saved is None:
    return staleness_control.init_state(cfg.staleness_threshold)
  state = staleness_control.state_from_json(saved)
  if not cfg.staleness_min <= state.threshold <= cfg.staleness_max:
    raise ValueError(f"the checkpoint's staleness threshold {state.threshold} is outside "
                     f"[staleness_min, staleness_max] = [{cfg.staleness_min}, "
                     f"{cfg.staleness_max}]: resume with bounds that hold it")
  return state


def run_async(parts: Parts, backend: Backend, run_dir, *, resume: bool, progress: bool,
              log=print):
  """An async run of `parts` on `backend` -> (summary, final learner state)."""
  with short_gil_switch(), backend.connect(parts, run_dir, log=log) as connection:
    return _run(parts, backend, connection, run_dir, resume=resume, progress=progress, log=log)


def _run(parts: Parts, backend: Backend, connection: Connection, run_dir, *, resume: bool,
         progress: bool, log):
  cfg = parts.config
  buffer, channel, fleet = connection.buffer, connection.channel, connection.fleet
  if parts.learner.multihost is not None:  # publishes gather the params onto this host first
    channel = parts.learner.multihost.publishing(channel)
  checkpointer = run_checkpointer(parts.learner, os.path.join(run_dir, "checkpoints"), log=log)
  state, version = parts.learner.initial_state, 0
  totals = {"consumed": 0, "tokens": 0}
  restores: list = [None] * cfg.num_rollout_servers
  taken, last_eval, evaluated = None, {}, None  # evaluated: the version last evaluated
  restored = restore_run(checkpointer, parts, log=log) if resume else None
  run_state = None
  if restored is not None:
    state, run_state, restores, (fleet.closed_segments, fleet.group_starts) = restored
    version = run_state["policy_version"]
    totals = {"consumed": run_state["consumed_samples"], "tokens": run_state["consumed_tokens"]}
    buffer.set_state(run_state["buffer"])
    taken = [[decode_sample(s) for s in group] for group in run_state.get("taken", [])]
    last_eval = dict(run_state.get("last_eval", {}))
    evaluated = run_state.get("evaluated_version")
  control = staleness_control.control_of(cfg) if cfg.adaptive_staleness else None
  staleness = restore_staleness(control, cfg, run_state)
  # Before anything is written: metrics.jsonl and ledger.jsonl back to the checkpoint's view
  # (empty for a run that starts from scratch), so versions made again are logged once.
  rewind_logs(run_dir, run_state)
  recorder = open_recorder(run_dir, cfg, run_state, backend=backend.name)
  timer = RoleTimer()
  writer = make_writer(run_dir, timer, cfg.metric_sinks, log=log)
  ledger = SampleLedger(os.path.join(run_dir, LEDGER_FILE))
  evaluator = Evaluator(parts.rollout, parts.learner)
  if run_state is not None:
    timer.start -= run_state.get("wall_s", 0.0)
    log(f"resumed from {checkpointer.directory} at policy_version {version}"
        + (f" with {len(taken)} groups taken for the next update" if taken else ""))
  bar = progress_bar(cfg.num_versions, version, progress)
  consumed_groups: list[list[int]] = []  # [group id, prompt id] of every consumed group

  def save_checkpoint(at_version: int, learner_state, pending) -> None:
    with timer.excluded():
      fleet.pause()
      try:
        snapshots = fleet.snapshots()
        ledger.dropped_log(buffer.take_drop_log())  # paused: the buffer's drops so far
        if recorder is not None:  # before the checkpoint: no checkpoint without its schedule
          recorder.flush(at_version)
        checkpointer.save(at_version, learner_state, ShardPrompts(
            [s["prompts"] for s in snapshots]), {
                "policy_version": at_version, "consumed_samples": totals["consumed"],
                "consumed_tokens": totals["tokens"], "wall_s": timer.wall_s(),
                "buffer": buffer.get_state(),
                "taken": [[encode_sample(s) for s in g] for g in (pending or [])],
                "rollout": {"backend": backend.name,
                            "servers": [s["rollout"] for s in snapshots],
                            "segments": fleet_shape.close(
                                fleet.closed_segments, fleet.group_starts,
                                [s["rollout"]["next_group_id"] for s in snapshots])},
                "last_eval": last_eval, "evaluated_version": evaluated,
                **({} if staleness is None else {
                    "staleness": staleness_control.state_to_json(staleness)}),
                **log_offsets(run_dir, ledger)})
      finally:
        fleet.resume()

  def run_eval(at_version: int, learner_state) -> None:
    nonlocal evaluated
    with timer.excluded():
      fleet.pause()
      try:
        last_eval.update(evaluator(learner_state.params, at_version))
      finally:
        fleet.resume()
    evaluated = at_version
    writer.write(eval_record(at_version, learner_state, totals["consumed"], timer, last_eval))

  def on_version(at_version, learner_state, groups, accumulated, gaps):
    nonlocal staleness
    watchdog.progress()
    consumed_groups.extend([g[0].group_id, g[0].prompt_id] for g in groups)
    if recorder is not None:
      recorder.on_version(at_version, groups, learner.published_at)
    ledger.consumed(at_version, groups)
    totals["consumed"] += sum(len(g) for g in groups)
    totals["tokens"] += sum(s.num_response_tokens for g in groups for s in g)
    sync = channel.metrics()
    record = version_record(cfg, timer, at_version, learner_state, groups, accumulated,
                            totals["consumed"], totals["tokens"], sync["sync/latency_s"])
    record.update(gaps)
    record.update(buffer.metrics())
    record.update(sync)
    record.update(fleet_figures(fleet))
    record["learner/wait_s"] = learner.wait_s
    handoffs.observe(groups)
    latest = handoffs.intervals(at_version - 1)  # the version most of these tokens came from
    record.update({f"handoff/{name}": value for name, value in (latest or {}).items()})
    if control is not None:  # the window's decision, in force from the next window on
      staleness, fields, decision = staleness_control.on_record(control, staleness, record)
      record.update(fields)
      if decision is not None and decision.change:
        buffer.set_staleness_threshold(decision.threshold, at_version + 1)
    writer.write(record)
    show_version(bar, record, last_eval)
    if learner.stopping:  # Ctrl-C or the watchdog: the loop saves once the learner stopped
      return
    if at_version % cfg.eval_every_versions == 0:
      run_eval(at_version, learner_state)
    if at_version % cfg.checkpoint_every_versions == 0 or at_version == cfg.num_versions:
      save_checkpoint(at_version, learner_state, learner.taken)
    watchdog.progress()  # an evaluation or a checkpoint that finished is progress too

  learner = make_learner_role(parts, state, buffer, channel, timer, start_version=version,
                              on_version=on_version, taken=taken)
  # Publish -> first sample of the version in the buffer -> the learner's take.
  handoffs = Handoffs(learner.published_at)

  def save_after_stop() -> None:
    """The learner has stopped: its state, the groups it had taken and the fleet's snapshot
    form one consistent point. If a checkpoint of this version exists, it is itself one (it
    holds the groups the learner had taken), and what came after it is replayed."""
    if checkpointer.latest_step() == learner.version:
      return
    if learner.window_groups:  # updates of a cut-short window stay in the state
      totals["consumed"] += sum(len(g) for g in learner.window_groups)
      ledger.consumed(learner.version, learner.window_groups)
      if recorder is not None:
        recorder.on_cut_window(learner.version, learner.window_groups)
    save_checkpoint(learner.version, learner.state, learner.taken)

  def rescue() -> None:  # the watchdog's: stop the learner, then save if it stopped
    learner.stop()
    learner.join(JOIN_TIMEOUT_S)
    save_after_stop()
    log(f"watchdog: checkpoint at policy_version {learner.version} in {checkpointer.directory}")

  def describe() -> str:
    return (f"learner version {learner.version}, buffer {buffer.counts}, {fleet.describe()}, "
            f"ledger {ledger.offset()} bytes")

  watchdog = Watchdog(cfg.watchdog_timeout_s, startup_s=cfg.watchdog_startup_s,
                      rescue_s=cfg.watchdog_rescue_s,
                      describe=describe, rescue=rescue)
  try:
    if evaluated != version:  # a resumed run evaluated its checkpoint's version already
      with timer.excluded():
        last_eval.update(evaluator(state.params, version))
      evaluated = version
      writer.write(eval_record(version, state, totals["consumed"], timer, last_eval))
    with watchdog:
      with timer.excluded():  # starting servers is not training time
        fleet.start(restores)
      if staleness is not None:  # this life's role timer: the learner's busy time from 0
        staleness = staleness._replace(mark=(timer.wall_s(), timer.busy_s("learner")))
      try:
        learner.start()
        while not learner.done.wait(fleet.heartbeat_s):
          fleet.check()
          timer.add_spans(fleet.take_spans())
      except KeyboardInterrupt:
        learner.stop()
        learner.join(JOIN_TIMEOUT_S)
        save_after_stop()
        log(f"interrupted: checkpoint at policy_version {learner.version} in "
            f"{checkpointer.directory}")
        raise
      finally:
        learner.stop()
        if learner.alive:
          buffer.close()  # wakes the learner if it waits for groups that will not come
        learner.join(JOIN_TIMEOUT_S)
        bar.close()
    if learner.error is not None:
      raise RoleFailed(f"the learner role failed: {learner.error!r}") from learner.error
    final_state = learner.state
    with timer.excluded():  # stopping servers is not training time, as starting them is not
      fleet.stop()
    timer.add_spans(fleet.take_spans())
    if evaluated != learner.version:  # the last version may have been evaluated already
      with timer.excluded():
        last_eval.update(evaluator(final_state.params, learner.version))
      writer.write(eval_record(learner.version, final_state, totals["consumed"], timer,
                               last_eval))
    queued = buffer.discard_queued("shutdown")
    ledger.dropped_log(buffer.take_drop_log() + fleet.drop_log())
    buffer.check_invariants()
    if connection.started_groups is not None:
      with open(os.path.join(run_dir, "prompt_ledger.json"), "w", encoding="utf-8") as f:
        json.dump({**connection.started_groups(), "consumed": consumed_groups}, f)
    produced = fleet.produced_groups()
    audit = ledger_audit(ledger, cfg.group_size, groups=produced)
  finally:
    for closing in (writer, ledger, checkpointer):
      closing.close()
  wall_s = max(timer.wall_s(), 1e-9)
  summary = {**timer.summary(), **last_eval, **buffer.metrics(), **channel.metrics(), **audit,
             "rollout/produced_groups": len(produced),
             "rollout/next_group_ids": fleet.next_group_ids(),
             **fleet_figures(fleet), **fleet.placement(),
             "mode": cfg.mode, "backend": backend.name, "num_rollout_servers": fleet.num_servers,
             "rollout_server_restarts": fleet.restarts, "policy_version": learner.version,
             "learner_step": int(final_state.step), "consumed_samples": totals["consumed"],
             "system/samples_per_s": totals["consumed"] / wall_s,
             "system/tokens_per_s": totals["tokens"] / wall_s,
             "queue/discarded_at_end": queued, **handoffs.summary(),
             **({} if staleness is None else {"staleness/threshold": staleness.threshold}),
             **({} if recorder is None else recorder.summary()),
             "run_dir": os.path.abspath(run_dir), "checkpoint_dir": checkpointer.directory}
  return summary, final_state

