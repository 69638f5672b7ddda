"""Delta publishes: the elements of each leaf that changed since the previous version.

Pure numpy, no I/O. A leaf is compared by its bits (as unsigned ints of its item size), so the
comparison is exact for every value, NaN and -0.0 included, and applying a delta reproduces the
new version bit for bit. Each leaf's change is one record:

  'sparse': positions (flat indices, uint32, or uint64 for leaves of 2**32 elements or more)
            and the new values' bits at those positions;
  'dense':  every element's bits (the whole leaf), when that is fewer bytes than sparse.

A leaf with no change has no record. Under RL learning rates a few percent of bf16 elements
change per version, so sparse records carry most leaves; float32 leaves change almost everywhere
(Adam moves every weight a little) and go dense. Integrity: CRC-32 per leaf of the result
(`leaf_crc`, zlib's polynomial) and a digest of a whole version (`version_digest`); the store
channel checks both (sync/store_channel.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import zlib

import ml_dtypes
import numpy as np

UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SPARSE, DENSE = "sparse", "dense"


class DeltaMismatch(ValueError):
  """A delta does not fit the leaves it is applied to, or its result fails its checksum."""


def bits(array: np.ndarray) -> np.ndarray:
  """The leaf's elements as unsigned ints of the same width, flat (a view where possible)."""
  array = np.ascontiguousarray(array)
  if array.dtype.itemsize not in UINTS:
    raise TypeError(f"cannot take the bits of dtype {array.dtype} (item size "
                    f"{array.dtype.itemsize}); supported item sizes: {sorted(UINTS)}")
  return array.reshape(-1).view(UINTS[array.dtype.itemsize])


def position_dtype(size: int) -> np.dtype:
  return np.dtype(np.uint32 if size <= np.iinfo(np.uint32).max else np.uint64)


def leaf_crc(array: np.ndarray) -> int:
  """CRC-32 of the leaf's bytes in C order."""
  return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8))


def version_digest(shapes, dtypes, crcs) -> str:
  """One string naming a version's content: SHA-256 over every leaf's shape, dtype and CRC."""
  digest = hashlib.sha256()
  for shape, dtype, crc in zip(shapes, dtypes, crcs, strict=True):
    digest.update(f"{tuple(shape)}|{np.dtype(dtype).name}|{int(crc)};".encode())
  return digest.hexdigest()[:32]


@dataclasses.dataclass(frozen=True)
class LeafDelta:
  """The change of leaf `leaf`: `values` (bits) at `positions`, or every element (`dense`)."""

  leaf: int
  encoding: str  # SPARSE or DENSE
  changed: int  # elements whose bits changed
  values: np.ndarray  # uint bits, flat
  positions: np.ndarray | None = None  # SPARSE only

  @property
  def nbytes(self) -> int:
    return self.values.nbytes + (0 if self.positions is None else self.positions.nbytes)


def encode_leaf(leaf: int, previous: np.ndarray, current: np.ndarray) -> LeafDelta | None:
  """The record turning `previous` into `current` (same shape and dtype); None: no change."""
  if previous.shape != current.shape or previous.dtype != current.dtype:
    raise DeltaMismatch(f"leaf {leaf}: previous {previous.shape} {previous.dtype} and current "
                        f"{current.shape} {current.dtype} differ in shape or dtype")
  old, new = bits(previous), bits(current)
  positions = np.flatnonzero(old != new)
  if positions.size == 0:
    return None
  pos_dtype = position_dtype(new.size)
  sparse_bytes = positions.size * (pos_dtype.itemsize + new.dtype.itemsize)
  if sparse_bytes >= new.nbytes:
    return LeafDelta(leaf, DENSE, int(positions.size), new.copy())
  return LeafDelta(leaf, SPARSE, int(positions.size), new[positions],
                   positions.astype(pos_dtype))


def encode(previous: list[np.ndarray], current: list[np.ndarray]) -> list[LeafDelta]:
  """One record per changed leaf, in leaf order."""
  if len(previous) != len(current):
    raise DeltaMismatch(f"previous has {len(previous)} leaves, current {len(current)}")
  records = (encode_leaf(i, old, new) for i, (old, new) in enumerate(zip(previous, current)))
  return [record for record in records if record is not None]


def apply_leaf(target: np.ndarray, record: LeafDelta) -> None:
  """Writes the record into `target` (a writable, C-contiguous leaf) in place."""
  if not (target.flags.c_contiguous and target.flags.writeable):
    raise DeltaMismatch(f"leaf {record.leaf}: the target must be writable and C-contiguous")
  flat = bits(target)
  if record.values.dtype != flat.dtype:
    raise DeltaMismatch(f"leaf {record.leaf}: values of {record.values.dtype} for a leaf of "
                        f"{target.dtype}")
  if record.encoding == DENSE:
    if record.values.size != flat.size:
      raise DeltaMismatch(f"leaf {record.leaf}: {record.values.size} dense values for a leaf "
                          f"of {flat.size} elements")
    flat[:] = record.values
    return
  positions = record.positions
  if positions is None or positions.size != record.values.size:
    raise DeltaMismatch(f"leaf {record.leaf}: sparse record with positions "
                        f"{None if positions is None else positions.size} != values "
                        f"{record.values.size}")
  if positions.size and int(positions.max()) >= flat.size:
    raise DeltaMismatch(f"leaf {record.leaf}: position {int(positions.max())} is out of its "
                        f"{flat.size} elements")
  flat[positions] = record.values


def apply(leaves: list[np.ndarray], records: list[LeafDelta], crcs: list[int]) -> None:
  """Applies the records in place and checks each changed leaf against `crcs` (the new
  version's CRC per leaf); raises DeltaMismatch naming the first leaf that does not match
  (the leaves are then partly written: the caller reloads a full version)."""
  for record in records:
    if not 0 <= record.leaf < len(leaves):
      raise DeltaMismatch(f"record for leaf {record.leaf} of {len(leaves)} leaves")
    apply_leaf(leaves[record.leaf], record)
    got = leaf_crc(leaves[record.leaf])
    if got != crcs[record.leaf]:
      raise DeltaMismatch(f"leaf {record.leaf}: CRC-32 {got:#010x} after the delta, the "
                          f"version says {crcs[record.leaf]:#010x}")


def changed_elements(records: list[LeafDelta]) -> int:
  return sum(record.changed for record in records)


def cast_leaves(leaves: list[np.ndarray], dtype: str | None) -> list[np.ndarray]:
  """Floating leaves in `dtype` (round to nearest even, as XLA casts); None: unchanged."""
  if dtype is None:
    return [np.ascontiguousarray(leaf) for leaf in leaves]
  target = dtype_of(dtype)
  return [np.ascontiguousarray(leaf.astype(target) if is_float(leaf.dtype) else leaf)
          for leaf in leaves]


def dtype_of(name: str) -> np.dtype:
  """np.dtype of a name, 'bfloat16' included."""
  return np.dtype(getattr(ml_dtypes, name, name))


def is_float(dtype) -> bool:
  return np.issubdtype(dtype, np.floating) or np.dtype(dtype) in FLOAT16S


FLOAT16S = (np.dtype(ml_dtypes.bfloat16),)
