"""The narrow interfaces between roles, as small ABCs with plain arguments and explicit timeouts.

- `BufferClient`: what the rollout side and the learner side ask of the versioned buffer.
  `LocalBufferClient` wraps a `VersionedBuffer` of this process; `buffer_service.
  RemoteBufferClient` reaches one served by another process. Both pass
  tests/backends/test_buffer_contract.py.
- `RolloutControl`: what the controller asks of a rollout server (start, pause and resume around
  checkpoints, snapshot, evaluate, health, stop). `rollout_server.RolloutServer` is the
  in-process implementation; `rollout_server.RolloutProcess` drives one in a child process.

Weight channels keep the interface of `sync.channel.WeightChannel` (publish / fetch /
wait_for_version / latest_version); `shm_channel.SharedMemoryWeightChannel` is the cross-process
one for a single host.
"""

from __future__ import annotations

import abc
from typing import Any

from jaxrl_async.buffer import BufferClosed, BufferTimeout, VersionedBuffer
from jaxrl_async.buffer.errors import is_finite_real, is_int
from jaxrl_async.types import Sample

# The shortest wait the local buffer accepts (its timeouts must be > 0): a non-blocking try.
_NO_WAIT_S = 1e-9


def check_acquire_args(max_count: int, timeout: float) -> None:
  if not is_int(max_count) or max_count < 1:
    raise ValueError(f"acquire_group_slots: max_count={max_count!r} must be an int >= 1")
  if not (is_finite_real(timeout) and timeout >= 0):
    raise ValueError(f"acquire_group_slots: timeout={timeout!r} must be a finite number of "
                     "seconds >= 0 (0 = do not wait)")


class BufferClient(abc.ABC):
  """The versioned buffer as seen by one role (see buffer/versioned_buffer.py for semantics)."""

  @abc.abstractmethod
  def put_many(self, samples: list[Sample], timeout: float) -> None:
    """Adds the samples in order; blocks while the buffer is full, at most `timeout` seconds
    for the whole batch (BufferTimeout). Raises BufferClosed once the buffer is closed."""

  @abc.abstractmethod
  def acquire_group_slots(self, max_count: int, timeout: float, *,
                          starts: list[dict] | None = None,
                          holding_version: int | None = None) -> int:
    """Admits up to `max_count` groups; returns how many (0 when none within `timeout`).

    Blocks on the buffer's admission (no polling) for the first slot at most `timeout`
    seconds (0: do not wait), then takes what is free without waiting. `starts`, when given,
    describes the groups in the order they would start (`{'problem', 'group_id', 'missing',
    'prompt_state', 'next_group_id'}`): a remote buffer records the admitted ones in the same
    call, so a rollout server that dies holds no admission nobody knows about.
    `holding_version` is the weights version the caller generates with: a version newer than
    the one it last published is published first (as `publish_version`), in the same call, so
    a rollout server's first ask after a weight swap is one round trip, not two. (A remote
    buffer opens a window only once every server holds its version.)
    """

  @abc.abstractmethod
  def publish_version(self, version: int) -> None:
    """The caller's rollout side now holds weights `version`."""

  @abc.abstractmethod
  def get_groups(self, num_groups: int, learner_version: int,
                 timeout: float) -> list[list[Sample]]:
    """`num_groups` whole groups, oldest first; BufferTimeout when not ready within timeout."""

  @abc.abstractmethod
  def close(self) -> None:
    """Closes the buffer: every blocked and later blocking call raises BufferClosed."""

  @abc.abstractmethod
  def get_state(self) -> dict[str, Any]:
    """The buffer's checkpoint state (plain JSON data)."""

  @abc.abstractmethod
  def set_state(self, state: dict[str, Any]) -> None:
    """Continues from `get_state`'s data, on a fresh buffer."""

  @abc.abstractmethod
  def metrics(self) -> dict[str, float]:
    """The queue/ metrics."""

  @abc.abstractmethod
  def counts(self) -> dict[str, Any]:
    """put / consumed / queued / dropped-by-reason samples and the group counts."""

  def disconnect(self) -> None:
    """Releases this client's resources (connections); the buffer itself stays open."""
    return None


class LocalBufferClient(BufferClient):
  """The `VersionedBuffer` of this process behind `BufferClient` (no copy of its logic)."""

  def __init__(self, buffer: VersionedBuffer):
    self.buffer = buffer

  def put_many(self, samples, timeout):
    self.buffer.put_many(samples, timeout, one_deadline=True)

  def acquire_group_slots(self, max_count, timeout, *, starts=None, holding_version=None):
    # In one process the roles share their fate: of `starts` only the group ids are kept (the
    # buffer follows each admitted group by its id).
    check_acquire_args(max_count, timeout)
    if self.buffer.closed:
      raise BufferClosed("acquire_group_slots: the buffer is closed")
    if holding_version is not None and holding_version > self.buffer.rollout_version:
      self.buffer.publish_version(holding_version)
    ids = [int(entry["group_id"]) for entry in starts or ()]

    def group_id(index: int) -> int | None:
      return ids[index] if index < len(ids) else None

    acquired = 0
    if timeout > 0:
      try:
        self.buffer.acquire_group_slot(timeout, group_id(0))
      except BufferTimeout:
        return 0
      acquired = 1
    while acquired < max_count and self.buffer.available_slots > 0:
      try:
        self.buffer.acquire_group_slot(_NO_WAIT_S, group_id(acquired))
      except BufferTimeout:  # another producer took it meanwhile
        break
      acquired += 1
    return acquired

  def publish_version(self, version):
    self.buffer.publish_version(version)

  def get_groups(self, num_groups, learner_version, timeout):
    return self.buffer.get_groups(num_groups, learner_version, timeout)

  def close(self):
    self.buffer.close()

  def get_state(self):
    return self.buffer.get_state()

  def set_state(self, state):
    self.buffer.set_state(state)

  def metrics(self):
    return self.buffer.metrics()

  def counts(self):
    return self.buffer.counts


def as_buffer_client(buffer) -> BufferClient:
  """A `BufferClient` for `buffer` (a VersionedBuffer is wrapped, a client passes through)."""
  if isinstance(buffer, BufferClient):
    return buffer
  if isinstance(buffer, VersionedBuffer):
    return LocalBufferClient(buffer)
  raise TypeError(f"buffer must be a BufferClient or a VersionedBuffer, got "
                  f"{type(buffer).__name__}")
