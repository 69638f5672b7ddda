"""The 'ray' backend's buffer: the run's `VersionedBuffer` in a Ray actor, and its client.

The actor body (`BufferActorImpl`) keeps the buffer service's per-client bookkeeping (groups in
flight per rollout server, `revoke` for a dead one) and adds what Ray restarts need: a new
incarnation of a rollout actor `claim`s its predecessor's unfinished groups and prompt shard,
and the re-issues are counted by reason. `RayBufferClient` is the `BufferClient` that reaches
it with one Ray call per batch, from any process of the cluster.
"""

from __future__ import annotations

import time
from typing import Any

from jaxrl_async.backends.base import ControllerBuffer
from jaxrl_async.backends.processes.buffer_service import ForwardingBufferClient
from jaxrl_async.backends.ray.claims import ClaimBook
from jaxrl_async.backends.ray.placement import (
  ACTOR_CONCURRENCY,
  RPC_MARGIN_S,
  require_ray,
  role_options,
)

ACQUIRE_BACKOFF_S = 0.01  # after no admission, zero-wait asks wait this long for a new call


class BufferActorImpl(ClaimBook):
  """The run's buffer behind the buffer service's per-client bookkeeping and the restarts'
  `ClaimBook`, as a Ray actor body (`buffer_actor_class` makes the actor class)."""

  def __init__(self, buffer_kwargs: dict[str, Any]):
    from jaxrl_async.backends.processes.buffer_service import BufferService
    from jaxrl_async.buffer import VersionedBuffer

    service = BufferService(VersionedBuffer(**buffer_kwargs, record_drops=True))
    super().__init__(service, int(buffer_kwargs["group_size"]))

  def ledger(self) -> dict[str, Any]:
    """Every group a server started (group id -> prompt id) and the ones re-issued."""
    return self.service.started_groups()

  def discard_queued(self, reason: str) -> int:
    return self.service.buffer.discard_queued(reason)

  def take_drop_log(self) -> list:
    """The buffer's per-sample drops since the last call, for the driver's sample ledger."""
    return self.service.buffer.take_drop_log()

  def call(self, client_id: str, method: str, args: tuple, kwargs: dict):
    """One client call, as the service runs it for a connection (unknown clients are
    registered on their first call, as on the service's first message)."""
    from jaxrl_async.backends.processes.buffer_service import _Client

    service = self.service
    with service._lock:
      client = service._clients.setdefault(client_id, _Client(client_id))
    return service._dispatch(client, method, args, kwargs)

  def register(self, client_id: str, **kwargs) -> None:
    self.service.register(client_id, **kwargs)

  def revoke(self, client_id: str, timeout: float) -> dict[str, Any]:
    return self.service.revoke(client_id, timeout)

  def tracked(self, client_id: str) -> list[dict]:
    return self.service.tracked(client_id)

  def check_invariants(self) -> None:
    self.service.buffer.check_invariants()

  def set_staleness_threshold(self, staleness_threshold: float, from_version: int) -> dict:
    """The driver's adaptive staleness: the buffer's admission budget from `from_version`."""
    return self.service.buffer.set_staleness_threshold(staleness_threshold, from_version)

  def node_id(self) -> str:
    return require_ray().get_runtime_context().get_node_id()


def buffer_actor_class():
  return require_ray().remote(BufferActorImpl)


def start_buffer_actor(buffer_kwargs: dict[str, Any], **placement):
  """The buffer actor, placed by `role_options(**placement)` (it serves calls concurrently)."""
  options = role_options(**{"num_cpus": 0.0, **placement}, max_concurrency=ACTOR_CONCURRENCY)
  return buffer_actor_class().options(**options).remote(buffer_kwargs)


class RayBufferClient(ForwardingBufferClient):
  """A `BufferClient` for a `BufferActor`, from any process of the Ray cluster; picklable (it
  carries the actor handle and its client id), thread-safe. Its calls are the buffer service's
  (`ForwardingBufferClient`), each one Ray call to the actor.

  Samples travel as Sample objects ('pickle'): the columnar blob of the processes transport
  made Ray runs slower here (about 430 against 550 samples/s, async_partial, run by run under
  load), so Ray serialises the samples itself."""

  transport = "pickle"

  def __init__(self, actor, client_id: str, *, margin_s: float = RPC_MARGIN_S):
    self.actor = actor
    self.client_id = str(client_id)
    self.margin_s = margin_s
    self._empty: tuple | None = None  # (holding_version,) of the last empty zero-wait answer
    self._empty_until = 0.0

  def _call(self, method: str, *args, timeout: float | None = None, **kwargs):
    ray = require_ray()
    wait_s = self.margin_s + (timeout if timeout is not None and timeout > 0 else 0.0)
    ref = self.actor.call.remote(self.client_id, method, args, kwargs)
    try:
      return ray.get(ref, timeout=wait_s)
    except ray.exceptions.GetTimeoutError as error:
      raise TimeoutError(f"buffer actor: {method} did not answer within {wait_s:.3g} s") from error

  def put_many(self, samples, timeout):
    self._empty = None  # a put can complete or drop a group, which frees admission
    super().put_many(samples, timeout)

  def acquire_group_slots(self, max_count, timeout, *, starts=None, holding_version=None):
    # A rollout server asks (timeout 0) between decode steps; after an empty answer it asks
    # the actor again only after ACQUIRE_BACKOFF_S or with new weights, not at every step.
    now = time.monotonic()
    if timeout == 0 and self._empty == (holding_version, ) and now < self._empty_until:
      return 0
    count = super().acquire_group_slots(max_count, timeout, starts=starts,
                                        holding_version=holding_version)
    if count == 0 and timeout == 0:
      self._empty, self._empty_until = (holding_version, ), now + ACQUIRE_BACKOFF_S
    else:
      self._empty = None
    return count

  def publish_version(self, version):
    self._empty = None
    super().publish_version(version)


class DriverBuffer(ControllerBuffer):
  """The buffer actor as the driver's controller and learner use it."""

  def __init__(self, actor):
    self.ray = require_ray()
    self.actor = actor
    self.client = RayBufferClient(actor, "learner")

  def get_groups(self, num_groups, learner_version, timeout):
    return self.client.get_groups(num_groups, learner_version, timeout)

  @property
  def counts(self):
    return self.client.counts()

  def get_state(self):
    return self.client.get_state()

  def set_state(self, state):
    self.client.set_state(state)

  def metrics(self):
    return self.client.metrics()

  def close(self):
    self.client.close()

  def take_drop_log(self) -> list:
    """The buffer actor's per-sample drops since the last call, for the sample ledger."""
    return self.ray.get(self.actor.take_drop_log.remote(), timeout=60.0)

  def discard_queued(self, reason: str = "shutdown") -> int:
    return self.ray.get(self.actor.discard_queued.remote(reason), timeout=60.0)

  def check_invariants(self) -> None:
    self.ray.get(self.actor.check_invariants.remote(), timeout=60.0)

  def set_staleness_threshold(self, staleness_threshold, from_version) -> dict:
    return self.ray.get(self.actor.set_staleness_threshold.remote(staleness_threshold,
                                                                  from_version), timeout=60.0)
