"""The rollout servers of a `processes` run, seen from the learner's process.

`Fleet` starts K `RolloutProcess`es, each on its share of the cores, and keeps them answering:
`check()` (a heartbeat, from the controller's thread) replaces a server whose process died or
that did not answer `health` within `heartbeat_timeout_s` (a stopped process: SIGSTOP). A
replaced server is killed with SIGKILL, its buffer client revoked, and a new one continues its
prompt shard and re-issues its unfinished groups, each exactly once: they are counted under
`runtime/reissued_groups/<reason>` and `runtime/reissued_samples/<reason>` (reasons
'server_died', 'server_unresponsive'). A server that reports an error of its own role stops the
run with that error: restarting it would only repeat it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading
from typing import Any

from jaxrl_async.runtime import wire
from jaxrl_async.runtime.buffer_service import BufferService, RemoteBufferClient
from jaxrl_async.runtime.rollout_server import RolloutProcess, first_start

REISSUE_REASONS = ("server_died", "server_unresponsive")
REVOKE_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 600.0


MAX_PENDING_SPANS = 50_000  # server busy spans held for the learner's timer between takes


class RolloutServerFailed(RuntimeError):
  """A rollout server's role raised, or servers kept dying past `max_restarts`."""


def keep_spans(pending: list, health: dict) -> None:
  """The busy spans of a server's health answer, held for the learner's timer. Only a server
  on this host: its spans are times of this host's monotonic clock (another host's clock is
  not comparable, and its spans are left out of the timeline; its busy totals still count)."""
  if health.get("host") == socket.gethostname() and health.get("spans"):
    pending.extend(health["spans"])
    del pending[:-MAX_PENDING_SPANS]


def warn_unscored(index: int, health: dict, log) -> None:
  """A stopped server's answer still counting samples in its reward pool: they reach neither
  the buffer nor its drops, and the run's ledger audit will report them missing."""
  if health.get("rewarding"):
    log(f"warning: rollout server {index} stopped with {health['rewarding']} samples still "
        "being scored (a reward call slower than the stop's timeout)")


def produced_groups(next_group_ids: list[int]) -> list[int]:
  """The group ids K servers drew, from each one's next group id (server k: k, k + K, ...)."""
  stride = len(next_group_ids)
  return [g for k, next_id in enumerate(next_group_ids) for g in range(k, next_id, stride)]


class Fleet:

  def __init__(self, config, service: BufferService, channel_spec: dict, *,
               cores: list[list[int]], heartbeat_timeout_s: float, max_restarts: int = 8,
               status_path: str | None = None, log=print):
    self.config = config
    self.service = service
    self.channel_spec = channel_spec
    self.cores = cores
    self.heartbeat_timeout_s = heartbeat_timeout_s
    self.max_restarts = max_restarts
    self.log = log
    self.status_path = status_path  # JSON: each server's pid, cores and client id
    self.num_servers = len(cores)
    self.servers: list[RolloutProcess | None] = [None] * self.num_servers
    self.client_ids: list[str] = [""] * self.num_servers
    self._generation = [0] * self.num_servers
    self._initial: list[dict] = [{}] * self.num_servers  # where each shard started
    self._lock = threading.RLock()
    self._paused = False
    self.restarts = 0
    self.counts: dict[str, int] = {}
    for reason in REISSUE_REASONS:
      self.counts[f"runtime/reissued_groups/{reason}"] = 0
      self.counts[f"runtime/reissued_samples/{reason}"] = 0
    self.final_counts: list[dict] = []  # counts of servers that ended (stopped or replaced)
    self.last_health: list[dict] = [{}] * self.num_servers
    self.pending_spans: list = []  # servers' busy spans not yet taken (take_spans)
    # Children die with the thread that spawned them (child.py): one thread spawns them all and
    # lives until `stop`, whichever thread asks for a replacement.
    self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-spawner")

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
      json.dump({"servers": status, "restarts": self.restarts}, f)
    os.replace(self.status_path + ".tmp", self.status_path)

  def replace(self, index: int, reason: str) -> None:
    """Kills server `index` and starts its successor with the dead one's unfinished work."""
    with self._lock:
      if self.restarts >= self.max_restarts:
        raise RolloutServerFailed(f"rollout servers were replaced {self.restarts} times "
                                  f"(max_restarts={self.max_restarts}); last: server {index}, "
                                  f"{reason}")
      self.restarts += 1
      server = self.servers[index]
      server.kill()
      self.final_counts.append(self.last_health[index].get("counts", {}))
      orphan = self.service.revoke(self.client_ids[index], REVOKE_TIMEOUT_S)
      inflight = orphan["inflight"]
      self.counts[f"runtime/reissued_groups/{reason}"] += len(inflight)
      self.counts[f"runtime/reissued_samples/{reason}"] += sum(len(e["missing"])
                                                              for e in inflight)
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
    """One heartbeat over every server; replaces the dead and the silent."""
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

  def pause(self, timeout: float | None = None) -> None:
    """Pauses every server; one that does not pause within `timeout` (default: 3 heartbeat
    timeouts, at least 30 s) is replaced as unresponsive."""
    timeout = max(3 * self.heartbeat_timeout_s, 30.0) if timeout is None else timeout
    with self._lock:
      self._each("pause", timeout)
      self._paused = True

  def resume(self, timeout: float = 30.0) -> None:
    with self._lock:
      self._paused = False
      self._each("resume", timeout)

  def snapshots(self, timeout: float = 30.0) -> list[dict]:
    """While paused: every server's snapshot (groups in flight, next group id, prompts)."""
    return self._each("snapshot", timeout)

  def rollout_counts(self) -> dict[str, float]:
    """The servers' counts summed (ended servers' last known counts included)."""
    totals: dict[str, float] = {}
    for counts in self.final_counts + [h.get("counts", {}) for h in self.last_health]:
      for key, value in counts.items():
        totals[f"rollout/{key}"] = totals.get(f"rollout/{key}", 0) + value
    return totals

  def server_timers(self) -> dict[str, float]:
    """rollout/ and reward/ busy_s (summed) and idle_ratio (the servers' mean), from each
    server's own role timer at its last heartbeat."""
    timers = [h["timer"] for h in self.last_health if h.get("timer")]
    out = {}
    for role in ("rollout", "reward"):
      if timers:
        out[f"{role}/busy_s"] = sum(t[f"{role}/busy_s"] for t in timers)
        out[f"{role}/idle_ratio"] = sum(t[f"{role}/idle_ratio"] for t in timers) / len(timers)
    return out

  def drop_log(self) -> list:
    """After `stop`: every server's drops, as (reason, sample uids) for the sample ledger. A
    replaced server's work was re-issued to its successor, so only the last servers' count."""
    return [tuple(entry) for health in self.last_health for entry in health.get("drops", [])]

  def next_group_ids(self) -> list[int]:
    """After `stop`: each server's next group id, from its last health answer."""
    return [h.get("next_group_id", index) for index, h in enumerate(self.last_health)]

  def produced_groups(self) -> list[int]:
    """After `stop`: the group ids the servers drew, over every life of the run (server k of
    K numbers its groups k, k + K, ... up to its next group id)."""
    return produced_groups(self.next_group_ids())

  def take_spans(self) -> list:
    """The servers' busy spans received since the last call ((role, start, end), this host's
    monotonic clock), for the learner's timer (`RoleTimer.add_spans`)."""
    with self._lock:
      spans, self.pending_spans = self.pending_spans, []
    return spans

  def stop(self, timeout: float = 60.0) -> None:
    """Stops every server (each counts what it aborts as 'shutdown') and reaps them all."""
    with self._lock:
      for index, server in enumerate(self.servers):
        if server is None:
          continue
        try:
          if server.alive:
            self.last_health[index] = server.stop(timeout)
            keep_spans(self.pending_spans, self.last_health[index])
            warn_unscored(index, self.last_health[index], self.log)
        except (wire.ServiceTimeout, wire.ServiceGone, EOFError, OSError) as error:
          self.log(f"rollout server {index} did not stop cleanly ({error!r}): killed")
        finally:
          server.kill()
      self._spawner.shutdown(wait=True)
