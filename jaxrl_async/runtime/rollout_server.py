"""A rollout server: the Rollouter role with its own engine, reward pool and prompt shard.

`RolloutServer` is process-agnostic: it runs in whatever process builds it (a spawned child
here, a Ray actor elsewhere) and talks to the learner's side only through a `BufferClient` and
a weight channel. `RolloutProcess` starts one in a spawned child on its share of the CPU cores
and is its `RolloutControl` in the learner's process (calls over a Pipe, each with a timeout).

Server k of K draws the prompts of shard k (`runtime/prompts.py`) and numbers its groups
k, k + K, k + 2K, ..., so prompt ids and group ids never collide between servers.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

from jaxrl_async import faults
from jaxrl_async.runtime import child, wire
from jaxrl_async.runtime.interfaces import RolloutControl

# Seconds a control call may wait beyond its own timeout (the child's interpreter, pickling).
CONTROL_MARGIN_S = 10.0


def strip_admission(entries: list[dict]) -> list[dict]:
  """Re-issue entries for a restored buffer: admissions held before the save do not carry."""
  return [{key: value for key, value in entry.items() if key != "admitted"}
          for entry in entries]


def first_start(restore: dict | None, index: int) -> tuple[dict, dict]:
  """(what server `index` starts from, where its shard started) on its first start: a
  checkpoint's snapshot without its admissions, or a fresh start (`restore=None`). The second
  is what a replacement of the server resumes from when its predecessor left no position."""
  restore = dict(restore or {})
  rollout = dict(restore.get("rollout") or {})
  rollout["inflight"] = strip_admission(rollout.get("inflight", []))
  restore["rollout"] = rollout
  return restore, {"prompts": restore.get("prompts"),
                   "next_group_id": rollout.get("next_group_id", index)}


class RolloutServer(RolloutControl):
  """One rollout server in this process; `restore` = {'rollout': ..., 'prompts': ...} from a
  snapshot (a checkpoint: admissions are re-acquired) or from the buffer service after a
  server was lost (`admitted` entries keep theirs)."""

  def __init__(self, config, *, server_index: int, num_servers: int, buffer, channel,
               restore: dict | None = None):
    from jaxrl_async.metrics import RoleTimer
    from jaxrl_async.runtime import assembly
    from jaxrl_async.runtime.server_rollouter import ServerRollouter
    self.config = config
    self.server_index = server_index
    self.side = assembly.build_rollout_side(config, server_index, num_servers)
    restore = restore or {}
    if restore.get("prompts") is not None:
      self.side.prompts.set_state(restore["prompts"])
    rollout = restore.get("rollout") or {}
    self.timer = RoleTimer()
    self.side.rewards.timer = self.timer
    self.channel = channel
    self.rollouter = ServerRollouter(
        batcher=self.side.new_batcher(), prompts=self.side.prompts, rewards=self.side.rewards,
        buffer=buffer, channel=channel, timer=self.timer,
        make_requests=self.side.make_requests, group_size=config.group_size,
        partial_rollout=config.partial_rollout, partial_strategy=config.partial_strategy,
        next_group_id=rollout.get("next_group_id", server_index),
        reissue=rollout.get("inflight", []), group_id_stride=num_servers)
    self._evaluator = None
    self._spans_sent = 0  # of the timer's closed spans, how many health() has handed out
    self._drops: list = []  # every drop of this server, as (reason, sample uids)
    self._health_lock = threading.Lock()  # health answers may be asked for concurrently

  def start(self, timeout: float = 10.0) -> None:
    del timeout
    self.rollouter.start()

  def pause(self, timeout: float = 60.0) -> None:
    self.rollouter.pause(timeout)

  def resume(self, timeout: float = 10.0) -> None:
    del timeout
    self.rollouter.resume()

  def snapshot(self, timeout: float = 10.0) -> dict[str, Any]:
    del timeout
    return {"rollout": self.rollouter.snapshot(), "prompts": self.side.prompts.get_state()}

  def evaluate(self, timeout: float = 600.0) -> dict[str, float]:
    del timeout
    from jaxrl_async.rollout.evaluate import evaluate
    if self._evaluator is None:
      self._evaluator = self.side.new_batcher()
    version, params = self.channel.fetch()
    self._evaluator.set_params(params, version)
    return evaluate(self._evaluator, self.side.task, self.side.eval_problems,
                    seed=self.config.seed)

  def health(self, timeout: float = 10.0) -> dict[str, Any]:
    del timeout
    role = self.rollouter
    with self._health_lock:  # a late answer never misses drops an earlier one took
      self._spans_sent, spans = self.timer.spans_since(self._spans_sent)
      self._drops.extend(role.take_drop_log())
      drops = list(self._drops)
    return {"alive": role.alive, "error": None if role.error is None else repr(role.error),
            "version": role.batcher.version, "counts": dict(role.counts),
            "next_group_id": role.next_group_id, "drops": drops,
            "rewarding": role.rewarding,
            "timer": self.timer.summary(), "pid": os.getpid(),
            "host": socket.gethostname(), "spans": spans,
            "hanging": sorted(faults.hanging)}  # fault points a thread here is blocked at

  def stop(self, timeout: float = 30.0) -> dict[str, Any]:
    """Stops the role and waits for the batches still being scored: each one ends in the buffer
    or as a 'shutdown' drop before the answer (this server's last health) is made, so the
    drops it lists are complete. Samples still scored after `timeout` are named in the answer
    (`rewarding`) and the run's ledger audit reports them missing."""
    self.rollouter.stop()
    try:
      self.rollouter.join(timeout)
      self.rollouter.wait_rewards(timeout)
    finally:
      self.side.rewards.close()
    return self.health()


# ---- in a child process ---------------------------------------------------------------------
def serve(spec: dict, conn) -> None:
  """The child's main: builds the server, then answers control calls until told to stop or the
  learner's process hangs up."""
  from jaxrl_async.controller import short_gil_switch
  from jaxrl_async.runtime import assembly
  buffer = spec["buffer"]
  channel = assembly.open_rollout_channel(spec["channel"], spec["config"])
  server = RolloutServer(spec["config"], server_index=spec["server_index"],
                         num_servers=spec["num_servers"], buffer=buffer, channel=channel,
                         restore=spec.get("restore"))
  stop = threading.Event()

  def handler(method, args, kwargs):
    if method not in ("start", "pause", "resume", "snapshot", "evaluate", "health", "stop"):
      raise AttributeError(f"a rollout server has no call {method!r}")
    result = getattr(server, method)(*args, **kwargs)
    if method == "stop":
      stop.set()
    return result

  conn.send(("ok", "ready"))
  try:
    with short_gil_switch():  # the loop, the reward callbacks and this thread share the GIL
      wire.serve_connection(conn, handler, stop)
  finally:
    if server.rollouter.alive:
      server.stop(30.0)
    buffer.disconnect()
    channel.close()


class RolloutProcess(RolloutControl):
  """A `RolloutServer` in a spawned child process, seen from the learner's process."""

  def __init__(self, spec: dict, *, cores: list[int] | None, name: str,
               start_timeout: float = 300.0):
    import multiprocessing as mp
    self.name = name
    self.cores = cores
    parent, child_end = mp.get_context("spawn").Pipe()
    self._conn = parent
    self._lock = threading.Lock()  # one call in flight on the pipe
    self._final: dict[str, Any] | None = None  # what stop() answered
    self.process = child.spawn("jaxrl_async.runtime.rollout_server:serve", (spec, child_end),
                               name=name, cores=cores, env=child.child_env(cores or []))
    child_end.close()
    try:
      if not parent.poll(start_timeout):
        raise TimeoutError(f"rollout server {name} did not start within {start_timeout} s")
      status, value = parent.recv()
    except (EOFError, OSError, TimeoutError) as error:
      child.kill(self.process)
      raise RuntimeError(f"rollout server {name} failed to start (exit code "
                         f"{self.process.exitcode})") from error
    if status != "ok":
      child.kill(self.process)
      raise RuntimeError(f"rollout server {name} failed to start") from value

  @property
  def alive(self) -> bool:
    return self.process.is_alive()

  @property
  def pid(self) -> int | None:
    return self.process.pid

  def _call(self, method: str, timeout: float):
    with self._lock:
      return wire.call(self._conn, method, (timeout,), {}, timeout + CONTROL_MARGIN_S)

  def start(self, timeout: float = 10.0) -> None:
    self._call("start", timeout)

  def pause(self, timeout: float = 60.0) -> None:
    self._call("pause", timeout)

  def resume(self, timeout: float = 10.0) -> None:
    self._call("resume", timeout)

  def snapshot(self, timeout: float = 10.0) -> dict[str, Any]:
    return self._call("snapshot", timeout)

  def evaluate(self, timeout: float = 600.0) -> dict[str, float]:
    return self._call("evaluate", timeout)

  def health(self, timeout: float = 10.0) -> dict[str, Any]:
    """Raises wire.ServiceTimeout when the server does not answer within timeout (+ margin 0:
    a heartbeat's timeout is the whole budget)."""
    with self._lock:
      return wire.call(self._conn, "health", (timeout,), {}, timeout)

  def stop(self, timeout: float = 30.0) -> dict[str, Any]:
    """Stops the server (a second call returns the first one's answer) and reaps it."""
    if self._final is not None:
      return self._final
    try:
      self._final = self._call("stop", timeout)
      return self._final
    finally:
      self.close()

  def kill(self) -> None:
    """SIGKILL (works on a stopped process too) and reap."""
    child.kill(self.process)
    self._conn.close()

  def close(self, timeout: float = 10.0) -> None:
    self.process.join(timeout)
    child.reap(self.process)
    self._conn.close()
