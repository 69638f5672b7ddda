"""The 'ray' backend's transport and placement: the buffer and the weights reached through Ray.

Ray places and restarts the roles (actors) across hosts; this module gives them the same narrow
interfaces as the other backends:
- `BufferActor` holds the run's `VersionedBuffer` behind the buffer service's bookkeeping
  (`buffer_service.BufferService`: per-client groups in flight, `revoke` for a dead client);
  `RayBufferClient` is the `BufferClient` that reaches it with Ray calls (one call per batch).
- `WeightStoreActor` keeps the newest published version as an object in Ray's object store;
  `RayWeightChannel` publishes host copies of the params there and fetches them onto the
  caller's devices (its rollout mesh's shardings), on any node.
- `role_options` turns a role's placement (a node's custom resource, CPUs, GPUs) into Ray actor
  options, with `max_restarts` so that Ray restarts a killed actor.

Ray is an optional extra (`pip install -e '.[ray]'`): nothing here imports it at module import
time, and `require_ray` says how to install it when it is missing.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxrl_async import sharding
from jaxrl_async.runtime.buffer_service import ForwardingBufferClient
from jaxrl_async.sync.channel import WeightChannel, tree_bytes

# Seconds a Ray call may take beyond its own timeout (scheduling, serialization).
RPC_MARGIN_S = 30.0
# Concurrent calls an actor serves: blocked admission or get_groups must not hold up puts.
ACTOR_CONCURRENCY = 32
ACQUIRE_BACKOFF_S = 0.01  # after no admission, zero-wait asks wait this long for a new call
WATCH_S = 1.0  # one long-polling wait on the weight store lasts at most this long
REVOKE_TIMEOUT_S = 120.0  # a dead client's calls still running in the buffer actor end by then
LOOPBACK = "127.0.0.1"


def require_ray():
  """The `ray` module, or an ImportError that says how to install it."""
  try:
    import ray
  except ImportError as error:
    raise ImportError("RunConfig.backend='ray' needs Ray, an optional extra: "
                      "pip install -e '.[ray]'") from error
  return ray


# ---- placement ---------------------------------------------------------------------------------
def role_options(*, node_resource: str | None = None, num_cpus: float = 1.0,
                 num_gpus: float = 0.0, resources: Mapping[str, float] | None = None,
                 max_restarts: int = 0, env: Mapping[str, str] | None = None,
                 max_concurrency: int | None = None) -> dict[str, Any]:
  """Ray actor options for one role.

  `node_resource` names a custom resource that only the intended nodes offer (e.g. 'rollout'
  on the rollout hosts); the role asks for a small share of it, so several roles fit on one
  node. CPUs and GPUs are what the role's devices need; `env` sets, per actor process, the
  thread counts (XLA, BLAS) so that roles on one host do not fight over cores.
  """
  if num_cpus < 0 or num_gpus < 0:
    raise ValueError(f"num_cpus={num_cpus} and num_gpus={num_gpus} must be >= 0")
  if not isinstance(max_restarts, int) or max_restarts < -1:
    raise ValueError(f"max_restarts must be an int >= -1 (-1 = without limit), got "
                     f"{max_restarts!r}")
  wanted = dict(resources or {})
  if node_resource is not None:
    wanted[node_resource] = wanted.get(node_resource, 0.0) + 0.01
  options: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus,
                             "max_restarts": max_restarts}
  if wanted:
    options["resources"] = wanted
  if max_restarts:
    options["max_task_retries"] = 0  # a call that was running when the actor died fails once
  if env:
    options["runtime_env"] = {"env_vars": {k: str(v) for k, v in env.items()}}
  if max_concurrency is not None:
    options["max_concurrency"] = max_concurrency
  return options


def thread_env(num_threads: int) -> dict[str, str]:
  """Environment for a role process that should use `num_threads` cores (BLAS pools of that
  size; one core: XLA's CPU backend without its multi-threaded Eigen pool). The caller's
  XLA_FLAGS and JAX_PLATFORMS (e.g. forced host devices) carry over."""
  if not isinstance(num_threads, int) or num_threads < 1:
    raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_cpu_multi_thread_eigen"))
  if num_threads == 1:
    flags += " --xla_cpu_multi_thread_eigen=false"
  env = {name: str(num_threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                             "MKL_NUM_THREADS")}
  env["XLA_FLAGS"] = flags.strip()
  if os.environ.get("JAX_PLATFORMS"):
    env["JAX_PLATFORMS"] = os.environ["JAX_PLATFORMS"]
  return env


def start_local_cluster(nodes: Sequence[Mapping[str, Any]], *, object_store_mb: int = 200):
  """A Ray cluster of several nodes on this machine, on the loopback interface only.

  nodes: one mapping per node, `{'num_cpus': 1, 'resources': {'learner': 1}}`; the first is
  the head. Connects this process (`ray.init`) and returns the `Cluster`; `stop_local_cluster`
  shuts both down. For tests and one-machine runs; a real cluster is started by `ray start`.
  """
  if not nodes:
    raise ValueError("start_local_cluster needs at least one node")
  # Ray resolves "this node's address" to the loopback address only with this switch off; it
  # reads it at import, so it is set first (and on an imported Ray, where it is kept).
  os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
  ray = require_ray()
  from ray._private import ray_constants
  from ray.cluster_utils import Cluster

  ray_constants.ENABLE_RAY_CLUSTER = False
  common = {"node_ip_address": LOOPBACK, "object_store_memory": object_store_mb * 2**20}
  cluster = Cluster(initialize_head=True,
                    head_node_args={**common, "include_dashboard": False, **nodes[0]})
  try:
    for node in nodes[1:]:
      cluster.add_node(**common, **node)
    cluster.wait_for_nodes()
    if not str(cluster.address).startswith(LOOPBACK + ":"):
      raise RuntimeError(f"the local Ray cluster is not on {LOOPBACK}: {cluster.address}")
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK, log_to_driver=False,
             namespace="jaxrl_async")
  except BaseException:
    cluster.shutdown()
    raise
  return cluster


def stop_local_cluster(cluster) -> None:
  ray = require_ray()
  try:
    ray.shutdown()
  finally:
    cluster.shutdown()


# ---- the buffer --------------------------------------------------------------------------------
class BufferActorImpl:
  """The run's buffer behind the buffer service's per-client bookkeeping, as a Ray actor body
  (`buffer_actor_class` makes the actor class)."""

  def __init__(self, buffer_kwargs: dict[str, Any]):
    from jaxrl_async.buffer import VersionedBuffer
    from jaxrl_async.runtime.buffer_service import BufferService

    self.group_size = int(buffer_kwargs["group_size"])
    self.service = BufferService(VersionedBuffer(**buffer_kwargs, record_drops=True))
    self._claims = threading.Lock()
    self._client_ids: dict[int, str] = {}  # rollout server index -> its live client id
    self._generation: dict[int, int] = {}
    self._initial: dict[int, dict] = {}  # where each server's shard started
    self._unresponsive: set[int] = set()
    self._constructing: set[int] = set()  # servers between claim and ready
    self._restarts = 0
    self._reissue_counts = {f"runtime/reissued_{kind}/{reason}": 0
                            for kind in ("groups", "samples")
                            for reason in ("actor_restarted", "server_unresponsive")}

  # ---- rollout servers: a new incarnation takes over its predecessor's work ----------------
  def claim(self, index: int, restore: dict | None, restarted: bool) -> dict[str, Any]:
    """A client id for rollout server `index` and what it starts from: `restore` (a
    checkpoint's snapshot, or None) on its first start; after a restart, the groups its
    predecessor left unfinished (revoked from the dead client, counted) and its prompt shard."""
    from jaxrl_async.runtime.rollout_server import strip_admission

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
        restore = dict(restore or {})
        rollout = dict(restore.get("rollout") or {})
        rollout["inflight"] = strip_admission(rollout.get("inflight", []))
        restore["rollout"] = rollout
        self._initial[index] = {"prompts": restore.get("prompts"),
                                "next_group_id": rollout.get("next_group_id", index)}
      rollout = restore["rollout"]
      holding = [entry for entry in rollout.get("inflight", [])
                 if entry.get("admitted") or entry["missing"] != list(range(self.group_size))]
      self.service.register(client_id, inflight=holding, prompt_state=restore.get("prompts"),
                            next_group_id=rollout.get("next_group_id"))
      self._client_ids[index] = client_id
      self._constructing.add(index)
      return {"client_id": client_id, "restore": restore}

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
    return {"started": dict(self.service.started), "reissued": list(self.service.reissued)}

  def discard_queued(self, reason: str) -> int:
    return self.service.buffer.discard_queued(reason)

  def take_drop_log(self) -> list:
    """The buffer's per-sample drops since the last call, for the driver's sample ledger."""
    return self.service.buffer.take_drop_log()

  def call(self, client_id: str, method: str, args: tuple, kwargs: dict):
    """One client call, as the service runs it for a connection (unknown clients are
    registered on their first call, as on the service's first message)."""
    from jaxrl_async.runtime.buffer_service import _Client

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
  (`ForwardingBufferClient`), each one Ray call to the actor."""

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


# ---- the weights -------------------------------------------------------------------------------
class WeightStoreImpl:
  """The newest published version, as an object in Ray's object store (Ray actor body)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._version = -1
    self._ref = None

  def publish(self, version: int, boxed_ref: list) -> None:
    with self._cond:
      if version <= self._version:
        raise ValueError(f"version {version} is not newer than the published {self._version}")
      self._version, self._ref = int(version), boxed_ref[0]
      self._cond.notify_all()

  def latest(self) -> int:
    with self._cond:
      return self._version

  def wait(self, newer_than: int, timeout: float) -> int:
    with self._cond:
      self._cond.wait_for(lambda: self._version > newer_than, timeout=timeout)
      return self._version

  def get(self) -> tuple[int, list]:
    with self._cond:
      return self._version, [self._ref]  # boxed: Ray passes the reference, not the value


def start_weight_store(**placement):
  ray = require_ray()
  options = role_options(**{"num_cpus": 0.0, **placement}, max_concurrency=ACTOR_CONCURRENCY)
  return ray.remote(WeightStoreImpl).options(**options).remote()


class RayWeightChannel(WeightChannel):
  """Weights through Ray's object store: `publish` puts a host copy of the params there (the
  learner's process owns it); `fetch` brings the newest onto this process's devices with the
  rollout mesh's shardings (`rollout_mesh=None`: the default device)."""

  def __init__(self, store, logical_axes=None, rollout_mesh=None, *,
               margin_s: float = RPC_MARGIN_S):
    super().__init__()
    self.store = store
    self.logical_axes = logical_axes
    self.rollout_mesh = rollout_mesh
    self.margin_s = margin_s
    self._fetched: tuple[int, Any] | None = None
    self._refs: list = []  # this publisher's last versions stay alive while readers fetch them
    self._remote = -1  # the newest version the store has announced, as last seen here
    self._closed = threading.Event()
    self._watcher: threading.Thread | None = None
    self._watch_error: BaseException | None = None

  def __getstate__(self):
    return {"store": self.store, "logical_axes": self.logical_axes, "margin_s": self.margin_s}

  def __setstate__(self, state):
    self.__init__(state["store"], state["logical_axes"], None, margin_s=state["margin_s"])

  def _get(self, ref, timeout: float | None = None):
    ray = require_ray()
    return ray.get(ref, timeout=self.margin_s + (timeout or 0.0))

  def publish(self, version: int, params) -> None:
    ray = require_ray()
    with self._cond:
      self._check_newer(version, self._version)
    began = time.perf_counter()
    host = jax.tree.map(np.asarray, jax.device_get(params))
    ref = ray.put(host)
    self._get(self.store.publish.remote(int(version), [ref]))
    self._refs = (self._refs + [ref])[-2:]
    self._announce(version, time.perf_counter() - began, tree_bytes(host))
    self._seen_version(int(version))

  # The rollout side asks for the latest version between decode steps: one long-polling call
  # to the store (in a named thread) keeps a local copy, so asking costs no Ray call.
  def _seen_version(self, version: int) -> None:
    with self._cond:
      if version > self._remote:
        self._remote = version
        self._cond.notify_all()

  def _watch(self) -> None:
    while not self._closed.is_set():
      with self._cond:
        seen = self._remote
      try:
        self._seen_version(int(self._get(self.store.wait.remote(seen, WATCH_S), WATCH_S)))
      except Exception as error:  # the store is gone (end of run): readers see the last one
        self._watch_error = error
        self._closed.wait(WATCH_S)

  def _ensure_watcher(self) -> None:
    if self._watcher is None:
      self._seen_version(int(self._get(self.store.latest.remote())))
      self._watcher = threading.Thread(target=self._watch, name="ray-weights-watch",
                                       daemon=True)
      self._watcher.start()

  def latest_version(self) -> int:
    self._ensure_watcher()
    with self._cond:
      return self._remote

  def wait_for_version(self, newer_than: int, timeout: float) -> int:
    if not timeout > 0:
      raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    self._ensure_watcher()
    with self._cond:
      self._cond.wait_for(lambda: self._remote > newer_than, timeout=timeout)
      return self._remote

  def close(self) -> None:
    self._closed.set()
    if self._watcher is not None:
      self._watcher.join(WATCH_S + self.margin_s)
      self._watcher = None

  def fetch(self):
    version, boxed = self._get(self.store.get.remote())
    if version < 0:
      raise LookupError("no weights published yet")
    if self._fetched is not None and self._fetched[0] == version:
      return self._fetched
    host = self._get(boxed[0])
    if self.rollout_mesh is None or self.logical_axes is None:
      params = jax.device_put(host)
    else:
      params = jax.device_put(host, sharding.param_shardings(self.logical_axes, host,
                                                             self.rollout_mesh))
    self._fetched = (version, params)
    return self._fetched
