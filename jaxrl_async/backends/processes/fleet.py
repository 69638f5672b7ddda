"""The rollout servers of a `processes` run, seen from the learner's process.

`ProcessFleet` starts K `RolloutProcess`es, each on its share of the cores, and keeps them answering:
`check()` (a heartbeat, from the controller's thread) replaces a server whose process died or
that did not answer `health` within `heartbeat_timeout_s` (a stopped process: SIGSTOP). A
replaced server is killed with SIGKILL, its buffer client revoked, and a new one continues its
prompt shard and re-issues its unfinished groups, each exactly once: they are counted under
`runtime/reissued_groups/<reason>` and `runtime/reissued_samples/<reason>` (reasons
'server_died', 'server_unresponsive', 'load_deadline': still loading a weight version after
`RunConfig.sync_load_deadline_s`, counted `sync/load_deadline_missed`). A server that reports an
error of its own role stops the run with that error: restarting it would only repeat it.

The fleet is elastic (`backends.elastic.Elastic`: `<run_dir>/fleet_control` read at the
heartbeat): a leaving server, paused and answered, is killed and its buffer client revoked,
which returns its unfinished groups and prompt position; the new shape's servers are new
processes.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
from typing import Any

from jaxrl_async.backends import fleet_shape
from jaxrl_async.backends.base import (
  Fleet,
  RoleFailed,
  keep_spans,
  load_overdue,
  warn_unscored,
)
from jaxrl_async.backends.elastic import Elastic
from jaxrl_async.backends.processes import child, wire
from jaxrl_async.backends.processes.buffer_service import BufferService, RemoteBufferClient
from jaxrl_async.backends.processes.rollout_process import RolloutProcess
from jaxrl_async.backends.rollout_server import first_start

# Re-issue reasons of replaced servers (those of a change of shape: fleet_shape.RESHAPE_REASONS).
REISSUE_REASONS = ("server_died", "server_unresponsive", "load_deadline")
REVOKE_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 600.0


class RolloutServerFailed(RoleFailed):
  """A rollout server's role raised, or servers kept dying past `max_restarts`."""


class ProcessFleet(Elastic, Fleet):
  """K `RolloutProcess`es, kept answering by the heartbeat (`check`)."""

  def __init__(self, config, service: BufferService, channel_spec: dict, *,
               cores: list[list[int]], heartbeat_timeout_s: float, max_restarts: int = 8,
               status_path: str | None = None, control_path: str | None = None, log=print):
    super().__init__(len(cores), log=log)
    self.config = config
    self.service = service
    self.channel_spec = channel_spec
    self.cores = cores
    self.heartbeat_timeout_s = heartbeat_timeout_s
    self.max_restarts = max_restarts
    self.status_path = status_path  # JSON: each server's pid, cores and client id
    self._init_elastic(control_path)
    self.servers: list[RolloutProcess | None] = [None] * self.num_servers
    self.client_ids: list[str] = [""] * self.num_servers
    self._generation = [0] * self.num_servers
    self._initial: list[dict] = [{}] * self.num_servers  # where each shard started
    self._restarts = 0
    self._counts: dict[str, int] = {}
    for reason in REISSUE_REASONS:
      self._counts[f"runtime/reissued_groups/{reason}"] = 0
      self._counts[f"runtime/reissued_samples/{reason}"] = 0
    self._counts["sync/load_deadline_missed"] = 0
    # Children die with the thread that spawned them (child.py): one thread spawns them all and
    # lives until `stop`, whichever thread asks for a replacement.
    self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-spawner")
    self._stopped = False  # `stop` ran: a second call (the backend's own, on leaving) does nothing

  @property
  def restarts(self) -> int:
    return self._restarts

  @property
  def counts(self) -> dict[str, int]:
    return {**self._counts, **self.elastic_counts}

  # ---- lifecycle ------------------------------------------------------------------------------
  def start(self, restores: list[dict | None]) -> None:
    """Starts every server (restores[k]: a checkpoint's snapshot of server k, or None)."""
    for index, restore in enumerate(restores):
      restore, self._initial[index] = first_start(restore, index)
      self._spawn(index, restore)

  def _spawn(self, index: int, restore: dict) -> None:
    self._generation[index] += 1
    client_id = f"rollout-{index}-{self._generation[index]}"
    rollout = restore.get("rollout") or {}
    holding = [entry for entry in rollout.get("inflight", [])
               if entry.get("admitted")
               or entry["missing"] != list(range(self.config.group_size))]
    self.service.register(client_id, inflight=holding, prompt_state=restore.get("prompts"),
                          next_group_id=rollout.get("next_group_id"))
    buffer = RemoteBufferClient(self.service.address, self.service.authkey, client_id)
    spec = {"config": self.config, "server_index": index, "num_servers": self.num_servers,
            # the fleet's size, not the config's: group ids advance by it (fleet_shape)
            "buffer": buffer, "channel": self.channel_spec, "restore": restore}
    server = self._spawner.submit(RolloutProcess, spec, cores=self.cores[index],
                                  name=f"rollout-server-{index}").result(SPAWN_TIMEOUT_S)
    self.servers[index], self.client_ids[index] = server, client_id
    self._write_status()
    server.start(self.heartbeat_timeout_s)
    if self._paused:
      server.pause(self.heartbeat_timeout_s * 6)

  def _write_status(self) -> None:
    if self.status_path is None:
      return
    status = [{"server": index, "pid": server.pid, "cores": server.cores,
               "client_id": self.client_ids[index]}
              for index, server in enumerate(self.servers) if server is not None]
    with open(self.status_path + ".tmp", "w", encoding="utf-8") as f:
      json.dump({"servers": status, "restarts": self._restarts}, f)
    os.replace(self.status_path + ".tmp", self.status_path)

  def replace(self, index: int, reason: str) -> None:
    """Kills server `index` and starts its successor with the dead one's unfinished work."""
    with self._lock:
      if self._restarts >= self.max_restarts:
        raise RolloutServerFailed(f"rollout servers were replaced {self._restarts} times "
                                  f"(max_restarts={self.max_restarts}); last: server {index}, "
                                  f"{reason}")
      self._restarts += 1
      server = self.servers[index]
      server.kill()
      self.retire(index)
      orphan = self.service.revoke(self.client_ids[index], REVOKE_TIMEOUT_S)
      inflight = orphan["inflight"]
      self._count_reissued(reason, inflight)
      initial = self._initial[index]
      prompts = orphan["prompt_state"] if orphan["prompt_state"] is not None else (
          initial["prompts"])
      next_group_id = (orphan["next_group_id"] if orphan["next_group_id"] is not None
                       else initial["next_group_id"])
      self.log(f"rollout server {index} (pid {server.pid}) {reason}: replaced; "
               f"{len(inflight)} groups re-issued")
      self._spawn(index, {"rollout": {"next_group_id": next_group_id, "inflight": inflight},
                          "prompts": prompts})

  def check(self) -> None:
    """One heartbeat over every server; replaces the dead and the silent, then applies the
    control file's commands."""
    with self._lock:
      self._check_servers()
      self._apply_control()

  def _start_shape(self, restores: list[dict]) -> None:
    """Processes for the new shape's servers (`Elastic.reshape`)."""
    self._resize(len(restores))
    for index, restore in enumerate(restores):
      self._initial[index] = {"prompts": restore["prompts"],
                              "next_group_id": restore["rollout"]["next_group_id"]}
      self._spawn(index, restore)

  def _take_down(self, index: int) -> dict:
    """Server `index`, paused: its last health kept (counts, drops), then killed and its
    client revoked -> its unfinished groups and prompt position (`fleet_shape.orphan`)."""
    server = self.servers[index]
    try:
      health = server.health(self.heartbeat_timeout_s)
      self.last_health[index] = health
      keep_spans(self.pending_spans, health)
      self.keep_leaving(health)
    except (wire.ServiceTimeout, wire.ServiceGone, EOFError, OSError) as error:
      self.log(f"rollout server {index} gave no last health before leaving ({error!r})")
    server.kill()
    self.retire(index)
    return fleet_shape.orphan(self.service.revoke(self.client_ids[index], REVOKE_TIMEOUT_S),
                              self._initial[index])

  def _resize(self, count: int) -> None:
    """The per-server lists for `count` servers (their processes not started yet)."""
    self.num_servers = count
    self.servers = [None] * count
    self.client_ids = [""] * count
    self._generation = (self._generation + [0] * count)[:max(count, len(self._generation))]
    self._initial = [{}] * count
    self.last_health = [{}] * count
    _, self.cores = child.core_shares(count)

  def _count_reissued(self, reason: str, inflight: list) -> None:
    self._counts[f"runtime/reissued_groups/{reason}"] += len(inflight)
    self._counts[f"runtime/reissued_samples/{reason}"] += sum(len(e["missing"])
                                                            for e in inflight)

  def _check_servers(self) -> None:
    with self._lock:
      for index, server in enumerate(self.servers):
        if not server.alive:
          self.replace(index, "server_died")
          continue
        try:
          health = server.health(self.heartbeat_timeout_s)
        except wire.ServiceTimeout:
          self.replace(index, "server_unresponsive")
          continue
        except (wire.ServiceGone, EOFError, OSError):
          self.replace(index, "server_died")
          continue
        self.last_health[index] = health
        keep_spans(self.pending_spans, health)
        if health["error"] is not None:
          raise RolloutServerFailed(f"rollout server {index} failed: {health['error']}")
        if load_overdue(health, self.config.sync_load_deadline_s):
          self._counts["sync/load_deadline_missed"] += 1
          self.replace(index, "load_deadline")

  def _each(self, method: str, timeout: float) -> list[Any]:
    """Calls `method` on every server; a server that died meanwhile is replaced first."""
    results = []
    with self._lock:
      for index in range(self.num_servers):
        for _ in range(2):
          try:
            results.append(getattr(self.servers[index], method)(timeout))
            break
          except (wire.ServiceTimeout, wire.ServiceGone, EOFError, OSError):
            self.replace(index, "server_died" if not self.servers[index].alive
                         else "server_unresponsive")
        else:
          raise RolloutServerFailed(f"rollout server {index} did not answer {method}")
    return results

  def stop(self, timeout: float = 60.0) -> None:
    """Stops every server (each counts what it aborts as 'shutdown') and reaps them all. A
    server that gives no last answer (it died after its last heartbeat, or its stop failed) is
    accounted from the buffer's record of it (`lost_answer`). A second call does nothing."""
    with self._lock:
      if self._stopped:
        return
      self._stopped = True
      for index, server in enumerate(self.servers):
        if server is None:
          continue
        answered = False
        try:
          if server.alive:
            self.last_health[index] = server.stop(timeout)
            answered = True
            keep_spans(self.pending_spans, self.last_health[index])
            warn_unscored(index, self.last_health[index], self.log)
          else:
            self.log(f"rollout server {index} was gone at the stop")
        except (wire.ServiceTimeout, wire.ServiceGone, EOFError, OSError) as error:
          self.log(f"rollout server {index} did not stop cleanly ({error!r}): killed")
        finally:
          server.kill()
        if not answered:
          self._account_lost(index)
      self._spawner.shutdown(wait=True)

  def _account_lost(self, index: int) -> None:
    """Server `index` ended without a last answer: its last heartbeat's answer, completed from
    the buffer's record of its client (`lost_answer`)."""
    try:
      orphan = self.service.revoke(self.client_ids[index], REVOKE_TIMEOUT_S, reissue=False)
    except (TimeoutError, KeyError) as error:
      self.log(f"rollout server {index}: no buffer record to account for it ({error!r})")
      return
    self.last_health[index] = lost_answer(self.last_health[index], orphan)
    lost = sum(len(uids) for reason, uids in self.last_health[index]["drops"]
               if reason == LOST_REASON)
    self.log(f"rollout server {index}: {lost} samples of its unfinished groups dropped as "
             f"'{LOST_REASON}'")


LOST_REASON = "server_lost"


def lost_answer(health: dict, orphan: dict) -> dict:
  """A last answer for a server that gave none: `health` (its last heartbeat's) with the next
  group id the buffer recorded for it (its admissions after that heartbeat included) and the
  missing samples of its unfinished groups dropped under 'server_lost' (those its drops already
  name left out), so that the run's ledger knows every group it started."""
  dropped = {tuple(uid) for _, uids in health.get("drops", []) for uid in uids}
  lost = [(entry["group_id"], index) for entry in orphan["inflight"]
          for index in entry["missing"] if (entry["group_id"], index) not in dropped]
  out = {**health, "drops": list(health.get("drops", [])) + ([(LOST_REASON, lost)] if lost
                                                             else [])}
  if orphan.get("next_group_id") is not None:
    out["next_group_id"] = orphan["next_group_id"]
  return out
