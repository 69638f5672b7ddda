"""The `threads` backend (the embedded default): one rollout server in the controller's process,
its Rollouter a thread beside the learner's, over the buffer of this process
(`LocalBufferClient`) and a device-transfer (or weight store) weight channel.

The server generates with the controller's rollout side (`Parts.rollout`: its engine on the
placement's rollout mesh, its reward pool and prompts), so `rollout_mesh` placement applies.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from jaxrl_async.backends.base import (
  Backend,
  Connection,
  Fleet,
  RoleFailed,
  keep_spans,
  warn_unscored,
)
from jaxrl_async.backends.rollout_server import RolloutServer, first_start
from jaxrl_async.buffer.client import LocalBufferClient
from jaxrl_async.config import RunConfig
from jaxrl_async.run.build import Parts, RolloutSide, buffer_for
from jaxrl_async.sync import TensorStoreChannel, store_options
from jaxrl_async.sync.channel import DeviceTransferChannel

PAUSE_TIMEOUT_S = 60.0


class LocalFleet(Fleet):
  """One `RolloutServer` in this process. Its thread cannot be replaced: a failure of its role
  stops the run with that error."""

  heartbeat_s = 0.1

  def __init__(self, config: RunConfig, buffer, channel, side: RolloutSide, *, log=print):
    super().__init__(1, log=log)
    self.config = config
    self.buffer = LocalBufferClient(buffer)
    self.channel = channel
    self.side = side
    self.server: RolloutServer | None = None
    self._stopped = False

  @property
  def restarts(self) -> int:
    return 0

  @property
  def counts(self) -> dict[str, int]:
    return {}

  def start(self, restores: list[dict | None]) -> None:
    restore, _ = first_start(restores[0], 0)
    self.server = RolloutServer(self.config, server_index=0, num_servers=1, buffer=self.buffer,
                                channel=self.channel, restore=restore, side=self.side)
    self.server.start()

  def _health(self) -> None:
    with self._lock:
      self.last_health[0] = self.server.health()
      keep_spans(self.pending_spans, self.last_health[0])

  def check(self) -> None:
    self._health()
    error = self.server.rollouter.error
    if error is not None:
      raise RoleFailed(f"the rollouter role failed: {error!r}") from error

  def pause(self, timeout: float | None = None) -> None:
    self.server.pause(PAUSE_TIMEOUT_S if timeout is None else timeout)

  def resume(self, timeout: float = 30.0) -> None:
    self.server.resume(timeout)

  def snapshots(self, timeout: float = 30.0) -> list[dict]:
    return [self.server.snapshot(timeout)]

  def stop(self, timeout: float = 60.0) -> None:
    """Stops the server once (a second call does nothing)."""
    if self.server is None or self._stopped:
      return
    self._stopped = True
    with self._lock:
      self.last_health[0] = self.server.stop(timeout)
      keep_spans(self.pending_spans, self.last_health[0])
    warn_unscored(0, self.last_health[0], self.log)


def make_channel(parts: Parts, run_dir):
  """The learner's weight channel: a device transfer onto the rollout mesh, or the weight store
  (`sync_backend='store'`, sync/store_channel.py)."""
  learner = parts.learner
  if parts.config.sync_backend == "store":
    # The store is transport, not a checkpoint: versions left by an earlier (resumed) run
    # would be newer than the restored learner, so they are cleared.
    shutil.rmtree(os.path.join(run_dir, "weights"), ignore_errors=True)
    return TensorStoreChannel(os.path.join(run_dir, "weights"), learner.spec.abstract_params,
                              learner.spec.logical_axes, parts.rollout_mesh,
                              **store_options(parts.config))
  return DeviceTransferChannel(learner.spec.logical_axes, parts.rollout_mesh)


class ThreadsBackend(Backend):
  name = "threads"

  @contextmanager
  def connect(self, parts: Parts, run_dir, log=print) -> Iterator[Connection]:
    buffer = buffer_for(parts.config)
    channel = make_channel(parts, run_dir)
    fleet = LocalFleet(parts.config, buffer, channel, parts.rollout, log=log)
    try:
      yield Connection(buffer=buffer, channel=channel, fleet=fleet)
    finally:
      try:
        fleet.stop()
      finally:
        buffer.close()
        channel.close()
