"""The `processes` backend: the learner, the buffer service and the controller in this process,
K rollout servers in spawned child processes beside it, each on its own share of the cores.

Samples come in over the buffer service (one call per batch), weights go out over shared
memory (`sync_backend='device'`) or the orbax store (`'store'`). The learner role, its update
and its checks are those of the threads backend. Checkpoints pause every server, save the
buffer, each server's groups in flight and its prompt shard's position; resume gives each
server back its own. The main thread watches the learner and sends the heartbeats.
"""

from __future__ import annotations

import json
import os
import shutil

import jax

from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.checkpoint import RunCheckpointer
from jaxrl_async.controller import (
  Evaluator,
  async_version_record,
  buffer_for,
  eval_record,
  ledger_audit,
  make_learner_role,
  progress_bar,
  short_gil_switch,
  show_version,
)
from jaxrl_async.ledger import LEDGER_FILE, SampleLedger, log_offsets, rewind_logs
from jaxrl_async.metrics import RoleTimer
from jaxrl_async.runtime import child
from jaxrl_async.runtime.assembly import PROCESS_CHANNELS
from jaxrl_async.runtime.buffer_service import BufferService
from jaxrl_async.runtime.fleet import Fleet, RolloutServerFailed
from jaxrl_async.runtime.shm_channel import SharedMemoryWeightChannel
from jaxrl_async.sinks import make_writer
from jaxrl_async.sync import OrbaxStoreChannel
from jaxrl_async.types import Sample
from jaxrl_async.watchdog import Watchdog

HEARTBEAT_INTERVAL_S = 1.0
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


def make_buffer(cfg) -> VersionedBuffer:
  """The run's buffer, built by the same rules as the threads backend's (group filter and
  truncation drops included)."""
  return buffer_for(cfg)


def make_channel(parts, run_dir):
  """(learner end, spec the servers open their end from)."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), parts.state.params)
  if PROCESS_CHANNELS[parts.config.sync_backend] == "shm":
    channel = SharedMemoryWeightChannel.create(abstract)
    return channel, {"kind": "shm", "location": channel.name}
  directory = os.path.join(os.path.abspath(run_dir), "weights")
  shutil.rmtree(directory, ignore_errors=True)  # transport, not a checkpoint
  return (OrbaxStoreChannel(directory, abstract, parts.logical_axes),
          {"kind": "store", "location": directory})


def write_ledger(path: str, service: BufferService, consumed: list[list[int]]) -> None:
  """This invocation's groups: every group a server started (group id -> prompt id), the ones
  consumed, and the ones re-issued after a server was lost. A started group that was not
  consumed ended as a drop, counted under its reason in the summary."""
  with open(path, "w", encoding="utf-8") as f:
    json.dump({"started": {str(g): p for g, p in sorted(service.started.items())},
               "consumed": consumed, "reissued": sorted(service.reissued)}, f)


def run_processes(parts, run_dir, *, resume: bool, progress: bool, log=print) -> dict:
  cfg = parts.config
  timer = RoleTimer()
  writer = make_writer(run_dir, timer, cfg.metric_sinks, log=log)
  checkpointer = RunCheckpointer(os.path.join(run_dir, "checkpoints"))
  evaluator = Evaluator(parts)
  # Opened for appending before the resume cuts it back (rewind_logs): nothing is written first.
  ledger = SampleLedger(os.path.join(run_dir, LEDGER_FILE))
  buffer = make_buffer(cfg)
  channel, channel_spec = make_channel(parts, run_dir)
  service = BufferService(buffer).start()
  _, server_cores = child.core_shares(cfg.num_rollout_servers)
  fleet = Fleet(cfg, service, channel_spec, cores=server_cores,
                heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                status_path=os.path.join(run_dir, "rollout_servers.json"), log=log)
  try:
    with short_gil_switch():  # the buffer service's threads answer the servers promptly
      return _run(parts, run_dir, resume, progress, log, timer, writer, checkpointer, evaluator,
                  buffer, channel, fleet, service, ledger)
  finally:
    try:
      fleet.stop()
    finally:
      buffer.close()
      service.stop()
      writer.close()
      ledger.close()
      checkpointer.close()
      channel.close()


def _run(parts, run_dir, resume, progress, log, timer, writer, checkpointer, evaluator, buffer,
         channel, fleet, service, ledger) -> dict:
  cfg = parts.config
  state, version = parts.state, 0
  totals = {"consumed": 0, "tokens": 0}
  restores: list = [None] * cfg.num_rollout_servers
  taken = None
  shards = ShardPrompts()
  run_state = None
  if resume and checkpointer.latest_step() is not None:
    state, run_state, _ = checkpointer.restore(state, shards)
    servers = run_state.get("rollout", {}).get("servers")
    if servers is None or len(servers) != cfg.num_rollout_servers:
      raise ValueError(f"num_rollout_servers={cfg.num_rollout_servers}: the checkpoint under "
                       f"{checkpointer.directory} was saved by "
                       f"{'a threads run' if servers is None else f'{len(servers)} servers'}; "
                       "resume with the same backend and number of servers")
    restores = [{"rollout": rollout, "prompts": prompts}
                for rollout, prompts in zip(servers, shards.states)]
    version = run_state["policy_version"]
    totals = {"consumed": run_state["consumed_samples"], "tokens": run_state["consumed_tokens"]}
    buffer.set_state(run_state["buffer"])
    taken = [[Sample.from_dict(s) for s in group] for group in run_state.get("taken", [])]
    timer.start -= run_state.get("wall_s", 0.0)
    log(f"resumed from {checkpointer.directory} at policy_version {version}")
  # Before anything is written: metrics.jsonl and ledger.jsonl back to the checkpoint's view
  # (empty for a run that starts from scratch), so versions made again are logged once.
  rewind_logs(run_dir, run_state)

  bar = progress_bar(cfg.num_versions, version, progress)
  last_eval: dict = {}

  def save_checkpoint(at_version: int, learner_state, pending=None) -> None:
    with timer.excluded():
      fleet.pause()
      try:
        snapshots = fleet.snapshots()
        ledger.dropped_log(buffer.take_drop_log())  # paused: the buffer's drops so far
        checkpointer.save(at_version, learner_state, ShardPrompts(
            [s["prompts"] for s in snapshots]), {
                "policy_version": at_version, "consumed_samples": totals["consumed"],
                "consumed_tokens": totals["tokens"], "wall_s": timer.wall_s(),
                "buffer": buffer.get_state(),
                "taken": [[s.to_dict() for s in g] for g in (pending or [])],
                "rollout": {"backend": "processes",
                            "servers": [s["rollout"] for s in snapshots]},
                **log_offsets(run_dir, ledger)})
      finally:
        fleet.resume()

  def run_eval(at_version: int, learner_state) -> None:
    with timer.excluded():
      fleet.pause()
      try:
        last_eval.update(evaluator(learner_state.params, at_version))
      finally:
        fleet.resume()
    writer.write(eval_record(at_version, learner_state, totals["consumed"], timer, last_eval))

  consumed_groups: list[list[int]] = []  # [group id, prompt id] of every consumed group

  def on_version(at_version, learner_state, groups, accumulated, staleness):
    watchdog.progress()
    consumed_groups.extend([g[0].group_id, g[0].prompt_id] for g in groups)
    ledger.consumed(at_version, groups)
    totals["consumed"] += sum(len(g) for g in groups)
    totals["tokens"] += sum(s.num_response_tokens for g in groups for s in g)
    record = async_version_record(
        parts, timer, at_version, learner_state, groups, accumulated, staleness, totals, buffer,
        channel, learner.wait_s,
        {**fleet.rollout_counts(), **fleet.server_timers(), **fleet.counts})
    writer.write(record)
    show_version(bar, record, last_eval)
    if learner.stopping:
      return
    if at_version % cfg.eval_every_versions == 0:
      run_eval(at_version, learner_state)
    if at_version % cfg.checkpoint_every_versions == 0 or at_version == cfg.num_versions:
      save_checkpoint(at_version, learner_state, learner.taken)
    watchdog.progress()  # an evaluation or a checkpoint that finished is progress too

  learner = make_learner_role(parts, state, buffer, channel, timer, start_version=version,
                              on_version=on_version, taken=taken)

  def rescue() -> None:  # the watchdog's: stop the learner, then save if it stopped
    learner.stop()
    learner.join(JOIN_TIMEOUT_S)
    if learner.alive:
      log(f"watchdog: the learner did not stop; resume from the checkpoint at policy_version "
          f"{checkpointer.latest_step()}")
      return
    if checkpointer.latest_step() != learner.version:
      if learner.window_groups:  # updates of a cut-short window stay in the state
        totals["consumed"] += sum(len(g) for g in learner.window_groups)
        ledger.consumed(learner.version, learner.window_groups)
      save_checkpoint(learner.version, learner.state, learner.taken)
    log(f"watchdog: checkpoint at policy_version {learner.version} in {checkpointer.directory}")

  def describe() -> str:
    servers = [{"pid": h.get("pid"), "version": h.get("version"), "counts": h.get("counts")}
               for h in fleet.last_health]
    hung = "".join(f"; rollout server {index} blocked at fault point {', '.join(h['hanging'])}"
                   for index, h in enumerate(fleet.last_health) if h.get("hanging"))
    return (f"learner version {learner.version}, buffer {buffer.counts}, rollout servers "
            f"{servers}, ledger {ledger.offset()} bytes{hung}")

  watchdog = Watchdog(cfg.watchdog_timeout_s, startup_s=cfg.watchdog_startup_s,
                      describe=describe, rescue=rescue)

  with timer.excluded():
    last_eval.update(evaluator(state.params, version))
  writer.write(eval_record(version, state, totals["consumed"], timer, last_eval))
  with watchdog:
    with timer.excluded():  # starting processes is not training time
      fleet.start(restores)
    try:
      learner.start()
      while not learner.done.wait(HEARTBEAT_INTERVAL_S):
        fleet.check()
        timer.add_spans(fleet.take_spans())
    except KeyboardInterrupt:
      learner.stop()
      learner.join(JOIN_TIMEOUT_S)
      if checkpointer.latest_step() != learner.version:
        save_checkpoint(learner.version, learner.state, learner.taken)
      log(f"interrupted: checkpoint at policy_version {learner.version}")
      raise
    finally:
      learner.stop()
      if learner.alive:
        buffer.close()  # wakes the learner if it waits for groups that will not come
      learner.join(JOIN_TIMEOUT_S)
      bar.close()
  if learner.error is not None:
    raise RolloutServerFailed(f"the learner role failed: {learner.error!r}") from learner.error
  final_state = learner.state
  fleet.stop()
  timer.add_spans(fleet.take_spans())
  with timer.excluded():
    last_eval.update(evaluator(final_state.params, learner.version))
  writer.write(eval_record(learner.version, final_state, totals["consumed"], timer, last_eval))
  queued = buffer.discard_queued("shutdown")
  ledger.dropped_log(buffer.take_drop_log() + fleet.drop_log())
  buffer.check_invariants()
  write_ledger(os.path.join(run_dir, "prompt_ledger.json"), service, consumed_groups)
  produced = fleet.produced_groups()
  audit = ledger_audit(ledger, cfg.group_size, groups=produced)
  parts.state = final_state
  return {**timer.summary(), **last_eval, **buffer.metrics(), **channel.metrics(), **audit,
          "rollout/produced_groups": len(produced),
          "rollout/next_group_ids": fleet.next_group_ids(),
          **fleet.rollout_counts(), **fleet.server_timers(), **fleet.counts,
          "mode": cfg.mode, "backend": "processes", "num_rollout_servers": fleet.num_servers,
          "rollout_server_restarts": fleet.restarts, "policy_version": learner.version,
          "learner_step": int(final_state.step), "consumed_samples": totals["consumed"],
          "system/samples_per_s": totals["consumed"] / max(timer.wall_s(), 1e-9),
          "system/tokens_per_s": totals["tokens"] / max(timer.wall_s(), 1e-9),
          "queue/discarded_at_end": queued, "run_dir": os.path.abspath(run_dir),
          "checkpoint_dir": checkpointer.directory}
