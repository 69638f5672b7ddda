"""The weight store: versions staged, checked, flipped into place atomically; deltas between them.

`RunConfig.sync_backend = 'store'`: the learner's process publishes into a directory that every
rollout server sees (a shared file system across hosts), with tensorstore underneath
(sync/store_format.py has the layout). One `TensorStoreChannel` object either publishes (the
learner's end) or fetches (a rollout server's end).

Publish (a background thread, one at a time; `publish` itself only copies to the host):
  1. the params in the rollout's dtype (`rollout_dtype`, e.g. bfloat16; None: as trained);
  2. a full version (every leaf), or with `delta=True` the changed elements of each leaf
     against the last committed version (sync/delta.py); full anyway on the first publish,
     every `full_every` versions and when a reader asked for one;
  3. staged under `.staging/`, read back and checked against its CRCs, then renamed into
     place: the flip. A publish that fails (counted `sync/publish_failed`) leaves nothing
     visible; the next delta is against the last committed version.
Fetch (a rollout server): from the version it holds, each delta in turn (its payload checked
before it is applied, every changed leaf's CRC-32 checked after), else the newest full version
and the deltas after it. A delta that fails its checks is counted (`delta_fallbacks`), the
server keeps the version it holds, asks the writer for a full publish and loads it when it comes.
A load that raises is counted (`load_failed`) and retried after `LOAD_RETRY_S`. While a load is
in flight `reader_state()['loading_s']` says for how long: the fleet replaces a server past
`RunConfig.sync_load_deadline_s`. Each load is logged (version, digest) in
`<directory>/loads/<reader>.jsonl`, each publish in `<directory>/published.jsonl`.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import jax
import numpy as np

from jaxrl_async import faults, sharding
from jaxrl_async.sync import delta as delta_lib
from jaxrl_async.sync import store_format as fmt
from jaxrl_async.sync.channel import WeightChannel

POLL_S = 0.05  # how often a waiting reader lists the directory
LOAD_RETRY_S = 1.0  # a failed load is tried again after this long
FIRST_LOAD_TRIES = 5  # a reader with no version yet tries this often before it raises
MAX_FAILED_PUBLISHES = 3  # consecutive failed publishes before publish raises
KEEP_LAST = 2  # versions kept beyond those a reader may still need
JOIN_TIMEOUT_S = 600.0


def store_options(config) -> dict:
  """The channel's keyword arguments from a RunConfig's knobs."""
  return {"delta": config.sync_delta, "full_every": config.sync_full_every,
          "rollout_dtype": config.rollout_param_dtype}


class TensorStoreChannel(WeightChannel):

  def __init__(self, directory, abstract_params, logical_axes=None, rollout_mesh=None, *,
               delta: bool = False, full_every: int = 16, rollout_dtype: str | None = None,
               name: str | None = None, log=print):
    super().__init__()
    if not isinstance(full_every, int) or full_every < 1:
      raise ValueError(f"full_every must be an int >= 1, got {full_every!r}")
    self.directory = os.path.abspath(os.fspath(directory))
    os.makedirs(self.directory, exist_ok=True)
    self.logical_axes, self.rollout_mesh = logical_axes, rollout_mesh
    self.delta, self.full_every, self.rollout_dtype = delta, full_every, rollout_dtype
    self.name = name or f"{socket.gethostname()}-{os.getpid()}"
    self.log = log
    self._treedef = jax.tree.structure(abstract_params)
    self._abstract = jax.tree.leaves(abstract_params)
    # writer
    self._committed: tuple[int, list[np.ndarray]] | None = None
    self._pending: threading.Thread | None = None
    self._error: BaseException | None = None
    self._failed_in_a_row = 0
    self.publish_counts = {"full": 0, "delta": 0, "failed": 0, "changed": 0, "elements": 0,
                           "full_bytes": 0}
    self.densities: list[float] = []
    # reader
    self._reader_lock = threading.Lock()
    self._held: tuple[int, object, str] | None = None  # version, device params, digest
    self._mirror: list[np.ndarray] | None = None  # host leaves at the held version
    self._blocked_from: int | None = None  # versions >= this need a full publish
    self._retry_at = 0.0
    self._loading: tuple[int, float] | None = None
    self.load_counts = {"loads": 0, "loads_full": 0, "loads_delta": 0, "load_failed": 0,
                        "delta_fallbacks": 0, "load_bytes": 0}
    self.load_latencies: list[float] = []

  # ---- writer ---------------------------------------------------------------------------------
  def publish(self, version: int, params) -> None:
    """Copies params to the host and commits them in the background; returns at once."""
    self._join_pending()
    newest = max(fmt.complete_versions(self.directory), default=-1)
    with self._cond:
      self._check_newer(version, max(self._version, newest))
    if jax.tree.structure(params) != self._treedef:
      raise ValueError("publish: params do not have the channel's tree structure")
    began = time.perf_counter()
    host = [np.array(leaf, copy=True) for leaf in jax.tree.leaves(jax.device_get(params))]
    leaves = delta_lib.cast_leaves(host, self.rollout_dtype)
    self._pending = threading.Thread(target=self._commit, args=(version, leaves, began),
                                     name=f"weights-commit-{version}", daemon=True)
    self._pending.start()

  def _records(self, version: int, leaves) -> tuple[str, list[delta_lib.LeafDelta], int]:
    """(kind, records, changed elements against the last committed version)."""
    previous = None if self._committed is None else self._committed[1]
    records = None if previous is None else delta_lib.encode(previous, leaves)
    changed = -1 if records is None else delta_lib.changed_elements(records)
    asked = fmt.take_full_requests(self.directory)
    if self.delta and records is not None and version % self.full_every and not asked:
      return "delta", records, changed
    dense = [delta_lib.LeafDelta(i, delta_lib.DENSE, leaf.size, delta_lib.bits(leaf))
             for i, leaf in enumerate(leaves)]
    return "full", dense, changed

  def _commit(self, version: int, leaves: list[np.ndarray], began: float) -> None:
    staged = None
    try:
      kind, records, changed = self._records(version, leaves)
      crcs = [delta_lib.leaf_crc(leaf) for leaf in leaves]
      payload, entries = fmt.pack_records(records)
      manifest = {
          "format": fmt.FORMAT, "version": version, "kind": kind,
          "base_version": self._committed[0] if kind == "delta" else None,
          "published_at": time.time(),
          "digest": delta_lib.version_digest([x.shape for x in leaves],
                                             [x.dtype.name for x in leaves], crcs),
          "leaves": [{"shape": list(x.shape), "dtype": x.dtype.name, "crc": crc}
                     for x, crc in zip(leaves, crcs)],
          "records": entries, "payload_bytes": int(payload.size)}
      staged = fmt.stage(self.directory, manifest, payload)
      faults.point("sync.stage")  # staged and checked, not yet visible
      fmt.flip(self.directory, staged, version)
      staged = None
      self._after_flip(version, leaves, manifest, changed)
      self._announce(version, time.perf_counter() - began, int(payload.size))
      self._failed_in_a_row = 0
    except BaseException as error:
      if staged is not None:
        fmt.discard(staged)
      self.publish_counts["failed"] += 1
      self._failed_in_a_row += 1
      self.log(f"weight store: publishing version {version} failed ({error!r}); the rollout "
               "side stays on the last complete version")
      if self._failed_in_a_row >= MAX_FAILED_PUBLISHES:
        self._error = error

  def _after_flip(self, version: int, leaves, manifest: dict, changed: int) -> None:
    self._committed = (version, leaves)
    elements = sum(leaf.size for leaf in leaves)
    counts = self.publish_counts
    counts[manifest["kind"]] += 1
    counts["full_bytes"] += sum(leaf.nbytes for leaf in leaves)
    if changed >= 0:
      counts["changed"] += changed
      counts["elements"] += elements
      self.densities.append(changed / max(elements, 1))
    line = {"version": version, "kind": manifest["kind"], "digest": manifest["digest"],
            "bytes": manifest["payload_bytes"], "changed": changed, "elements": elements}
    with open(os.path.join(self.directory, "published.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps(line) + "\n")
    self._prune(version)

  def _prune(self, newest: int) -> None:
    """Keeps the last KEEP_LAST versions and every version from the second newest full one on
    (a reader may be part way along that chain)."""
    versions = fmt.complete_versions(self.directory)
    fulls = [v for v in versions if fmt.is_full(self.directory, v)]
    floor = min(fulls[-2] if len(fulls) >= 2 else fulls[0] if fulls else newest,
                newest - KEEP_LAST + 1)
    for version in versions:
      if version < floor:
        fmt.discard(fmt.version_dir(self.directory, version))

  def _join_pending(self, timeout: float = JOIN_TIMEOUT_S) -> None:
    if self._pending is not None:
      self._pending.join(timeout)
      if self._pending.is_alive():
        raise TimeoutError(f"committing weights under {self.directory} took over {timeout} s")
      self._pending = None
    if self._error is not None:
      error, self._error = self._error, None
      raise RuntimeError(f"{MAX_FAILED_PUBLISHES} publishes in a row to {self.directory} "
                         "failed") from error

  def metrics(self) -> dict[str, float]:
    out = super().metrics()
    counts = self.publish_counts
    out.update({"sync/publishes_full": float(counts["full"]),
                "sync/publishes_delta": float(counts["delta"]),
                "sync/publish_failed": float(counts["failed"]),
                "sync/full_bytes": float(counts["full_bytes"])})
    if self.densities:
      out["sync/delta_density"] = self.densities[-1]
      out["sync/delta_density_mean"] = counts["changed"] / max(counts["elements"], 1)
    return out

  # ---- reader ---------------------------------------------------------------------------------
  def latest_version(self) -> int:
    """The newest version this end can load now (the writer's end: the newest it published)."""
    if self._committed is not None or self._pending is not None:
      with self._cond:
        return self._version
    versions = fmt.complete_versions(self.directory)
    held = -1 if self._held is None else self._held[0]
    if not versions or time.monotonic() < self._retry_at:
      return held
    if self._blocked_from is None:
      return versions[-1]
    fulls = [v for v in versions if v >= self._blocked_from and fmt.is_full(self.directory, v)]
    return versions[-1] if fulls else held

  def wait_for_version(self, newer_than: int, timeout: float) -> int:
    return self._poll_for_version(newer_than, timeout, POLL_S)

  def fetch(self):
    """(version, params on this process's devices) of the newest version this end can load."""
    with self._reader_lock:
      for attempt in range(FIRST_LOAD_TRIES):
        target = self.latest_version()
        if self._held is not None and self._held[0] >= target:
          return self._held[:2]
        if target < 0:
          raise LookupError(f"no weights under {self.directory}")
        try:
          return self._load_and_place(target)
        except Exception as error:  # counted; the version held stays in use
          self.load_counts["load_failed"] += 1
          self._retry_at = time.monotonic() + LOAD_RETRY_S
          self.log(f"weight store: loading version {target} failed ({error!r})")
          if self._held is not None:
            return self._held[:2]
          if attempt + 1 == FIRST_LOAD_TRIES:
            raise
          time.sleep(LOAD_RETRY_S)
      raise AssertionError("unreachable")

  def _load_and_place(self, target: int):
    self._loading = (target, time.monotonic())
    try:
      faults.point("sync.load")
      manifest = self._load(target)
      host = jax.tree.unflatten(self._treedef, self._mirror)
      if self.rollout_mesh is None:
        params = jax.device_put(host)
      else:
        params = jax.device_put(host, sharding.param_shardings(self.logical_axes, host,
                                                               self.rollout_mesh))
      jax.block_until_ready(params)
    finally:
      self._loading = None
    version = manifest["version"]
    digest = self._digest()
    if digest != manifest["digest"]:  # every leaf was checked: this would be a bug here
      raise fmt.CorruptVersion(f"version {version}: digest {digest}, manifest "
                               f"{manifest['digest']}")
    self._held = (version, params, digest)
    latency = max(0.0, time.time() - manifest["published_at"])
    self.load_latencies.append(latency)
    self.load_counts["loads"] += 1
    self._log_load(version, digest, latency)
    return version, params

  def _load(self, target: int) -> dict:
    """Brings the mirror to `target`; returns that version's manifest."""
    versions = fmt.complete_versions(self.directory)

    def chain(after: int) -> list[int]:  # each delta's base is the complete version before it
      return [v for v in versions if after < v <= target]

    start = self._mirror_version
    # Versions go only as a prefix: when `start` is still there, so is every later one.
    if start is not None and self._blocked_from is None and start in versions:
      try:
        return self._apply_chain(chain(start))
      except (fmt.CorruptVersion, delta_lib.DeltaMismatch) as error:
        self._on_bad_delta(error)
        if self._mirror is not None:
          raise  # the mirror is whole at an older version: wait there for a full version
    fulls = [v for v in versions if v <= target and fmt.is_full(self.directory, v)]
    if not fulls:
      raise LookupError(f"no full version at or below {target} under {self.directory}")
    self._mirror = None
    manifest = self._apply_chain([fulls[-1]])
    if target == fulls[-1]:
      return manifest
    try:
      return self._apply_chain(chain(fulls[-1]))
    except (fmt.CorruptVersion, delta_lib.DeltaMismatch) as error:
      self._on_bad_delta(error)
      raise

  def _apply_chain(self, versions) -> dict:
    """Applies the versions in turn; returns the manifest of the version the mirror holds."""
    manifest = self._mirror_manifest
    for version in versions:
      manifest, records, nbytes = fmt.read_version(self.directory, version)
      crcs = [leaf["crc"] for leaf in manifest["leaves"]]
      if manifest["kind"] == "full":
        self._mirror = [np.empty(leaf["shape"], delta_lib.dtype_of(leaf["dtype"]))
                        for leaf in manifest["leaves"]]
        kind = "loads_full"
      else:
        self._check_base(manifest, records, crcs)
        kind = "loads_delta"
      self._mirror_version = None  # partly written until every record is applied and checked
      try:
        delta_lib.apply(self._mirror, records, crcs)
      except delta_lib.DeltaMismatch:
        self._mirror = None
        raise
      self._mirror_version, self._mirror_crcs = version, crcs
      self._mirror_manifest = manifest
      self.load_counts[kind] += 1
      self.load_counts["load_bytes"] += nbytes
    if self._blocked_from is not None and manifest["version"] >= self._blocked_from:
      self._blocked_from = None
    return manifest

  def _check_base(self, manifest: dict, records, crcs) -> None:
    """A delta applies only to its base version, and the leaves it leaves alone must already
    hold the new version's CRCs."""
    if self._mirror is None or manifest["base_version"] != self._mirror_version:
      raise delta_lib.DeltaMismatch(f"version {manifest['version']} is a delta against "
                                    f"{manifest['base_version']}, this end holds "
                                    f"{self._mirror_version}")
    touched = {record.leaf for record in records}
    for leaf, (held, new) in enumerate(zip(self._mirror_crcs, crcs, strict=True)):
      if leaf not in touched and held != new:
        raise delta_lib.DeltaMismatch(f"version {manifest['version']}: leaf {leaf} has no "
                                      "record but its CRC-32 changed")

  _mirror_version: int | None = None
  _mirror_manifest: dict | None = None
  _mirror_crcs: list[int] | None = None

  def _on_bad_delta(self, error: Exception) -> None:
    """A delta failed its checks: counted, and the writer asked for a full version."""
    self.load_counts["delta_fallbacks"] += 1
    newest = max(fmt.complete_versions(self.directory), default=0)
    self._blocked_from = newest + 1
    fmt.request_full(self.directory, self.name)
    self.log(f"weight store: {error}; asked for a full version")

  def _digest(self) -> str:
    return delta_lib.version_digest([x.shape for x in self._mirror],
                                    [x.dtype.name for x in self._mirror], self._mirror_crcs)

  def _log_load(self, version: int, digest: str, latency: float) -> None:
    path = os.path.join(self.directory, "loads")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, f"{self.name}.jsonl"), "a", encoding="utf-8") as f:
      f.write(json.dumps({"version": version, "digest": digest, "latency_s": latency}) + "\n")

  def reader_state(self) -> dict:
    """For the server's health: the version held, its digest, a load in flight, counts."""
    loading = self._loading
    latencies = self.load_latencies
    return {"version": None if self._held is None else self._held[0],
            "digest": None if self._held is None else self._held[2],
            "loading_version": None if loading is None else loading[0],
            "loading_s": None if loading is None else time.monotonic() - loading[1],
            "counts": dict(self.load_counts),
            "load_latency_s_mean": sum(latencies) / len(latencies) if latencies else None}

  def close(self) -> None:
    self._join_pending()
