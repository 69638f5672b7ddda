"""Bad arguments fail at once with the argument's name, the bad value and the allowed range."""

from __future__ import annotations

import pytest

from jaxrl_async.buffer import BufferDataset, VersionedBuffer

from .factory import make_buffer, make_sample

GOOD = dict(group_size=4, groups_per_version=2, staleness_threshold=0.5, max_version_gap=2,
            capacity=12)


@pytest.mark.parametrize("override, match", [
    ({"staleness_threshold": -0.1}, r"staleness_threshold=-0.1 must be a finite number >= 0"),
    ({"staleness_threshold": float("nan")}, r"staleness_threshold=nan must be"),
    ({"group_size": 0}, r"group_size=0 must be an int >= 1"),
    ({"groups_per_version": 0}, r"groups_per_version=0 must be an int >= 1"),
    ({"max_version_gap": -1}, r"max_version_gap=-1 must be None \(no bound\) or an int >= 0"),
    ({"capacity": 11}, r"capacity=11 must be an int >= group_size \* floor\(.*\) = 4 \* 3 = 12"),
])
def test_constructor_rejects(override, match):
  VersionedBuffer(**GOOD)  # the baseline is valid
  with pytest.raises(ValueError, match=match):
    VersionedBuffer(**{**GOOD, **override})


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf")])
def test_every_blocking_call_rejects_bad_timeout(timeout):
  buffer = make_buffer()
  match = rf"timeout={timeout!r} must be a finite number of seconds > 0"
  with pytest.raises(ValueError, match=rf"acquire_group_slot: {match}"):
    buffer.acquire_group_slot(timeout)
  with pytest.raises(ValueError, match=rf"put: {match}"):
    buffer.put(make_sample(0, 0, 2), timeout)
  with pytest.raises(ValueError, match=rf"get_groups: {match}"):
    buffer.get_groups(1, 0, timeout)
  with pytest.raises(ValueError, match=r"timeout=.* must be a finite number of seconds > 0"):
    BufferDataset(buffer, groups_per_batch=1, learner_version_fn=lambda: 0, timeout=timeout)
  assert buffer.counts["put"] == 0 and buffer.counts["admitted_groups"] == 0


def test_unknown_drop_reason():
  buffer = make_buffer()
  with pytest.raises(ValueError, match=r"reason='oops' is not a drop reason; allowed: \['stale'"):
    buffer.discard_queued("oops")


@pytest.mark.parametrize("num_groups", [0, 3])
def test_get_groups_rejects_impossible_num_groups(num_groups):
  buffer = make_buffer(group_size=2, groups_per_version=2)  # capacity 4 = 2 groups
  with pytest.raises(ValueError, match=rf"num_groups={num_groups} must be an int in \[1, .* 2\]"):
    buffer.get_groups(num_groups, 0, 1.0)


def test_dataset_rejects_bad_groups_per_batch():
  with pytest.raises(ValueError, match="groups_per_batch=0 must be an int >= 1"):
    BufferDataset(make_buffer(), groups_per_batch=0, learner_version_fn=lambda: 0, timeout=1.0)
