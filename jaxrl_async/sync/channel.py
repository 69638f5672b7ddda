"""The weight channel: `publish(version, params)` on the learner side, `fetch()` on the rollout side.

Two backends behind one interface:
- `DeviceTransferChannel`: copies the learner's params straight onto the rollout devices with the
  rollout's shardings (`jax.device_put` between meshes: a device-to-device copy where the
  platform allows it, no host round trip). The copy is private to the rollout side, so the
  learner may keep donating its own buffers.
- `OrbaxStoreChannel`: the learner saves version v under `<directory>/<v>` with orbax (in a
  background thread); the rollout side restores the newest complete version with its own target
  shardings. Works across processes that share the directory.

Versions only grow: publishing a version that is not newer than the last one raises ValueError.
Both measure sync latency (publish call to weights ready on the rollout side) and bytes moved.
"""

from __future__ import annotations

import os
import threading
import time

import jax
import orbax.checkpoint as ocp

from jaxrl_async import sharding

# How often a store channel looks at the directory while waiting for another process's version.
STORE_POLL_S = 0.05
# How often fetch retries when the version it listed was deleted (max_to_keep) before restore.
FETCH_RETRIES = 3


def tree_bytes(params) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params)))


def _check_timeout(timeout: float) -> None:
  if not timeout > 0:  # also rejects NaN
    raise ValueError(f"timeout must be > 0 seconds, got {timeout}")


class WeightChannel:
  """Base: version bookkeeping, a condition to wait on, and sync metrics."""

  def __init__(self):
    self._cond = threading.Condition()
    self._version = -1
    self.latencies: list[float] = []
    self.bytes_moved = 0

  def latest_version(self) -> int:
    with self._cond:
      return self._version

  def wait_for_version(self, newer_than: int, timeout: float) -> int:
    """Block until a version > newer_than is published (or timeout); returns the latest."""
    _check_timeout(timeout)
    with self._cond:
      self._cond.wait_for(lambda: self._version > newer_than, timeout=timeout)
      return self._version

  def _poll_for_version(self, newer_than: int, timeout: float, poll_s: float) -> int:
    """`wait_for_version` for a channel whose `latest_version` reads shared state: wakes at once
    for a version this object published, and polls every `poll_s` for versions written by
    another process."""
    _check_timeout(timeout)
    deadline = time.monotonic() + timeout
    while True:
      latest = self.latest_version()
      remaining = deadline - time.monotonic()
      if latest > newer_than or remaining <= 0:
        return latest
      with self._cond:
        self._cond.wait_for(lambda: self._version > newer_than, timeout=min(poll_s, remaining))

  def _check_newer(self, version: int, published: int) -> None:
    if version <= published:
      raise ValueError(f"version {version} is not newer than the published {published}")

  def _announce(self, version: int, latency_s: float, nbytes: int) -> None:
    """Makes `version` the latest and records its sync cost, atomically for readers."""
    with self._cond:
      self._check_newer(version, self._version)
      self._version = version
      self.latencies.append(latency_s)
      self.bytes_moved += nbytes
      self._cond.notify_all()

  def metrics(self) -> dict[str, float]:
    with self._cond:
      latencies = list(self.latencies)
      nbytes = self.bytes_moved
    return {
        "sync/latency_s": float(latencies[-1]) if latencies else float("nan"),
        "sync/latency_s_mean": float(sum(latencies) / len(latencies)) if latencies else float(
            "nan"),
        "sync/bytes": float(nbytes),
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
    """Copies params onto the rollout devices; returns once the copy is complete."""
    with self._cond:  # fail before copying anything
      self._check_newer(version, self._version)
    began = time.perf_counter()
    target = self.target_shardings(params)
    if target is None:
      copied = jax.tree.map(lambda x: x.copy(), params)
    else:
      copied = jax.device_put(params, target, may_alias=False)
    jax.block_until_ready(copied)
    with self._cond:  # version and params change together: fetch never sees a mix
      self._announce(version, time.perf_counter() - began, tree_bytes(copied))
      self._params = copied

  def fetch(self):
    with self._cond:
      if self._params is None:
        raise LookupError("no weights published yet")
      return self._version, self._params


class OrbaxStoreChannel(WeightChannel):
  """Through a (shared) directory: `<directory>/<version>` written by orbax, newest wins.

  The learner side writes with its own manager, created on the first publish, so a channel that
  only fetches (another process) never deletes or cleans up anything in the directory. Reads go
  through a separate read-only manager: re-listing the directory on the writer's manager while a
  save is in flight would drop that save from its bookkeeping and break `max_to_keep`.
  """

  def __init__(self, directory: str | os.PathLike, abstract_params, logical_axes,
               rollout_mesh=None, *, max_to_keep: int = 2):
    super().__init__()
    if not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f"max_to_keep must be an int >= 1, got {max_to_keep!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    self.abstract_params = abstract_params
    self.logical_axes = logical_axes
    self.rollout_mesh = rollout_mesh
    self.max_to_keep = max_to_keep
    os.makedirs(self.directory, exist_ok=True)
    self._writer: ocp.CheckpointManager | None = None
    # Lightweight: listing steps must not stat directories the writer may be deleting.
    self._reader = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(
            read_only=True, create=False, save_interval_steps=0, lightweight_initialize=True))
    self._reader_lock = threading.Lock()  # a CheckpointManager is not meant for concurrent use
    self._pending: threading.Thread | None = None
    self._save_error: BaseException | None = None
    self._fetched: tuple[int, object] | None = None

  def _writer_manager(self) -> ocp.CheckpointManager:
    if self._writer is None:
      self._writer = ocp.CheckpointManager(
          self.directory, options=ocp.CheckpointManagerOptions(
              max_to_keep=self.max_to_keep, create=True, enable_async_checkpointing=True))
    return self._writer

  def publish(self, version: int, params) -> None:
    """Starts an asynchronous save and returns; the version is announced once it is on disk."""
    self._join_pending()  # one save in flight at a time; raises if the previous one failed
    writer = self._writer_manager()
    on_disk = writer.latest_step()
    with self._cond:
      self._check_newer(version, max(self._version, -1 if on_disk is None else int(on_disk)))
    began = time.perf_counter()
    # Returns after the device-to-host copy; orbax would skip a non-newer step silently.
    if not writer.save(version, args=ocp.args.StandardSave(params)):
      raise RuntimeError(f"orbax declined to save version {version} under {self.directory}")
    nbytes = tree_bytes(params)
    self._pending = threading.Thread(target=self._finish, args=(version, began, nbytes),
                                     name=f"weights-save-{version}", daemon=True)
    self._pending.start()

  def _finish(self, version: int, began: float, nbytes: int) -> None:
    try:
      self._writer.wait_until_finished()
      # Orbax logs (and does not raise) a failed commit; only a finalized step may be announced.
      if not os.path.isdir(self._step_directory(version)):
        raise RuntimeError(f"version {version} did not reach {self.directory}")
      self._announce(version, time.perf_counter() - began, nbytes)
    except BaseException as error:  # re-raised by the next publish or close
      self._save_error = error

  def _step_directory(self, version: int) -> str:
    return os.path.join(self.directory, str(version))

  def _join_pending(self, timeout: float = 600.0) -> None:
    if self._pending is not None:
      self._pending.join(timeout)
      if self._pending.is_alive():
        raise TimeoutError(f"saving weights under {self.directory} took over {timeout} s")
      self._pending = None
    if self._save_error is not None:
      error, self._save_error = self._save_error, None
      raise RuntimeError(f"saving weights under {self.directory} failed") from error

  def latest_version(self) -> int:
    """The newest complete version on disk (another process may have written it).

    Orbax writes a version under a temporary name and renames it to `<version>` once complete,
    so the int-named directories are the complete versions. Listing them directly is cheap
    enough for the rollout side to ask between decode steps.
    """
    try:
      with os.scandir(self.directory) as entries:
        versions = [int(entry.name) for entry in entries
                    if entry.name.isdigit() and entry.is_dir()]
    except FileNotFoundError:
      return -1
    return max(versions, default=-1)

  def wait_for_version(self, newer_than: int, timeout: float) -> int:
    """Block until a version > newer_than is on disk (or timeout); returns the latest."""
    return self._poll_for_version(newer_than, timeout, STORE_POLL_S)

  def _restore_target(self):
    if self.rollout_mesh is None:
      return self.abstract_params
    shardings = sharding.param_shardings(self.logical_axes, self.abstract_params,
                                         self.rollout_mesh)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self.abstract_params, shardings)

  def fetch(self):
    """(version, params) of the newest complete version, restored with the rollout shardings."""
    with self._reader_lock:
      attempt = 0
      while True:
        version = self.latest_version()
        if version < 0:
          raise LookupError(f"no weights under {self.directory}")
        if self._fetched is not None and self._fetched[0] == version:
          return self._fetched
        try:
          params = self._reader.restore(version,
                                        args=ocp.args.StandardRestore(self._restore_target()))
        except Exception:
          attempt += 1
          # The writer dropped this version (max_to_keep) after it was listed: a newer one exists.
          if attempt < FETCH_RETRIES and not os.path.isdir(self._step_directory(version)):
            continue
          raise
        self._fetched = (version, params)
        return self._fetched

  def close(self) -> None:
    """Waits for the save in flight and releases orbax's threads."""
    try:
      self._join_pending()
    finally:
      if self._writer is not None:
        self._writer.close()
        self._writer = None
      self._reader.close()
