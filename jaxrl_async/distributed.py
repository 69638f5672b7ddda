"""A multi-process JAX program: `jax.distributed` set up from flags or the environment, and one
global mesh over every process's devices.

    spec = distributed.cluster_spec()          # flags > JAX_* env > SLURM > Cloud TPU > single
    distributed.initialize(spec)               # before any other JAX call
    mesh = distributed.global_mesh(MeshShape(fsdp=-1))

Every process then runs the same jitted update on the global mesh (SPMD): host data that every
process holds in full (params, a batch) becomes one global array with `to_global`, and a global
result comes back to every host with `to_host`.

Where the settings come from, first match wins:
1. explicit arguments (`--coordinator_address`, `--num_processes`, `--process_id`);
2. JAX's own variables: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
3. SLURM (one task a host): SLURM_PROCID, SLURM_NTASKS, the first host of SLURM_STEP_NODELIST
   or SLURM_JOB_NODELIST, port `coordinator_port` (or JAXRL_COORDINATOR_PORT);
4. a Cloud TPU VM slice: TPU_WORKER_ID and TPU_WORKER_HOSTNAMES (the first host coordinates);
5. none of these: one process, no `jax.distributed`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from jaxrl_async import sharding

DEFAULT_COORDINATOR_PORT = 12355
SOURCES = ("arguments", "jax_env", "slurm", "tpu", "single")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
  coordinator_address: str | None  # host:port of process 0; None for a single process
  num_processes: int
  process_id: int
  source: str  # one of SOURCES: where the settings came from

  def __post_init__(self):
    if self.source not in SOURCES:
      raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
    if not isinstance(self.num_processes, int) or self.num_processes < 1:
      raise ValueError(f"num_processes must be an int >= 1, got {self.num_processes!r}")
    if not isinstance(self.process_id, int) or not 0 <= self.process_id < self.num_processes:
      raise ValueError(
          f"process_id must be an int in [0, num_processes={self.num_processes}), got "
          f"{self.process_id!r}")
    if self.num_processes > 1 and not _is_host_port(self.coordinator_address):
      raise ValueError(
          f"coordinator_address must be 'host:port' when num_processes={self.num_processes} > 1, "
          f"got {self.coordinator_address!r}")

  @property
  def is_distributed(self) -> bool:
    return self.num_processes > 1

  def env(self) -> dict[str, str]:
    """The JAX_* variables that make another process pick up this spec (launch scripts)."""
    return {"JAX_COORDINATOR_ADDRESS": self.coordinator_address or "",
            "JAX_NUM_PROCESSES": str(self.num_processes),
            "JAX_PROCESS_ID": str(self.process_id)}


def _is_host_port(address) -> bool:
  return isinstance(address, str) and re.fullmatch(r"[^\s:]+:\d{1,5}", address) is not None


def first_host(nodelist: str) -> str:
  """The first host of a SLURM node list: 'gpu[003-004,7],cpu1' -> 'gpu003'."""
  match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
  if not match or not match.group(1):
    raise ValueError(f"cannot read a host from the SLURM node list {nodelist!r}")
  prefix, ranges = match.group(1), match.group(3)
  if ranges is None:
    return prefix
  return prefix + ranges.split(",")[0].split("-")[0]


def _int_env(env: Mapping[str, str], name: str) -> int:
  value = env[name]
  try:
    return int(value)
  except ValueError:
    raise ValueError(f"environment variable {name} must be an int, got {value!r}") from None


def cluster_spec(coordinator_address: str | None = None, num_processes: int | None = None,
                 process_id: int | None = None, *, env: Mapping[str, str] | None = None,
                 coordinator_port: int | None = None) -> ClusterSpec:
  """Resolve where the coordinator is, how many processes and which one this is (see module).

  coordinator_port (SLURM, TPU): default JAXRL_COORDINATOR_PORT from the environment, else
  DEFAULT_COORDINATOR_PORT.
  """
  env = os.environ if env is None else env
  if coordinator_port is None:
    coordinator_port = (_int_env(env, "JAXRL_COORDINATOR_PORT")
                        if "JAXRL_COORDINATOR_PORT" in env else DEFAULT_COORDINATOR_PORT)
  given = (coordinator_address, num_processes, process_id)
  if any(x is not None for x in given):
    if num_processes is None or process_id is None:
      raise ValueError("num_processes and process_id must be given together (with "
                       f"coordinator_address when num_processes > 1), got {given}")
    return ClusterSpec(coordinator_address, num_processes, process_id, "arguments")
  if "JAX_NUM_PROCESSES" in env:
    return ClusterSpec(env.get("JAX_COORDINATOR_ADDRESS"), _int_env(env, "JAX_NUM_PROCESSES"),
                       _int_env(env, "JAX_PROCESS_ID"), "jax_env")
  if "SLURM_PROCID" in env and ("SLURM_NTASKS" in env or "SLURM_NPROCS" in env):
    count_name = "SLURM_NTASKS" if "SLURM_NTASKS" in env else "SLURM_NPROCS"
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
      raise ValueError("SLURM_PROCID is set but neither SLURM_STEP_NODELIST nor "
                       "SLURM_JOB_NODELIST names the hosts")
    return ClusterSpec(f"{first_host(nodelist)}:{coordinator_port}", _int_env(env, count_name),
                       _int_env(env, "SLURM_PROCID"), "slurm")
  if "TPU_WORKER_ID" in env and env.get("TPU_WORKER_HOSTNAMES"):
    hosts = [h for h in env["TPU_WORKER_HOSTNAMES"].split(",") if h]
    return ClusterSpec(f"{hosts[0]}:{coordinator_port}", len(hosts),
                       _int_env(env, "TPU_WORKER_ID"), "tpu")
  return ClusterSpec(None, 1, 0, "single")


def initialize(spec: ClusterSpec, *, timeout_s: int = 300, heartbeat_timeout_s: int = 100) -> None:
  """`jax.distributed.initialize` for a multi-process spec (a single process: nothing to do).

  Must run before any other JAX call. The coordinator waits up to `timeout_s` for every process
  to join; a process that never comes fails the others with JAX's error instead of a hang. A
  process silent for `heartbeat_timeout_s` is taken for dead by the coordination service.
  """
  if not spec.is_distributed:
    return
  jax.distributed.initialize(coordinator_address=spec.coordinator_address,
                             num_processes=spec.num_processes, process_id=spec.process_id,
                             initialization_timeout=timeout_s,
                             heartbeat_timeout_seconds=heartbeat_timeout_s,
                             cluster_detection_method="deactivate")


def shutdown() -> None:
  if jax.process_count() > 1:
    jax.distributed.shutdown()


def global_devices() -> list:
  """Every process's devices, process-major (each host's devices stay together on the mesh)."""
  return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))


def global_mesh(shape: sharding.MeshShape = sharding.MeshShape()) -> Mesh:
  """One mesh over all processes' devices (`shape` may use -1 for the remaining axis)."""
  devices = global_devices()
  return sharding.make_mesh(shape, devices[:shape.num_devices(len(devices))])


def to_global(tree, shardings):
  """Host values that every process holds in full -> global arrays with `shardings`.

  Each process fills only the shards of its own devices (`jax.make_array_from_callback`), so
  this works for meshes that span processes, where `jax.device_put` of a host value cannot.
  """
  def place(value, target):
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, target, lambda index: value[index],
                                        dtype=value.dtype)

  return jax.tree.map(place, tree, shardings)


def to_host(tree):
  """Global arrays -> numpy on every process (an all-gather across processes)."""
  if jax.process_count() == 1:
    return jax.device_get(tree)
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(tree, tiled=True)
