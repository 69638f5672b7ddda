"""A new staleness threshold for the buffer's admission (`set_staleness_threshold`, adaptive
staleness): it waits for a window opening at its version, the window then admits exactly the
new budget less the carried work, and a checkpoint keeps both budgets."""

from __future__ import annotations

import pytest

from jaxrl_async.buffer import BufferTimeout

from .factory import make_buffer, make_group, put_group

BLOCKED_S = 0.002


def admit_all(buffer) -> int:
  """Admissions until the window's budget is used up."""
  admitted = 0
  while True:
    try:
      buffer.acquire_group_slot(BLOCKED_S)
    except BufferTimeout:
      return admitted
    admitted += 1


def test_a_raise_waits_for_its_window_then_admits_the_new_budget():
  # N = 4, s = 0.5: budget 6; s = 1.0: budget 8 (capacity sized for it).
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5, capacity=16)
  assert admit_all(buffer) == 6
  budgets = buffer.set_staleness_threshold(1.0, from_version=2)
  assert budgets == {"budget": 6, "scheduled": [[2, 8]]}
  assert buffer.budget == 6 and admit_all(buffer) == 0  # never inside a window
  for group_id in range(6):
    put_group(buffer, make_group(group_id, 2))
  assert len(buffer.get_groups(6, 0, 1.0)) == 6
  buffer.publish_version(1)  # before the scheduled version: the old budget
  assert buffer.budget == 6 and admit_all(buffer) == 6
  for group_id in range(6, 12):
    put_group(buffer, make_group(group_id, 2, version=1))
  assert len(buffer.get_groups(6, 1, 1.0)) == 6
  buffer.publish_version(2)
  assert buffer.budget == 8 and admit_all(buffer) == 8
  buffer.check_invariants()


def test_a_lowered_budget_below_the_carried_work_admits_nothing_until_refunds():
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=1.0)
  assert admit_all(buffer) == 8  # 8 outstanding groups, none put
  buffer.set_staleness_threshold(0.0, from_version=1)
  buffer.publish_version(1)
  assert buffer.budget == 4 and buffer.available_slots == 0
  assert admit_all(buffer) == 0
  buffer.check_invariants()  # used = carried = 8 > budget 4 is allowed
  # Five groups fail: each refunds a slot; the window admits again once used < 4.
  for group_id in range(5):
    put_group(buffer, make_group(group_id, 2, reward_status="failed"))
  assert admit_all(buffer) == 1
  buffer.check_invariants()
  # The next window is charged with what is outstanding: 3 + 1 left, so 0 more.
  buffer.publish_version(2)
  assert admit_all(buffer) == 0
  buffer.check_invariants()


def test_a_window_takes_the_newest_budget_due_and_keeps_the_later_ones():
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5, capacity=16)
  buffer.set_staleness_threshold(1.0, from_version=1)
  buffer.set_staleness_threshold(0.25, from_version=1)  # a new decision for version 1
  assert buffer.set_staleness_threshold(0.0, from_version=3)["scheduled"] == [[1, 5], [3, 4]]
  buffer.publish_version(1)
  assert buffer.budget == 5
  # Decisions for versions 2 and 3 while the rollout side still holds version 1; it then
  # jumps to version 2 (s = 1.0 is due, 0.5 waits), then to 4 (past both).
  buffer.set_staleness_threshold(1.0, from_version=2)  # replaces the one from version 3
  buffer.set_staleness_threshold(0.5, from_version=3)
  buffer.publish_version(2)
  assert buffer.budget == 8
  assert buffer.set_staleness_threshold(0.5, from_version=3)["scheduled"] == [[3, 6]]
  buffer.publish_version(4)
  assert buffer.budget == 6
  assert buffer.set_staleness_threshold(0.5, from_version=5)["scheduled"] == [[5, 6]]


def test_the_buffer_must_hold_the_new_budget():
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5)  # 12
  with pytest.raises(ValueError, match=r"capacity=12 must be an int >= group_size \* floor\(\(1 "
                     r"\+ staleness_threshold\) \* groups_per_version\) = 2 \* 8 = 16"):
    buffer.set_staleness_threshold(1.0, from_version=1)
  buffer.set_staleness_threshold(0.0, from_version=1)  # smaller is always fine


@pytest.mark.parametrize("threshold, version, match", [
    (-0.5, 1, "staleness_threshold=-0.5 must be a finite number >= 0"),
    (float("inf"), 1, "staleness_threshold=inf"),
    (True, 1, "staleness_threshold=True"),
    (0.5, -1, "from_version=-1 must be an int >= 0"),
    (0.5, 1.0, "from_version=1.0"),
])
def test_bad_arguments_are_named(threshold, version, match):
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5)
  with pytest.raises(ValueError, match=match):
    buffer.set_staleness_threshold(threshold, version)


def test_a_checkpoint_keeps_the_budget_in_force_and_the_scheduled_one():
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5, capacity=16)
  buffer.set_staleness_threshold(1.0, from_version=1)
  buffer.publish_version(1)
  buffer.set_staleness_threshold(0.25, from_version=3)
  state = buffer.get_state()
  assert state["ledger"]["budget"] == 8 and state["ledger"]["scheduled"] == [[3, 5]]
  again = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5, capacity=16)
  again.set_state(state)
  assert again.budget == 8 and admit_all(again) == 8
  again.publish_version(2)
  assert again.budget == 8
  again.publish_version(3)
  assert again.budget == 5
  # A state saved before budgets were recorded keeps the constructed budget.
  old = dict(state, ledger={k: v for k, v in state["ledger"].items()
                            if k not in ("budget", "scheduled")})
  older = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5, capacity=16)
  older.set_state(old)
  assert older.budget == 6
