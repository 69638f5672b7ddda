"""The 'ray' backend's placement and clusters; its transport lives beside it.

Ray places and restarts the roles (actors) across hosts, and the roles keep the same narrow
interfaces as on the other backends:
- `hosted.py` (the default) serves the run's `VersionedBuffer` from the driver's process over
  the buffer service's socket transport, with the restarts' bookkeeping (`claims.py`) beside
  it; `buffer.py`'s buffer actor holds the same behind Ray calls (`RayBufferClient`, one call
  per batch); `links.py` is how a rollout actor reaches either.
- `host_weights.py`: the driver's shared-memory weight channel for actors on its host;
  `weights.py`: elsewhere, the weight store actor keeps the newest published version as an
  object in Ray's object store, and `RayWeightChannel` publishes host copies of the params
  there and fetches them onto the caller's devices (its rollout mesh's shardings), on any node.
- here: `role_options` turns a role's placement (a node's custom resource, CPUs, GPUs) into
  Ray actor options, with `max_restarts` so that Ray restarts a killed actor; `thread_env`
  sets a role process's thread counts; `start_local_cluster` makes a cluster of several nodes
  on this machine (loopback only).

Ray is an optional extra (`pip install -e '.[ray]'`): nothing here imports it at module import
time, and `require_ray` says how to install it when it is missing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl_async import faults
from jaxrl_async.backends.processes.child import compilation_cache_env

# Seconds a Ray call may take beyond its own timeout (scheduling, serialization).
RPC_MARGIN_S = 30.0
# Concurrent calls an actor serves: blocked admission or get_groups must not hold up puts.
ACTOR_CONCURRENCY = 32
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


# The caller's settings of how JAX compiles, carried to its actors: an actor process is started
# by its node's raylet, with the environment of whoever started the cluster, so without these it
# could compile the same program otherwise than its driver (a replay of the run then draws
# different logprobs: docs/replay.md).
COMPILE_ENV = ("JAX_PLATFORMS", "JAX_DISABLE_MOST_OPTIMIZATIONS", "JAX_ENABLE_X64",
               "JAX_DEFAULT_MATMUL_PRECISION")


def thread_env(num_threads: int) -> dict[str, str]:
  """Environment for a role process that should use `num_threads` cores (BLAS pools of that
  size; one core: XLA's CPU backend without its multi-threaded Eigen pool). The caller's
  XLA_FLAGS (e.g. forced host devices), its JAX compile settings (`COMPILE_ENV`), its persistent
  compilation cache (without it each rollout actor compiled every executable again: its first
  version reached the learner about 2.6 s after the publish, against a few tenths of a second
  for the processes backend's server, which gets the cache the same way) and its fault plan
  carry over."""
  if not isinstance(num_threads, int) or num_threads < 1:
    raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_cpu_multi_thread_eigen"))
  if num_threads == 1:
    flags += " --xla_cpu_multi_thread_eigen=false"
  env = {name: str(num_threads) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                             "MKL_NUM_THREADS")}
  env["XLA_FLAGS"] = flags.strip()
  for name in COMPILE_ENV + (faults.ENV,):  # a fault plan reaches the actors too
    if os.environ.get(name):
      env[name] = os.environ[name]
  env.update(compilation_cache_env())
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
