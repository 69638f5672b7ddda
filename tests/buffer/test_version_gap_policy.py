"""Which groups a take returns first, and version_gap_policy 'wait' (no drops at the bound)."""

from __future__ import annotations

import threading

import pytest

from jaxrl_async.buffer import BufferTimeout
from jaxrl_async.config import RunConfig

from .factory import make_buffer, make_group, make_sample, put_group


def _admit(buffer, num_groups):
  for _ in range(num_groups):
    buffer.acquire_group_slot(1.0)


def test_take_returns_the_oldest_tokens_first_then_arrival_order():
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=1.0)
  buffer.publish_version(3)
  _admit(buffer, 4)
  put_group(buffer, make_group(20, 2, version=3))
  put_group(buffer, make_group(21, 2, version=2))
  put_group(buffer, make_group(22, 2, version=3))
  put_group(buffer, make_group(23, 2, version=2))
  got = buffer.get_groups(3, 3, 1.0)
  assert [group[0].group_id for group in got] == [21, 23, 20]
  (rest,) = buffer.get_groups(1, 3, 1.0)
  assert rest[0].group_id == 22
  _admit(buffer, 2)
  put_group(buffer, make_group(24, 2, version=3))
  put_group(buffer, make_group(25, 2, version=2))
  every = buffer.get_groups(2, 3, 1.0)  # all that is ready: still oldest first
  assert [group[0].group_id for group in every] == [25, 24]


def test_a_group_without_tokens_counts_as_newest():
  buffer = make_buffer(group_size=1, groups_per_version=2)
  _admit(buffer, 2)
  buffer.put(make_sample(30, 0, 1, token_versions=()), 1.0)
  buffer.put(make_sample(31, 0, 1, token_versions=(0,)), 1.0)
  (first,) = buffer.get_groups(1, 0, 1.0)
  assert first[0].group_id == 31


def _buffer_with_a_straggler(policy, groups_per_version=2):
  """Version 2, bound 1: group 40 (tokens of version 1) still lacks a member; two groups of
  version 2 are ready."""
  buffer = make_buffer(group_size=2, groups_per_version=groups_per_version,
                       staleness_threshold=1.0, max_version_gap=1, version_gap_policy=policy)
  buffer.publish_version(2)
  _admit(buffer, 3)
  straggler = make_group(40, 2, version=1)
  buffer.put(straggler[0], 1.0)
  put_group(buffer, make_group(41, 2, version=2))
  put_group(buffer, make_group(42, 2, version=2))
  return buffer, straggler


def test_drop_takes_what_is_ready_and_the_straggler_is_dropped_later():
  buffer, straggler = _buffer_with_a_straggler("drop")
  got = buffer.get_groups(2, 2, 1.0)
  assert [group[0].group_id for group in got] == [41, 42]
  buffer.put(straggler[1], 1.0)
  with pytest.raises(BufferTimeout):
    buffer.get_groups(1, 3, 0.05)
  assert buffer.counts["dropped_groups"]["stale"] == 1


def test_wait_holds_a_take_until_the_straggler_is_whole_and_returns_it_first():
  buffer, straggler = _buffer_with_a_straggler("wait")
  with pytest.raises(BufferTimeout, match="version_gap_policy 'wait'"):
    buffer.get_groups(2, 2, 0.05)
  timer = threading.Timer(0.1, buffer.put, (straggler[1], 1.0))
  timer.start()
  got = buffer.get_groups(2, 2, 5.0)
  timer.join()
  assert [group[0].group_id for group in got] == [40, 41]  # 40 is whole only after the put
  assert buffer.counts["dropped_groups"]["stale"] == 0
  buffer.check_invariants()


def test_a_take_s_wait_is_counted_under_what_held_it():
  buffer, straggler = _buffer_with_a_straggler("wait")
  with pytest.raises(BufferTimeout):
    buffer.get_groups(3, 2, 0.05)  # two groups ready, three asked for
  waited = buffer.metrics()
  assert waited["queue/take_wait_s/groups"] >= 0.04  # most of the timeout: counted from the loop
  assert waited["queue/take_wait_s/age_bound"] == 0.0
  with pytest.raises(BufferTimeout):
    buffer.get_groups(2, 2, 0.05)  # enough ready, held for the straggler
  held = buffer.metrics()
  assert held["queue/take_wait_s/age_bound"] >= 0.04
  assert held["queue/take_wait_s/groups"] == waited["queue/take_wait_s/groups"]
  buffer.put(straggler[1], 1.0)
  buffer.get_groups(2, 2, 1.0)  # ready at once: no wait added
  assert buffer.metrics()["queue/take_wait_s/age_bound"] == held["queue/take_wait_s/age_bound"]


def test_wait_holds_only_the_take_that_closes_the_version():
  buffer, straggler = _buffer_with_a_straggler("wait", groups_per_version=3)
  _admit(buffer, 1)
  (first,) = buffer.get_groups(1, 2, 1.0)  # 1 of the version's 3 groups: no wait
  assert first[0].group_id == 41
  put_group(buffer, make_group(43, 2, version=2))
  with pytest.raises(BufferTimeout):
    buffer.get_groups(2, 2, 0.05)  # would close version 2 without group 40
  buffer.put(straggler[1], 1.0)
  got = buffer.get_groups(2, 2, 1.0)
  assert [group[0].group_id for group in got] == [40, 42]
  (last,) = buffer.get_groups(1, 3, 1.0)  # a new version: counted from zero again
  assert last[0].group_id == 43


def test_wait_does_not_hold_for_a_group_still_within_the_next_version():
  buffer = make_buffer(group_size=2, groups_per_version=1, staleness_threshold=1.0,
                       max_version_gap=2, version_gap_policy="wait")
  buffer.publish_version(2)
  _admit(buffer, 2)
  # Gap 1 now, 2 at version 3: still consumable after this version's (only) take.
  buffer.put(make_group(50, 2, version=1)[0], 1.0)
  put_group(buffer, make_group(51, 2, version=2))
  (got,) = buffer.get_groups(1, 2, 1.0)
  assert got[0].group_id == 51


def test_wait_is_released_when_the_straggler_is_dropped_for_a_failure():
  buffer, _ = _buffer_with_a_straggler("wait")
  failed = make_sample(40, 1, 2, token_versions=(1, 2), reward_status="failed")
  timer = threading.Timer(0.1, buffer.put, (failed, 1.0))
  timer.start()
  got = buffer.get_groups(2, 2, 5.0)
  timer.join()
  assert [group[0].group_id for group in got] == [41, 42]
  assert buffer.counts["dropped_groups"]["reward_failed"] == 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(version_gap_policy="wait", max_version_gap=None), "needs max_version_gap"),
    (dict(version_gap_policy="block", max_version_gap=2), r"one of \('drop', 'wait'\)"),
])
def test_bad_policies_are_refused_by_name(kwargs, match):
  with pytest.raises(ValueError, match=match):
    make_buffer(**kwargs)
  with pytest.raises(ValueError, match=match):
    RunConfig(mode="async_partial", staleness_threshold=0.5, partial_rollout=True, **kwargs)


def test_wait_holds_for_an_admitted_group_with_nothing_arrived():
  buffer = make_buffer(group_size=2, groups_per_version=1, staleness_threshold=1.0,
                       max_version_gap=1, version_gap_policy="wait")
  buffer.publish_version(1)
  _admit(buffer, 1)  # group 60 will be generated from version 1 on
  buffer.publish_version(2)
  _admit(buffer, 1)
  put_group(buffer, make_group(61, 2, version=2))  # retires the version-2 admission
  with pytest.raises(BufferTimeout):
    buffer.get_groups(1, 2, 0.05)
  put_group(buffer, make_group(60, 2, version=1))
  (got,) = buffer.get_groups(1, 2, 1.0)
  assert got[0].group_id == 60
  assert buffer.counts["dropped_groups"]["stale"] == 0


def test_a_restored_buffer_does_not_wait_for_voided_admissions():
  buffer = make_buffer(group_size=2, groups_per_version=1, staleness_threshold=1.0,
                       max_version_gap=1, version_gap_policy="wait")
  buffer.publish_version(1)
  _admit(buffer, 1)  # in flight at the save: voided by the restore, its prompt re-issued
  buffer.publish_version(2)
  _admit(buffer, 1)
  put_group(buffer, make_group(71, 2, version=2))
  restored = make_buffer(group_size=2, groups_per_version=1, staleness_threshold=1.0,
                         max_version_gap=1, version_gap_policy="wait")
  restored.set_state(buffer.get_state())
  (got,) = restored.get_groups(1, 2, 1.0)
  assert got[0].group_id == 71


@pytest.mark.parametrize("named", [True, False])
def test_a_named_admission_is_retired_by_its_own_groups_arrival(named):
  """Group 80, admitted at version 1, starts only after the swap to 2 (it waited for a slot);
  group 81 is admitted at 2 and still out. Named admissions know 80's arrival for 80's: nothing
  of version 1 is out, and the take that closes version 2 (bound 1) does not wait. Unnamed,
  80's arrival retires the newest admission not newer than its tokens, 81's: version 1 seems
  out, and the take waits for group 81 (the guess the names replace)."""
  buffer = make_buffer(group_size=2, groups_per_version=1, staleness_threshold=1.0,
                       max_version_gap=1, version_gap_policy="wait")
  buffer.publish_version(1)
  buffer.acquire_group_slot(1.0, group_id=80 if named else None)
  buffer.publish_version(2)
  buffer.acquire_group_slot(1.0, group_id=81 if named else None)
  put_group(buffer, make_group(80, 2, version=2))
  if named:
    (got,) = buffer.get_groups(1, 2, 1.0)
    assert got[0].group_id == 80
    assert buffer.metrics()["queue/take_wait_s/age_bound"] == 0.0
  else:
    with pytest.raises(BufferTimeout, match="version_gap_policy 'wait'"):
      buffer.get_groups(1, 2, 0.05)


def test_a_group_id_that_is_not_an_int_is_refused():
  buffer = make_buffer(group_size=2, groups_per_version=1)
  with pytest.raises(ValueError, match="group_id='7' must be an int"):
    buffer.acquire_group_slot(1.0, group_id="7")
