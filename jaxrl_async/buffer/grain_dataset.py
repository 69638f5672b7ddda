"""The buffer as a grain `IterDataset`, and orbax checkpoints of buffer + data iterator.

`BufferDataset(buffer, groups_per_batch=..., learner_version_fn=..., timeout=...)` yields, per
`next()`, one list of `groups_per_batch` groups (each a list of `group_size` Samples), exactly
what `VersionedBuffer.get_groups` returns: group structure is what GRPO advantages need, and
`.map` / `.batch(batch_fn=...)` can flatten or pack it. The learner version is read at every
`next()`, so the age bound holds against the learner's current version. A closed buffer ends
the iteration (StopIteration); a timeout raises BufferTimeout.

Do not put a prefetch (`.prefetch`, `.mp_prefetch`, thread prefetch) on this dataset: it would
take groups from the buffer ahead of the learner, against an old learner version, and groups
taken but not yet yielded are in no checkpoint.

Checkpoints: the queued samples live in the buffer's state (`VersionedBuffer.get_state`, saved
as `ocp.args.JsonSave`); the iterator's state holds only counts of what it yielded (plain ints,
JSON-encoded by grain). Both go in one `ocp.args.Composite`, taken between two `next()` calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grain
import orbax.checkpoint as ocp
from etils import epath

from jaxrl_async.buffer.errors import BufferClosed, is_finite_real, is_int
from jaxrl_async.buffer.versioned_buffer import VersionedBuffer
from jaxrl_async.types import Sample

BUFFER_ITEM = "buffer"
DATA_ITERATOR_ITEM = "data_iterator"


class BufferDataset(grain.IterDataset):
  """An endless IterDataset over a VersionedBuffer: one element = a list of groups."""

  def __init__(self, buffer: VersionedBuffer, *, groups_per_batch: int,
               learner_version_fn: Callable[[], int], timeout: float):
    super().__init__()
    if not is_int(groups_per_batch) or groups_per_batch < 1:
      raise ValueError(f"groups_per_batch={groups_per_batch!r} must be an int >= 1")
    if not (is_finite_real(timeout) and timeout > 0):
      raise ValueError(f"timeout={timeout!r} must be a finite number of seconds > 0")
    self.buffer = buffer
    self.groups_per_batch = groups_per_batch
    self.learner_version_fn = learner_version_fn
    self.timeout = float(timeout)

  def __iter__(self) -> BufferDatasetIterator:
    return BufferDatasetIterator(self)

  def __str__(self) -> str:
    return f"BufferDataset(groups_per_batch={self.groups_per_batch}, timeout={self.timeout})"


class BufferDatasetIterator(grain.DatasetIterator):
  """Iterator of BufferDataset; its state counts batches, groups and samples yielded."""

  def __init__(self, dataset: BufferDataset):
    super().__init__()
    self._dataset = dataset
    self._batches = 0
    self._groups = 0
    self._samples = 0

  def __next__(self) -> list[list[Sample]]:
    dataset = self._dataset
    try:
      groups = dataset.buffer.get_groups(dataset.groups_per_batch, dataset.learner_version_fn(),
                                         dataset.timeout)
    except BufferClosed:
      raise StopIteration from None
    self._batches += 1
    self._groups += len(groups)
    self._samples += sum(len(group) for group in groups)
    return groups

  def get_state(self) -> dict[str, Any]:
    return {"batches": self._batches, "groups": self._groups, "samples": self._samples}

  def set_state(self, state: dict[str, Any]) -> None:
    self._batches = int(state["batches"])
    self._groups = int(state["groups"])
    self._samples = int(state["samples"])

  def __str__(self) -> str:
    return f"BufferDatasetIterator({self.get_state()})"


def checkpoint_save_args(buffer: VersionedBuffer,
                         iterator: grain.DatasetIterator) -> dict[str, ocp.args.CheckpointArgs]:
  """The two Composite items of a buffer checkpoint, for a caller's own CheckpointManager."""
  return {BUFFER_ITEM: ocp.args.JsonSave(buffer.get_state()),
          DATA_ITERATOR_ITEM: grain.checkpoint.CheckpointSave(iterator)}


def checkpoint_restore_args(
    iterator: grain.DatasetIterator) -> dict[str, ocp.args.CheckpointArgs]:
  return {BUFFER_ITEM: ocp.args.JsonRestore(),
          DATA_ITERATOR_ITEM: grain.checkpoint.CheckpointRestore(iterator)}


# Standalone checkpoints of buffer + iterator. To add them to a larger checkpoint, put the items
# of checkpoint_save_args / checkpoint_restore_args into that checkpoint's own Composite.
def save_buffer_checkpoint(directory: str | epath.PathLike, step: int, buffer: VersionedBuffer,
                           iterator: grain.DatasetIterator) -> None:
  """Writes buffer state and data-iterator state as checkpoint `step` under `directory`."""
  with ocp.CheckpointManager(epath.Path(directory)) as manager:
    manager.save(step, args=ocp.args.Composite(**checkpoint_save_args(buffer, iterator)))
    manager.wait_until_finished()


def restore_buffer_checkpoint(directory: str | epath.PathLike, step: int,
                              buffer: VersionedBuffer, iterator: grain.DatasetIterator) -> None:
  """Restores checkpoint `step` into a fresh `buffer` and an `iterator` over it, in place."""
  with ocp.CheckpointManager(epath.Path(directory)) as manager:
    restored = manager.restore(step, args=ocp.args.Composite(**checkpoint_restore_args(iterator)))
  buffer.set_state(restored[BUFFER_ITEM])
