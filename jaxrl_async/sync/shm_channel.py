"""A weight channel between processes of one host: the flattened params in shared memory.

The learner's process creates the segment (`SharedMemoryWeightChannel.create`), rollout server
processes attach to it by name (`attach`). The segment holds a header and two slots, each one
whole copy of the params:

  header (int64): [latest slot (-1 = none), seq_0, version_0, seq_1, version_1]
  wake word:      int32 at byte 40 of the header, changed at every publish after `latest`
  slot s:         every leaf's bytes, in `jax.tree.leaves` order, each 64-byte aligned

`publish` writes into the slot that is not the latest, under a seqlock: the slot's seq turns odd,
the bytes and the version are written, the seq turns even again, and only then does `latest`
point at it. `fetch` copies the latest slot out and checks that its seq was even and unchanged
across the copy, else copies again: a reader never returns a half-written version. Two slots
mean a reader only retries when two versions are published during one copy. One writer (the
learner) per segment. The ordering relies on the host's stores being seen in program order
(x86-64 and the numpy stores used here; a weaker memory model would need fences).

A reader waiting for a version sleeps on the wake word (a futex, `sync/futex.py`): `publish`
changes it and wakes every waiting process at once, so a new version reaches an idle rollout
server within microseconds instead of half a polling interval. Each sleep lasts at most
`recheck_s` before the header is read again; where futexes are not available the wait polls the
header every `WAIT_POLL_S`.
"""

from __future__ import annotations

import contextlib
import time
from multiprocessing import shared_memory

import jax
import numpy as np

from jaxrl_async import sharding
from jaxrl_async.sync import futex
from jaxrl_async.sync.channel import WeightChannel, _check_timeout

ALIGN = 64
HEADER_BYTES = ALIGN
WAIT_POLL_S = 0.002
# With futexes: the longest one sleep lasts before the header is read again (a safety net only:
# every publish wakes the sleepers).
RECHECK_S = 0.05
_WAKE_WORD_OFFSET = 40
FETCH_RETRIES = 1000
_LATEST = 0


def _seq_index(slot: int) -> int:
  return 1 + 2 * slot


def _version_index(slot: int) -> int:
  return 2 + 2 * slot


def _layout(abstract_params) -> tuple[list[tuple[int, tuple, np.dtype]], int]:
  """(offset in a slot, shape, dtype) per leaf, and the slot's size in bytes."""
  layout, offset = [], 0
  for leaf in jax.tree.leaves(abstract_params):
    dtype = np.dtype(leaf.dtype)
    layout.append((offset, tuple(leaf.shape), dtype))
    size = int(np.prod(leaf.shape, dtype=np.int64)) * dtype.itemsize
    offset += -(-size // ALIGN) * ALIGN
  return layout, max(offset, ALIGN)


class SharedMemoryWeightChannel(WeightChannel):
  """`publish` in the creating process, `fetch` / `wait_for_version` in any process."""

  def __init__(self, segment: shared_memory.SharedMemory, abstract_params, *, owner: bool,
               logical_axes=None, rollout_mesh=None, recheck_s: float | None = None):
    super().__init__()
    if recheck_s is None:
      recheck_s = RECHECK_S if futex.AVAILABLE else WAIT_POLL_S
    _check_timeout(recheck_s)
    self.recheck_s = float(recheck_s)
    self._segment = segment
    self._owner = owner
    self.name = segment.name
    self.abstract_params = abstract_params
    self.logical_axes = logical_axes
    self.rollout_mesh = rollout_mesh
    self._treedef = jax.tree.structure(abstract_params)
    self._leaves, self.slot_bytes = _layout(abstract_params)
    self.nbytes = sum(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                      for _, shape, dtype in self._leaves)
    self._header = np.ndarray((5,), np.int64, buffer=segment.buf, offset=0)
    self._wake_word = futex.word(segment.buf, _WAKE_WORD_OFFSET)
    self._fetched: tuple[int, object] | None = None
    self.retries = 0  # copies thrown away because a publish overlapped them

  @classmethod
  def create(cls, abstract_params, **kwargs) -> SharedMemoryWeightChannel:
    _, slot_bytes = _layout(abstract_params)
    segment = shared_memory.SharedMemory(create=True, size=HEADER_BYTES + 2 * slot_bytes)
    channel = cls(segment, abstract_params, owner=True, **kwargs)
    channel._header[:] = (-1, 0, -1, 0, -1)
    channel._wake_word[0] = 0
    return channel

  @classmethod
  def attach(cls, name: str, abstract_params, **kwargs) -> SharedMemoryWeightChannel:
    segment = shared_memory.SharedMemory(name=name, create=False)
    _, slot_bytes = _layout(abstract_params)
    if segment.size < HEADER_BYTES + 2 * slot_bytes:
      size = segment.size
      segment.close()
      raise ValueError(f"shared memory {name!r} holds {size} bytes, fewer than the "
                       f"{HEADER_BYTES + 2 * slot_bytes} these params need")
    return cls(segment, abstract_params, owner=False, **kwargs)

  def _views(self, slot: int) -> list[np.ndarray]:
    base = HEADER_BYTES + slot * self.slot_bytes
    return [np.ndarray(shape, dtype, buffer=self._segment.buf, offset=base + offset)
            for offset, shape, dtype in self._leaves]

  # ---- writer ---------------------------------------------------------------------------------
  def publish(self, version: int, params) -> None:
    """Copies params into the free slot and makes it the latest; returns once it is."""
    if not self._owner:
      raise RuntimeError("publish() is for the process that created the channel")
    with self._cond:
      self._check_newer(version, self._version)
    if jax.tree.structure(params) != self._treedef:
      raise ValueError("publish: params do not have the channel's tree structure")
    began = time.perf_counter()
    latest = int(self._header[_LATEST])
    slot = 0 if latest < 0 else 1 - latest
    header = self._header
    header[_seq_index(slot)] += 1  # odd: being written
    for view, leaf in zip(self._views(slot), jax.tree.leaves(params)):
      host = np.asarray(jax.device_get(leaf))
      if host.shape != view.shape or host.dtype != view.dtype:
        header[_seq_index(slot)] += 1
        raise ValueError(f"publish: a leaf of shape {host.shape} {host.dtype} where the channel "
                         f"holds {view.shape} {view.dtype}")
      np.copyto(view, host)
    header[_version_index(slot)] = version
    header[_seq_index(slot)] += 1  # even: complete
    header[_LATEST] = slot
    futex.bump_and_wake(self._wake_word)  # after `latest`: a woken reader sees the version
    self._announce(version, time.perf_counter() - began, self.nbytes)

  # ---- readers --------------------------------------------------------------------------------
  def latest_version(self) -> int:
    latest = int(self._header[_LATEST])
    return -1 if latest < 0 else int(self._header[_version_index(latest)])

  def wait_for_version(self, newer_than: int, timeout: float) -> int:
    """Blocks until a version > newer_than is published (by any process) or `timeout`;
    returns the latest. Sleeps on the wake word: no polling where futexes exist."""
    if not futex.AVAILABLE:
      return self._poll_for_version(newer_than, timeout, self.recheck_s)
    _check_timeout(timeout)
    deadline = time.monotonic() + timeout
    while True:
      seen = int(self._wake_word[0])  # before the version: a publish in between changes it
      latest = self.latest_version()
      remaining = deadline - time.monotonic()
      if latest > newer_than or remaining <= 0:
        return latest
      futex.wait(self._wake_word, seen, min(self.recheck_s, remaining))

  def read_host(self) -> tuple[int, object]:
    """(version, params as numpy arrays) of the latest complete version."""
    header = self._header
    for _ in range(FETCH_RETRIES):
      slot = int(header[_LATEST])
      if slot < 0:
        raise LookupError(f"no weights published in shared memory {self.name!r} yet")
      before = int(header[_seq_index(slot)])
      if before % 2 == 0:
        version = int(header[_version_index(slot)])
        leaves = [np.array(view, copy=True) for view in self._views(slot)]
        if int(header[_seq_index(slot)]) == before:
          return version, jax.tree.unflatten(self._treedef, leaves)
      self.retries += 1
    raise RuntimeError(f"shared memory {self.name!r}: no consistent copy in "
                       f"{FETCH_RETRIES} tries (a writer publishing without pause?)")

  def fetch(self):
    """(version, params on this process's devices, with the rollout shardings if set)."""
    latest = self.latest_version()
    if self._fetched is not None and self._fetched[0] == latest:
      return self._fetched
    version, host = self.read_host()
    if self.rollout_mesh is not None:
      target = sharding.param_shardings(self.logical_axes, host, self.rollout_mesh)
      params = jax.device_put(host, target)
    else:
      params = jax.device_put(host)
    self._fetched = (version, params)
    return self._fetched

  def close(self) -> None:
    """Releases this process's mapping; the creator also removes the segment."""
    self._header = None
    self._wake_word = None
    self._fetched = None
    # A numpy view still alive somewhere keeps the mapping; it goes with the view.
    with contextlib.suppress(BufferError):
      self._segment.close()
    if self._owner:
      self._segment.unlink()
      self._owner = False
