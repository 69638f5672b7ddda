"""The 'ray' backend's buffer: the run's `VersionedBuffer` in a Ray actor, and its client.

The actor body (`BufferActorImpl`) keeps the buffer service's per-client bookkeeping (groups in
flight per rollout server, `revoke` for a dead one) and adds what Ray restarts need: a new
incarnation of a rollout actor `claim`s its predecessor's unfinished groups and prompt shard,
and the re-issues are counted by reason. `RayBufferClient` is the `BufferClient` that reaches
it with one Ray call per batch, from any process of the cluster.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from jaxrl_async.backends.processes.buffer_service import ForwardingBufferClient
from jaxrl_async.backends.ray.placement import (
  ACTOR_CONCURRENCY,
  RPC_MARGIN_S,
  require_ray,
  role_options,
)

ACQUIRE_BACKOFF_S = 0.01  # after no admission, zero-wait asks wait this long for a new call
REVOKE_TIMEOUT_S = 120.0  # a dead client's calls still running in the buffer actor end by then


class BufferActorImpl:
  """The run's buffer behind the buffer service's per-client bookkeeping, as a Ray actor body
  (`buffer_actor_class` makes the actor class)."""

  def __init__(self, buffer_kwargs: dict[str, Any]):
    from jaxrl_async.backends.processes.buffer_service import BufferService
    from jaxrl_async.buffer import VersionedBuffer

    self.group_size = int(buffer_kwargs["group_size"])
    self.service = BufferService(VersionedBuffer(**buffer_kwargs, record_drops=True))
    self._claims = threading.Lock()
    self._client_ids: dict[int, str] = {}  # rollout server index -> its live client id
    self._generation: dict[int, int] = {}
    self._initial: dict[int, dict] = {}  # where each server's shard started
    self._unresponsive: set[int] = set()
    self._constructing: set[int] = set()  # servers between claim and ready
    self._restarts = 0
    self._restores_given = threading.Event()
    self._restores: list = []  # where each server starts, handed over by the driver's start
    self._reissue_counts = {f"runtime/reissued_{kind}/{reason}": 0
                            for kind in ("groups", "samples")
                            for reason in ("actor_restarted", "server_unresponsive")}

  # ---- rollout servers: a new incarnation takes over its predecessor's work ----------------
  def claim(self, index: int, restore: dict | None, restarted: bool) -> dict[str, Any]:
    """A client id for rollout server `index` and what it starts from: `restore` (a
    checkpoint's snapshot, or None) on its first start; after a restart, the groups its
    predecessor left unfinished (revoked from the dead client, counted) and its prompt shard."""
    from jaxrl_async.backends.rollout_server import first_start

    with self._claims:
      self._generation[index] = self._generation.get(index, 0) + 1
      client_id = f"rollout-{index}-{self._generation[index]}"
      previous = self._client_ids.get(index)
      if restarted and previous is not None:
        reason = "server_unresponsive" if index in self._unresponsive else "actor_restarted"
        self._unresponsive.discard(index)
        orphan = self.service.revoke(previous, REVOKE_TIMEOUT_S)
        inflight = orphan["inflight"]
        self._reissue_counts[f"runtime/reissued_groups/{reason}"] += len(inflight)
        self._reissue_counts[f"runtime/reissued_samples/{reason}"] += sum(
            len(entry["missing"]) for entry in inflight)
        self._restarts += 1
        initial = self._initial[index]
        restore = {"rollout": {"inflight": inflight, "next_group_id": (
            orphan["next_group_id"] if orphan["next_group_id"] is not None
            else initial["next_group_id"])},
                   "prompts": (orphan["prompt_state"] if orphan["prompt_state"] is not None
                               else initial["prompts"])}
      else:
        restore, self._initial[index] = first_start(restore, index)
      rollout = restore["rollout"]
      holding = [entry for entry in rollout.get("inflight", [])
                 if entry.get("admitted") or entry["missing"] != list(range(self.group_size))]
      self.service.register(client_id, inflight=holding, prompt_state=restore.get("prompts"),
                            next_group_id=rollout.get("next_group_id"))
      self._client_ids[index] = client_id
      self._constructing.add(index)
      return {"client_id": client_id, "restore": restore}

  def set_restores(self, restores: list) -> None:
    """The driver's fleet starts: what each rollout server starts from (a checkpoint's
    snapshot, or None)."""
    self._restores = list(restores)
    self._restores_given.set()

  def restore_for(self, index: int, wait_s: float) -> tuple[bool, Any]:
    """(given, restore) of rollout server `index`, waiting at most `wait_s` for the driver."""
    if not self._restores_given.wait(wait_s):
      return False, None
    return True, self._restores[index]

  def ready(self, index: int) -> None:
    """Server `index` has finished starting (its constructor ran to the end)."""
    with self._claims:
      self._constructing.discard(index)

  def constructing(self, index: int) -> bool:
    with self._claims:
      return index in self._constructing

  def note_unresponsive(self, index: int) -> None:
    """The driver is about to kill server `index` for silence: its successor counts why."""
    with self._claims:
      self._unresponsive.add(index)

  def restarts(self) -> int:
    with self._claims:
      return self._restarts

  def reissue_counts(self) -> dict[str, int]:
    with self._claims:
      return dict(self._reissue_counts)

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


