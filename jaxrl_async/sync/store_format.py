"""The on-disk form of a published version in the weight store (sync/store_channel.py).

    <directory>/<version>/manifest.json   what the version is (below)
    <directory>/<version>/payload/        one flat uint8 zarr array, written with tensorstore
    <directory>/<version>/FULL            present when the version is a full publish
    <directory>/.staging/<version>-<tag>/ a version being written (never read)
    <directory>/full_requests/<name>      a reader asks for the next publish to be full

A version is written under `.staging/`, read back and checked against its CRCs, then renamed to
`<directory>/<version>`: the rename is the atomic flip (POSIX rename of a directory on one file
system), so an integer-named directory is always a complete, checked version and a publish that
fails half way is never seen. The manifest:

  {"format": 1, "version": v, "kind": "full" | "delta", "base_version": b (delta) | null,
   "published_at": wall-clock seconds of the flip's start, "digest": version_digest,
   "leaves": [{"shape", "dtype", "crc"}]  (every leaf of the version, the result),
   "records": [{"leaf", "encoding", "changed", "offset", "positions_bytes", "values_bytes",
                "crc"}]  (payload slices, CRC-32 of each slice), "payload_bytes"}

A full publish has one dense record per leaf; a delta has one record per changed leaf against
version `base_version` (sync/delta.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
import zlib

import numpy as np
import tensorstore as ts

from jaxrl_async.sync import delta as delta_lib

FORMAT = 1
MANIFEST, PAYLOAD, FULL_MARK = "manifest.json", "payload", "FULL"
STAGING, REQUESTS = ".staging", "full_requests"
CHUNK_BYTES = 16 << 20  # payload chunk: large enough that a version is a few files


class CorruptVersion(RuntimeError):
  """A version's files do not match its manifest (a CRC or a size)."""


def version_dir(directory: str, version: int) -> str:
  return os.path.join(directory, str(version))


def complete_versions(directory: str) -> list[int]:
  """The versions that were flipped into place, ascending."""
  try:
    with os.scandir(directory) as entries:
      return sorted(int(e.name) for e in entries if e.name.isdigit() and e.is_dir())
  except FileNotFoundError:
    return []


def is_full(directory: str, version: int) -> bool:
  return os.path.exists(os.path.join(version_dir(directory, version), FULL_MARK))


def _payload_spec(path: str) -> dict:
  return {"driver": "zarr", "kvstore": {"driver": "file", "path": path}}


def write_payload(path: str, payload: np.ndarray) -> None:
  spec = {**_payload_spec(path), "create": True, "delete_existing": True,
          "metadata": {"dtype": "|u1", "shape": [int(payload.size)],
                       "chunks": [max(1, min(int(payload.size), CHUNK_BYTES))],
                       "compressor": None}}
  store = ts.open(spec).result()
  if payload.size:
    store.write(payload).result()


def read_payload(path: str) -> np.ndarray:
  return ts.open(_payload_spec(path), open=True).result().read().result()


def pack_records(records: list[delta_lib.LeafDelta]) -> tuple[np.ndarray, list[dict]]:
  """(the payload: every record's positions then values, as bytes; their manifest entries)."""
  parts, entries, offset = [], [], 0
  for record in records:
    pos = (np.zeros(0, np.uint8) if record.positions is None
           else np.ascontiguousarray(record.positions).view(np.uint8))
    vals = np.ascontiguousarray(record.values).view(np.uint8)
    entries.append({"leaf": record.leaf, "encoding": record.encoding,
                    "changed": record.changed, "offset": offset,
                    "positions_bytes": int(pos.size), "values_bytes": int(vals.size),
                    "position_dtype": None if record.positions is None
                    else record.positions.dtype.name,
                    "crc": zlib.crc32(vals, zlib.crc32(pos))})
    parts += [pos, vals]
    offset += int(pos.size + vals.size)
  payload = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
  return payload, entries


def unpack_records(payload: np.ndarray, manifest: dict) -> list[delta_lib.LeafDelta]:
  """The records of a payload, each slice checked against its CRC (CorruptVersion if not)."""
  if payload.size != manifest["payload_bytes"]:
    raise CorruptVersion(f"version {manifest['version']}: payload of {payload.size} bytes, "
                         f"the manifest says {manifest['payload_bytes']}")
  records = []
  for entry in manifest["records"]:
    start, npos = entry["offset"], entry["positions_bytes"]
    pos = payload[start:start + npos]
    vals = payload[start + npos:start + npos + entry["values_bytes"]]
    if zlib.crc32(vals, zlib.crc32(pos)) != entry["crc"]:
      raise CorruptVersion(f"version {manifest['version']}: record of leaf {entry['leaf']} "
                           "fails its CRC-32")
    leaf = manifest["leaves"][entry["leaf"]]
    value_dtype = delta_lib.UINTS[np.dtype(delta_lib.dtype_of(leaf["dtype"])).itemsize]
    positions = (None if entry["position_dtype"] is None
                 else pos.view(np.dtype(entry["position_dtype"])))
    records.append(delta_lib.LeafDelta(entry["leaf"], entry["encoding"], entry["changed"],
                                       vals.view(value_dtype), positions))
  return records


def stage(directory: str, manifest: dict, payload: np.ndarray) -> str:
  """Writes a version under `.staging/`, reads it back and checks it; returns its path."""
  path = os.path.join(directory, STAGING, f"{manifest['version']}-{uuid.uuid4().hex[:8]}")
  os.makedirs(path)
  write_payload(os.path.join(path, PAYLOAD), payload)
  with open(os.path.join(path, MANIFEST), "w", encoding="utf-8") as f:
    json.dump(manifest, f)
  if manifest["kind"] == "full":
    open(os.path.join(path, FULL_MARK), "w").close()
  unpack_records(read_payload(os.path.join(path, PAYLOAD)), manifest)  # the staging check
  return path


def flip(directory: str, staged: str, version: int) -> None:
  """Makes a staged version visible, atomically."""
  os.rename(staged, version_dir(directory, version))


def discard(path: str) -> None:
  shutil.rmtree(path, ignore_errors=True)


def read_version(directory: str, version: int) -> tuple[dict, list[delta_lib.LeafDelta], int]:
  """(manifest, records checked against their CRCs, payload bytes read) of a complete version."""
  path = version_dir(directory, version)
  with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
    manifest = json.load(f)
  if manifest.get("format") != FORMAT or manifest.get("version") != version:
    raise CorruptVersion(f"{path}: manifest of format {manifest.get('format')} version "
                         f"{manifest.get('version')}, expected format {FORMAT} version {version}")
  payload = read_payload(os.path.join(path, PAYLOAD))
  return manifest, unpack_records(payload, manifest), int(payload.size)


def request_full(directory: str, name: str) -> None:
  os.makedirs(os.path.join(directory, REQUESTS), exist_ok=True)
  open(os.path.join(directory, REQUESTS, name), "w").close()


def take_full_requests(directory: str) -> list[str]:
  """The readers that asked for a full publish since the last call (their requests removed)."""
  path = os.path.join(directory, REQUESTS)
  try:
    names = os.listdir(path)
  except FileNotFoundError:
    return []
  for name in names:
    with contextlib.suppress(FileNotFoundError):
      os.remove(os.path.join(path, name))
  return names
