"""What the run loop asks of a backend: `Backend` connects the roles for a run, `Fleet` is the
rollout servers as the controller drives them.

A backend decides where the rollout servers run (threads of this process, child processes,
Ray actors) and how they reach the learner's side (the buffer, the weight channel). The loop
(`run/loop.py`) knows backends only through these classes; a new backend is one module with a
`Backend` subclass, named in `backends/__init__.py`'s registry, that passes the contract suite
(tests/backends/test_backend_contract.py).
"""

from __future__ import annotations

import abc
import dataclasses
import os
import socket
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from jaxrl_async.backends.fleet_shape import close, group_ids
from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.config import RunConfig
from jaxrl_async.sync.channel import WeightChannel

MAX_PENDING_SPANS = 50_000  # server busy spans held for the learner's timer between takes


class RoleFailed(RuntimeError):
  """A role raised, or could not be kept running; the message names the role, the cause is
  chained."""


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


def produced_groups(next_group_ids: list[int], starts: list[int] | None = None,
                    closed: list | None = None) -> list[int]:
  """The group ids K servers drew, from each one's next group id (server k: s_k, s_k + K, ...,
  s_k = `starts[k]`, default k) and the segments of fleet shapes that ended
  (`fleet_shape.group_ids`)."""
  starts = list(range(len(next_group_ids))) if starts is None else starts
  return group_ids(close(closed or [], starts, next_group_ids))


class Fleet(abc.ABC):
  """The rollout servers of a run, seen from the controller. Every call has a bound.

  Subclasses keep `last_health` (each server's last health answer, `RolloutServer.health`),
  `final_counts` (counts of servers that ended) and `pending_spans` up to date; the figures
  below are computed from them the same way on every backend.
  """

  heartbeat_s: float = 1.0  # how often the loop calls `check`

  def __init__(self, num_servers: int, *, log=print):
    self.num_servers = num_servers
    self.log = log
    self.last_health: list[dict] = [{}] * num_servers
    self.final_counts: list[dict] = []
    self.final_sync: list[dict] = []  # weight-store load counts of servers that ended
    self.pending_spans: list = []
    # Group ids (fleet_shape): where each server started in this fleet shape (stride
    # num_servers), and the [first, stride, end] segments of shapes that ended; the loop sets
    # both before `start`, an elastic fleet changes them when it changes size.
    self.group_starts: list[int] = list(range(num_servers))
    self.closed_segments: list = []
    # What servers that left the fleet at a change of its shape gave in their last answers:
    # their drops and their reward pools' counts (`keep_leaving`).
    self.left_drops: list = []
    self.left_rewards: dict[str, int] = {}
    self._lock = threading.RLock()

  # ---- driven by the loop -------------------------------------------------------------------
  @abc.abstractmethod
  def start(self, restores: list[dict | None]) -> None:
    """Starts every server (restores[k]: a checkpoint's snapshot of server k, or None)."""

  @abc.abstractmethod
  def check(self) -> None:
    """One heartbeat: replaces a lost server where the backend can, raises `RoleFailed` for a
    server whose role failed."""

  @abc.abstractmethod
  def pause(self, timeout: float | None = None) -> None:
    """Every server stopped at a step boundary with nothing between roles."""

  @abc.abstractmethod
  def resume(self, timeout: float = 30.0) -> None:
    """Continues after `pause`."""

  @abc.abstractmethod
  def snapshots(self, timeout: float = 30.0) -> list[dict]:
    """While paused: every server's `{'rollout': ..., 'prompts': ...}`."""

  @abc.abstractmethod
  def stop(self, timeout: float = 60.0) -> None:
    """Stops every server; their last health answers hold their final counts and drops."""

  @property
  @abc.abstractmethod
  def restarts(self) -> int:
    """Servers replaced during the run."""

  @property
  @abc.abstractmethod
  def counts(self) -> dict[str, int]:
    """`runtime/reissued_groups/<reason>` and `runtime/reissued_samples/<reason>`."""

  # ---- the same on every backend ------------------------------------------------------------
  def rollout_counts(self) -> dict[str, float]:
    """The servers' counts summed (ended servers' last known counts included)."""
    totals: dict[str, float] = {}
    for counts in self.final_counts + [h.get("counts", {}) for h in self.last_health]:
      for key, value in counts.items():
        totals[f"rollout/{key}"] = totals.get(f"rollout/{key}", 0) + value
    return totals

  def retire(self, index: int) -> None:
    """Keeps the counts of server `index`, about to be replaced, in the run's totals."""
    self.final_counts.append(self.last_health[index].get("counts", {}))
    self.final_sync.append((self.last_health[index].get("sync") or {}).get("counts", {}))

  def sync_figures(self) -> dict[str, float]:
    """The weight store's loads on the rollout side (`sync/<count>` summed over servers, ended
    ones included) and each server's mean publish -> loaded latency
    (`sync/load_latency_s/server<k>`); empty with other channels."""
    states = [h.get("sync") for h in self.last_health]
    out: dict[str, float] = {}
    for counts in self.final_sync + [state["counts"] for state in states if state]:
      for key, value in counts.items():
        out[f"sync/{key}"] = out.get(f"sync/{key}", 0) + value
    for index, state in enumerate(states):
      if state and state.get("load_latency_s_mean") is not None:
        out[f"sync/load_latency_s/server{index}"] = state["load_latency_s_mean"]
    return out

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

  def keep_leaving(self, health: dict) -> None:
    """Keeps the drops and reward counts of a server's last answer (`health`) as it leaves the
    fleet at a change of shape: its work is re-dealt, but what it dropped and scored stays in
    the run's totals."""
    self.left_drops.extend(tuple(entry) for entry in health.get("drops", []))
    for name, count in health.get("reward_counts", {}).items():
      self.left_rewards[name] = self.left_rewards.get(name, 0) + int(count)

  def reward_counts(self) -> dict[str, int]:
    """`reward/<outcome>` and `reward/retries` of the servers' reward pools, summed (those of
    servers that left at a change of shape included)."""
    totals = {f"reward/{name}": count for name, count in self.left_rewards.items()}
    for health in self.last_health:
      for name, count in health.get("reward_counts", {}).items():
        totals[f"reward/{name}"] = totals.get(f"reward/{name}", 0) + int(count)
    return totals

  def drop_log(self) -> list:
    """After `stop`: every server's drops, as (reason, sample uids) for the sample ledger. A
    replaced server's work was re-issued to its successor, so only the last servers' count,
    and those of servers that left at a change of shape."""
    return self.left_drops + [tuple(entry) for health in self.last_health
                              for entry in health.get("drops", [])]

  def next_group_ids(self) -> list[int]:
    """After `stop`: each server's next group id, from its last health answer."""
    return [h.get("next_group_id", self.group_starts[index])
            for index, h in enumerate(self.last_health)]

  def produced_groups(self) -> list[int]:
    """After `stop`: the group ids the servers drew, over every life of the run."""
    return produced_groups(self.next_group_ids(), self.group_starts, self.closed_segments)

  def take_spans(self) -> list:
    """The servers' busy spans received since the last call ((role, start, end), this host's
    monotonic clock), for the learner's timer (`RoleTimer.add_spans`)."""
    with self._lock:
      spans, self.pending_spans = self.pending_spans, []
    return spans

  def placement(self) -> dict[str, Any]:
    """Where the servers ran, for the summary (backend-specific figures)."""
    return {}

  def describe(self) -> str:
    """The servers' state for the watchdog's report, naming a fault point a server hangs at."""
    servers = [{"pid": h.get("pid"), "version": h.get("version"), "counts": h.get("counts")}
               for h in self.last_health]
    hung = "".join(f"; rollout server {index} blocked at fault point {', '.join(h['hanging'])}"
                   for index, h in enumerate(self.last_health) if h.get("hanging"))
    return f"rollout servers {servers}{hung}"


def load_overdue(health: dict, deadline_s: float | None) -> bool:
  """Whether a server has been loading one weight version for longer than `deadline_s`."""
  loading = (health.get("sync") or {}).get("loading_s")
  return deadline_s is not None and loading is not None and loading > deadline_s


class ControllerBuffer(abc.ABC):
  """The versioned buffer as the controller and the learner use it (a `VersionedBuffer` of this
  process has every method; remote buffers forward them)."""

  @abc.abstractmethod
  def get_groups(self, num_groups: int, learner_version: int, timeout: float) -> list: ...

  @abc.abstractmethod
  def get_state(self) -> dict: ...

  @abc.abstractmethod
  def set_state(self, state: dict) -> None: ...

  @abc.abstractmethod
  def metrics(self) -> dict[str, float]: ...

  @abc.abstractmethod
  def close(self) -> None: ...

  @abc.abstractmethod
  def take_drop_log(self) -> list: ...

  @abc.abstractmethod
  def discard_queued(self, reason: str = "shutdown") -> int: ...

  @abc.abstractmethod
  def check_invariants(self) -> None: ...

  @abc.abstractmethod
  def set_staleness_threshold(self, staleness_threshold: float,
                              from_version: int) -> dict:
    """Admission budget floor((1 + s) N) for the windows opened at rollout versions >=
    `from_version` (adaptive staleness; `buffer.staleness_budget.StalenessBudget`)."""


ControllerBuffer.register(VersionedBuffer)  # the buffer of this process has every method


@dataclasses.dataclass(frozen=True)
class Connection:
  """A backend's roles connected for one run: the learner's view of the buffer, the learner's
  end of the weight channel, the fleet, and the groups the servers started (for
  prompt_ledger.json; None where the backend does not track them)."""

  buffer: ControllerBuffer
  channel: WeightChannel
  fleet: Fleet
  started_groups: Callable[[], dict[str, Any]] | None = None


class Backend(abc.ABC):
  """Where the rollout servers run and how they reach the learner's side."""

  name: str = ""

  def check_config(self, config: RunConfig) -> None:  # noqa: B027 (optional to override)
    """Refuses settings this backend cannot honour (ValueError naming the setting)."""

  @abc.abstractmethod
  def connect(self, parts, run_dir: str | os.PathLike,
              log=print) -> AbstractContextManager[Connection]:
    """Creates the buffer, the weight channel and the fleet for `parts` (run.build.Parts);
    everything is stopped and released when the context exits, however it exits."""
