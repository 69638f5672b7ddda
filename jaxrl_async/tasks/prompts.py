"""Grain pipelines of prompts.

A task's problems are a pure function of their index, so a pipeline is a shuffled range of
indices mapped through `task.problem`:

  MapDataset.range(epoch_size) -> shuffle(seed) -> map(task.problem) -> repeat -> to_iter_dataset

Its iterator yields `base.Problem`s. The iterator's state is only the position in that index
stream, `{'next_index': int}` (grain's PrefetchDatasetIterator), so the elements themselves never
need to be serialised: `it.get_state()` is a dict of plain ints that grain JSON-encodes, and
`it.set_state(state)` on a fresh iterator of the same pipeline continues with the exact next
problem. To checkpoint it with orbax, pass `grain.checkpoint.CheckpointSave(it)` /
`grain.checkpoint.CheckpointRestore(it)` inside `ocp.args.Composite` (see tests/tasks).

A task with its own `prompt_dataset` method (a task over a file's rows, whose epoch is its
rows: `text_task.TextTask`) makes the pipeline itself.

Each epoch is the same `epoch_size` problems; with `shuffle` every epoch visits them in a new
order (grain reseeds the shuffle with the epoch number), so a prompt_id repeats once per epoch.
"""

from __future__ import annotations

import grain
import numpy as np

from jaxrl_async.tasks import base

DEFAULT_EPOCH_SIZE = 1 << 20


def default_read_options() -> grain.ReadOptions:
  """Problems are made in microseconds in the consumer's thread: prefetch threads would only
  contend for the GIL with the roles (grain's advice for in-memory data)."""
  return grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)


class _ProblemAt:
  """index -> task.problem(index, split); a class rather than a lambda so the pipeline pickles
  (grain's multiprocessing prefetch sends it to worker processes)."""

  def __init__(self, task: base.Task, split: str):
    self.task, self.split = task, split

  def __call__(self, index) -> base.Problem:
    return self.task.problem(int(index), self.split)


def prompt_dataset(task: base.Task, *, seed: int, split: str = "train", shuffle: bool = True,
                   num_epochs: int | None = None, epoch_size: int = DEFAULT_EPOCH_SIZE,
                   read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
  """An IterDataset of `task.problem(i, split)` over a (shuffled) range of indices.

  Args:
    task: any `base.Task`.
    seed: the shuffle seed, in [0, 2**32 - 1]; the same seed gives the same order.
    split: 'train' or 'eval'.
    shuffle: if False, indices come in order 0, 1, 2, ... every epoch.
    num_epochs: epochs of `epoch_size` problems; None repeats forever.
    epoch_size: indices per epoch (a virtual epoch: problems are generated, not stored).
    read_options: grain read options; default: no prefetch threads (see default_read_options).
  """
  base.check_split(split)
  own_pipeline = getattr(task, "prompt_dataset", None)
  if own_pipeline is not None:  # a task over stored rows (text_task.TextTask) has its own
    if epoch_size != DEFAULT_EPOCH_SIZE:
      raise ValueError(f"epoch_size={epoch_size} does not apply to {type(task).__name__}: an "
                       f"epoch is its rows")
    return own_pipeline(seed=seed, split=split, shuffle=shuffle, num_epochs=num_epochs,
                        read_options=read_options or default_read_options())
  if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an int in [0, 2**32 - 1], got {seed!r}")
  if not isinstance(epoch_size, (int, np.integer)) or epoch_size < 1:
    raise ValueError(f"epoch_size must be an int >= 1, got {epoch_size!r}")
  if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
    raise ValueError(f"num_epochs must be None or an int >= 1, got {num_epochs!r}")
  indices = grain.MapDataset.range(int(epoch_size))
  if shuffle:
    indices = indices.shuffle(seed=int(seed))
  problems = indices.map(_ProblemAt(task, split))
  problems = problems.repeat(num_epochs)
  return problems.to_iter_dataset(read_options or default_read_options())


def shard_prompt_dataset(task: base.Task, *, seed: int, shard_index: int, shard_count: int,
                         epoch_size: int = DEFAULT_EPOCH_SIZE) -> grain.IterDataset:
  """Shard `shard_index` of the training prompts: every `shard_count`-th index of the shuffled
  epoch, so shards are disjoint and together are the whole epoch (shard 0 of 1 is the
  pipeline of `prompt_dataset`). Past the first epoch its repeat does not follow the single
  stream's reshuffled epochs; rollout servers draw `prompt_stream.StreamShard`, which does (and
  which a fleet of another size can continue)."""
  if not isinstance(shard_count, int) or shard_count < 1:
    raise ValueError(f"shard_count must be an int >= 1, got {shard_count!r}")
  if not isinstance(shard_index, int) or not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be an int in [0, {shard_count}), got {shard_index!r}")
  if shard_count == 1:
    return prompt_dataset(task, seed=seed)
  if getattr(task, "prompt_dataset", None) is not None:
    raise ValueError(f"{type(task).__name__} makes its own prompt pipeline: give each rollout "
                     "server its shard through the task (shard_index, shard_count) and use "
                     "num_rollout_servers=1")
  indices = grain.MapDataset.range(int(epoch_size)).shuffle(seed=int(seed))
  indices = indices[shard_index::shard_count]
  problems = indices.map(_ProblemAt(task, "train")).repeat(None)
  return problems.to_iter_dataset(default_read_options())
