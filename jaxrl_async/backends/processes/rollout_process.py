"""A rollout server in a spawned child process: `serve` is the child's main, `RolloutProcess`
its `RolloutControl` in the learner's process (calls over a Pipe, each with a timeout)."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

from jaxrl_async.backends.processes import child, wire
from jaxrl_async.backends.rollout_server import RolloutControl, RolloutServer
from jaxrl_async.roles import short_gil_switch
from jaxrl_async.run.build import model_spec
from jaxrl_async.sync import TensorStoreChannel, store_options
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel

# Seconds a control call may wait beyond its own timeout (the child's interpreter, pickling).
CONTROL_MARGIN_S = 10.0
# The weight channel between processes, by `RunConfig.sync_backend`: 'device' (the fast path of
# one host) becomes shared memory, 'store' stays the weight store on a shared directory.
PROCESS_CHANNELS = {"device": "shm", "store": "store"}


def open_rollout_channel(spec: dict, config):
  """The rollout end of the channel the learner's process created (`spec` from it)."""
  model = model_spec(config)
  if spec["kind"] == "shm":
    return SharedMemoryWeightChannel.attach(spec["location"], model.abstract_params)
  return TensorStoreChannel(spec["location"], model.abstract_params, model.logical_axes,
                            **store_options(config))


def serve(spec: dict, conn) -> None:
  """The child's main: builds the server, then answers control calls until told to stop or the
  learner's process hangs up."""
  buffer = spec["buffer"]
  channel = open_rollout_channel(spec["channel"], spec["config"])
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
    self.name = name
    self.cores = cores
    parent, child_end = mp.get_context("spawn").Pipe()
    self._conn = parent
    self._lock = threading.Lock()  # one call in flight on the pipe
    self._final: dict[str, Any] | None = None  # what stop() answered
    self.process = child.spawn("jaxrl_async.backends.processes.rollout_process:serve", (spec, child_end),
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
