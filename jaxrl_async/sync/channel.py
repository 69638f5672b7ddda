"""The weight channel: `publish(version, params)` on the learner side, `fetch()` on the rollout side.

Two backends behind one interface (DESIGN.md, principle 3):
- `DeviceTransferChannel`: copies the learner's params straight onto the rollout devices with the
  rollout's shardings (`jax.device_put` between meshes: a device-to-device copy where the
  platform allows it, no host round trip). The copy is private to the rollout side, so the
  learner may keep donating its own buffers.
- `OrbaxStoreChannel`: the learner saves version v under `<directory>/<v>` with orbax (in a
  background thread); the rollout side restores the newest complete version with its own target
  shardings. Works across processes that share the directory.

Both measure sync latency (publish call to weights ready on the rollout side) and bytes moved.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import orbax.checkpoint as ocp

from jaxrl_async import sharding


def tree_bytes(params) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


class WeightChannel:
  """Base: version bookkeeping, a condition to wait on, and sync metrics."""

  def __init__(self):
    self._cond = threading.Condition()
    self._version = -1
    self._published_at: dict[int, float] = {}
    self.latencies: list[float] = []
    self.bytes_moved = 0

  def latest_version(self) -> int:
    with self._cond:
      return self._version

  def wait_for_version(self, newer_than: int, timeout: float) -> int:
    """Block until a version > newer_than is published (or timeout); returns the latest."""
    if not timeout > 0:
      raise ValueError(f"timeout must be > 0, got {timeout}")
    with self._cond:
      self._cond.wait_for(lambda: self._version > newer_than, timeout=timeout)
      return self._version

  def _announce(self, version: int) -> None:
    with self._cond:
      if version <= self._version:
        raise ValueError(f"version {version} is not newer than the published {self._version}")
      self._version = version
      self._cond.notify_all()

  def metrics(self) -> dict[str, float]:
    with self._cond:
      latencies = list(self.latencies)
    return {
        "sync/latency_s": float(latencies[-1]) if latencies else float("nan"),
        "sync/latency_s_mean": float(sum(latencies) / len(latencies)) if latencies else float(
            "nan"),
        "sync/bytes": float(self.bytes_moved),
        "sync/publishes": float(len(latencies)),
    }

  def publish(self, version: int, params) -> None:
    raise NotImplementedError

  def fetch(self) -> tuple[int, object]:
    raise NotImplementedError

  def close(self) -> None:
    pass


class DeviceTransferChannel(WeightChannel):
  """In-process: device-to-device copy onto the rollout mesh, resharded by logical axes."""

  def __init__(self, logical_axes, rollout_mesh=None):
    super().__init__()
    self.logical_axes = logical_axes
    self.rollout_mesh = rollout_mesh
    self._params = None

  def target_shardings(self, params):
    if self.rollout_mesh is None:
      return None
    return sharding.param_shardings(self.logical_axes, params, self.rollout_mesh)

  def publish(self, version: int, params) -> None:
    began = time.perf_counter()
    target = self.target_shardings(params)
    if target is None:
      copied = jax.tree.map(lambda x: x.copy(), params)
    else:
      copied = jax.device_put(params, target, may_alias=False)
    jax.block_until_ready(copied)
    with self._cond:
      self._params = copied
      self.latencies.append(time.perf_counter() - began)
      self.bytes_moved += tree_bytes(copied)
    self._announce(version)

  def fetch(self):
    with self._cond:
      if self._params is None:
        raise LookupError("no weights published yet")
      return self._version, self._params


class OrbaxStoreChannel(WeightChannel):
  """Through a (shared) directory: `<directory>/<version>` written by orbax, newest wins."""

  def __init__(self, directory: str | os.PathLike, abstract_params, logical_axes,
               rollout_mesh=None, *, max_to_keep: int = 2):
    super().__init__()
    self.directory = os.path.abspath(os.fspath(directory))
    self.abstract_params = abstract_params
    self.logical_axes = logical_axes
    self.rollout_mesh = rollout_mesh
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=True))
    self._pending: threading.Thread | None = None
    self._fetched: tuple[int, object] | None = None

  def publish(self, version: int, params) -> None:
    """Starts an asynchronous save and returns; the version is announced once it is on disk."""
    self._join_pending()  # one save in flight at a time
    began = time.perf_counter()
    self._manager.save(version, args=ocp.args.StandardSave(params))  # returns after D2H copy
    nbytes = tree_bytes(params)
    self._pending = threading.Thread(target=self._finish, args=(version, began, nbytes),
                                     name=f"weights-save-{version}", daemon=True)
    self._pending.start()

  def _finish(self, version: int, began: float, nbytes: int) -> None:
    self._manager.wait_until_finished()
    with self._cond:
      self.latencies.append(time.perf_counter() - began)
      self.bytes_moved += nbytes
    self._announce(version)

  def _join_pending(self, timeout: float = 600.0) -> None:
    if self._pending is not None:
      self._pending.join(timeout)
      if self._pending.is_alive():
        raise TimeoutError(f"saving weights under {self.directory} took over {timeout} s")
      self._pending = None

  def latest_version(self) -> int:
    """The newest complete version on disk (another process may have written it)."""
    self._manager.reload()
    step = self._manager.latest_step()
    return -1 if step is None else int(step)

  def fetch(self):
    version = self.latest_version()
    if version < 0:
      raise LookupError(f"no weights under {self.directory}")
    if self._fetched is not None and self._fetched[0] == version:
      return self._fetched
    if self.rollout_mesh is None:
      target = self.abstract_params
    else:
      shardings = sharding.param_shardings(self.logical_axes, self.abstract_params,
                                           self.rollout_mesh)
      target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.abstract_params, shardings)
    params = self._manager.restore(version, args=ocp.args.StandardRestore(target))
    self._fetched = (version, params)
    return self._fetched

  def close(self) -> None:
    self._join_pending()
    self._manager.close()
