"""The rollouter's decisions (`rollout/decisions.py`), shared by the live rollouters and the
simulator's."""

import pytest

from jaxrl_async.rollout.decisions import (
  DRAIN,
  KEEP,
  SWAP,
  admission_room,
  admit_first,
  may_admit,
  on_new_version,
  resume_strategy,
  should_step,
)


@pytest.mark.parametrize("latest, held, partial, in_flight, expected", [
    (3, 3, False, True, KEEP),  # nothing newer
    (2, 3, True, False, KEEP),  # an older version is never taken
    (4, 3, False, True, DRAIN),  # finish the samples in flight on the old weights first
    (4, 3, False, False, SWAP),  # drained: swap
    (4, 3, True, True, SWAP),  # partial rollouts: swap now, resume the interrupted samples
    (4, 3, True, False, SWAP),
])
def test_on_new_version(latest, held, partial, in_flight, expected):
  assert on_new_version(latest, held, partial_rollout=partial, in_flight=in_flight) == expected


def test_only_partial_rollouts_resume_interrupted_samples():
  assert resume_strategy(True, "keep_kv") == "keep_kv"
  assert resume_strategy(True, "reprefill") == "reprefill"
  assert resume_strategy(False, "keep_kv") is None


def test_admission_leaves_room_for_one_group_beyond_the_slots():
  assert admission_room(8, 4) == 12
  assert may_admit(draining=False, load=11, slots=8, group_size=4)
  assert not may_admit(draining=False, load=12, slots=8, group_size=4)
  assert not may_admit(draining=True, load=0, slots=8, group_size=4)


@pytest.mark.parametrize("active, pending, draining, expected", [
    (0, 0, False, False), (1, 0, False, True), (1, 3, True, True),
    (0, 3, False, True), (0, 3, True, False),  # a drain starts nothing new
])
def test_should_step(active, pending, draining, expected):
  assert should_step(active=active, pending=pending, draining=draining) == expected


@pytest.mark.parametrize("swapped, active, expected", [
    (False, 0, True), (False, 5, True),  # no swap this turn: ask, then step
    (True, 0, True),  # swapped with nothing in flight: nothing to step without an admission
    (True, 3, False),  # swapped mid-sample: step first, ask at the next turn
])
def test_admit_first(swapped, active, expected):
  assert admit_first(swapped=swapped, active=active) is expected
