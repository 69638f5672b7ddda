"""BufferDataset: a grain IterDataset over the buffer; composes with grain and checkpoints."""

from __future__ import annotations

import json

import grain
import orbax.checkpoint as ocp
import pytest

from jaxrl_async.buffer import (
  BufferDataset,
  BufferTimeout,
  checkpoint_restore_args,
  checkpoint_save_args,
)

from .factory import make_buffer, make_group, make_sample, put_group


def _filled_buffer(num_groups: int, group_size: int = 2, version: int = 0, **kwargs):
  buffer = make_buffer(group_size=group_size, groups_per_version=num_groups, **kwargs)
  for group_id in range(num_groups):
    buffer.acquire_group_slot(1.0)
    put_group(buffer, make_group(group_id, group_size, version=version))
  return buffer


def test_yields_lists_of_whole_groups_and_counts_state():
  buffer = _filled_buffer(6)
  dataset = BufferDataset(buffer, groups_per_batch=2, learner_version_fn=lambda: 0,
                          timeout=0.05)
  assert isinstance(dataset, grain.IterDataset)
  iterator = iter(dataset)
  assert isinstance(iterator, grain.DatasetIterator)
  batches = [next(iterator) for _ in range(3)]
  assert [[group[0].group_id for group in batch] for batch in batches] == [[0, 1], [2, 3], [4, 5]]
  assert all(len(group) == 2 for batch in batches for group in batch)
  state = iterator.get_state()
  assert state == {"batches": 3, "groups": 6, "samples": 12}
  assert json.loads(json.dumps(state)) == state
  with pytest.raises(BufferTimeout):
    next(iterator)  # an empty buffer times out, it does not end the stream
  buffer.close()
  with pytest.raises(StopIteration):
    next(iterator)  # a closed buffer ends it


def test_learner_version_read_at_every_next():
  buffer = make_buffer(group_size=1, groups_per_version=2, staleness_threshold=1.0,
                       max_version_gap=0)
  learner = {"version": 0}
  dataset = BufferDataset(buffer, groups_per_batch=1,
                          learner_version_fn=lambda: learner["version"], timeout=0.05)
  iterator = iter(dataset)
  for group_id in range(2):
    buffer.acquire_group_slot(1.0)
    buffer.put(make_sample(group_id, 0, 1, (0,)), 1.0)
  assert next(iterator)[0][0].group_id == 0
  learner["version"] = 1  # group 1 (version 0) is now too old
  with pytest.raises(BufferTimeout):
    next(iterator)
  assert buffer.counts["dropped"]["stale"] == 1


def test_composes_with_map_and_batch():
  buffer = _filled_buffer(8)
  dataset = BufferDataset(buffer, groups_per_batch=2, learner_version_fn=lambda: 0, timeout=1.0)
  flat = dataset.map(lambda groups: [s.uid for group in groups for s in group])
  pipeline = flat.batch(2, batch_fn=list)
  iterator = iter(pipeline)
  first = next(iterator)
  assert first == [[(0, 0), (0, 1), (1, 0), (1, 1)], [(2, 0), (2, 1), (3, 0), (3, 1)]]
  assert iterator.get_state() == {"batches": 2, "groups": 4, "samples": 8}


def test_composed_iterator_checkpoints_with_buffer_in_one_composite(tmp_path):
  buffer = _filled_buffer(8)
  dataset = BufferDataset(buffer, groups_per_batch=1, learner_version_fn=lambda: 0, timeout=1.0)
  pipeline = dataset.map(lambda groups: groups[0][0].group_id)
  iterator = iter(pipeline)
  assert [next(iterator) for _ in range(3)] == [0, 1, 2]
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(5, args=ocp.args.Composite(**checkpoint_save_args(buffer, iterator)))
    manager.wait_until_finished()
  expected_rest = [next(iterator) for _ in range(5)]

  fresh = make_buffer(group_size=2, groups_per_version=8)
  fresh_iterator = iter(BufferDataset(fresh, groups_per_batch=1, learner_version_fn=lambda: 0,
                                      timeout=1.0).map(lambda groups: groups[0][0].group_id))
  with ocp.CheckpointManager(tmp_path) as manager:
    restored = manager.restore(5, args=ocp.args.Composite(**checkpoint_restore_args(
        fresh_iterator)))
  fresh.set_state(restored["buffer"])
  assert fresh_iterator.get_state() == {"batches": 3, "groups": 3, "samples": 6}
  assert [next(fresh_iterator) for _ in range(5)] == expected_rest
  assert fresh.counts["consumed"] == buffer.counts["consumed"] == 16
  fresh.check_invariants()
