"""Admission arithmetic: hand-computed budgets and ledger, and a reference model (hypothesis)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from jaxrl_async.buffer import BufferTimeout, admission_budget

from .factory import make_buffer, make_group, put_group

BLOCKED_S = 0.002  # timeout for calls the model says must block


@pytest.mark.parametrize("staleness, groups_per_version, expected", [
    (0.0, 4, 4), (0.5, 4, 6), (0.25, 4, 5), (0.3, 4, 5), (1.0, 3, 6), (0.16, 25, 29),
    (0.13, 100, 113), (2.0, 1, 3), (0.99, 1, 1),
])
def test_budget_hand_computed(staleness, groups_per_version, expected):
  assert admission_budget(staleness, groups_per_version) == expected


def test_budget_matches_exact_rational_floor():
  # floor((1 + k/100) * N) computed exactly in integers, against the float implementation.
  k = np.arange(0, 301)
  for n in (1, 2, 7, 16, 25, 100):
    exact = ((100 + k) * n) // 100
    got = np.array([admission_budget(int(i) / 100, n) for i in k])
    np.testing.assert_array_equal(got, exact)


def test_window_budget_blocks_and_carried_groups_reduce_next_window():
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.5)
  assert buffer.budget == 6
  for _ in range(6):
    assert buffer.acquire_group_slot(1.0) == 0
  with pytest.raises(BufferTimeout, match=r"acquire_group_slot timed out .*used 6/6"):
    buffer.acquire_group_slot(BLOCKED_S)
  # Of the 6 admitted groups: 2 put and consumed, 1 put and queued, 1 partially put, 2 in flight.
  for group_id in range(3):
    put_group(buffer, make_group(group_id, 2, version=0))
  buffer.put(make_group(3, 2, version=0)[0], 1.0)
  assert len(buffer.get_groups(2, 0, 1.0)) == 2
  assert buffer.available_slots == 0  # consumption does not refund
  buffer.publish_version(1)
  # Carried over: 1 ready + 1 partial + 2 in flight = 4, so the new window has 6 - 4 = 2 slots.
  assert buffer.counts["outstanding_groups"] == 4
  assert buffer.available_slots == 2
  assert buffer.acquire_group_slot(1.0) == 1
  assert buffer.acquire_group_slot(1.0) == 1
  with pytest.raises(BufferTimeout):
    buffer.acquire_group_slot(BLOCKED_S)
  buffer.check_invariants()


def test_drop_refunds_slot_so_on_policy_rollouter_can_replace_it():
  buffer = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=0.0)
  assert buffer.budget == 2
  buffer.acquire_group_slot(1.0)
  buffer.acquire_group_slot(1.0)
  put_group(buffer, make_group(0, 2, reward_status="failed"))  # dropped: refunds one slot
  assert buffer.counts["dropped"]["reward_failed"] == 2
  assert buffer.available_slots == 1
  buffer.acquire_group_slot(1.0)  # the replacement
  with pytest.raises(BufferTimeout):
    buffer.acquire_group_slot(BLOCKED_S)
  put_group(buffer, make_group(1, 2))
  put_group(buffer, make_group(2, 2))
  assert len(buffer.get_groups(2, 0, 1.0)) == 2
  assert buffer.available_slots == 0  # N consumed groups use up window 0 ...
  buffer.publish_version(1)
  assert buffer.available_slots == 2  # ... and nothing is carried into window 1
  buffer.check_invariants()


def test_republishing_current_version_keeps_window():
  buffer = make_buffer(groups_per_version=2)
  buffer.acquire_group_slot(1.0)
  buffer.publish_version(0)
  assert buffer.available_slots == 1
  with pytest.raises(ValueError, match="version=-1"):
    buffer.publish_version(-1)


class AdmissionModel(RuleBasedStateMachine):
  """Single-threaded buffer vs. a reference model written from the documented rules.

  The model tracks groups as objects and recomputes `used` as
  carried_at_publish + admitted_in_window - dropped_in_window, and predicts whether each
  blocking call returns or times out.
  """

  @initialize(group_size=st.integers(1, 3), groups_per_version=st.integers(1, 4),
              staleness=st.sampled_from([0.0, 0.5, 1.0, 1.5]),
              max_version_gap=st.sampled_from([None, 0, 1, 2]))
  def setup(self, group_size, groups_per_version, staleness, max_version_gap):
    self.group_size = group_size
    self.gap = max_version_gap
    self.budget = math.floor((1 + staleness) * groups_per_version + 1e-9)
    self.buffer = make_buffer(group_size=group_size, groups_per_version=groups_per_version,
                              staleness_threshold=staleness, max_version_gap=max_version_gap,
                              capacity=group_size * self.budget)
    self.rollout_version = 0
    self.learner_version = 0
    self.in_flight = 0
    self.partial = {}  # group_id -> (version, members put so far, failed)
    self.ready = []  # (group_id, version)
    self.carried = 0
    self.admitted_in_window = 0
    self.dropped_in_window = 0
    self.next_group_id = 0
    self.consumed_groups = 0
    self.dropped_groups = 0

  def outstanding(self):
    return self.in_flight + len(self.partial) + len(self.ready)

  def used(self):
    return self.carried + self.admitted_in_window - self.dropped_in_window

  @rule()
  def acquire(self):
    if self.used() < self.budget:
      assert self.buffer.acquire_group_slot(1.0) == self.rollout_version
      self.in_flight += 1
      self.admitted_in_window += 1
    else:
      with pytest.raises(BufferTimeout):
        self.buffer.acquire_group_slot(BLOCKED_S)

  @rule(fail=st.booleans(), pick=st.integers(0, 10))
  def put_member(self, fail, pick):
    if self.partial and (pick % 2 or not self.in_flight):
      group_id = sorted(self.partial)[pick % len(self.partial)]
    elif self.in_flight:
      group_id = self.next_group_id
      self.next_group_id += 1
      self.in_flight -= 1
      self.partial[group_id] = (self.rollout_version, 0, False)
    else:
      return  # nothing admitted: the rollouter has nothing to put
    version, arrived, failed = self.partial[group_id]
    sample = make_group(group_id, self.group_size, version=version)[arrived]
    if fail:
      sample.reward_status = "failed"
    self.buffer.put(sample, 1.0)
    arrived, failed = arrived + 1, failed or fail
    if arrived < self.group_size:
      self.partial[group_id] = (version, arrived, failed)
      return
    del self.partial[group_id]
    if failed:
      self.dropped_in_window += 1
      self.dropped_groups += 1
    else:
      self.ready.append((group_id, version))

  @rule()
  def publish(self):
    self.rollout_version += 1
    self.buffer.publish_version(self.rollout_version)
    self.carried = self.outstanding()
    self.admitted_in_window = 0
    self.dropped_in_window = 0

  @rule(num_groups=st.integers(1, 3), advance=st.booleans())
  def get(self, num_groups, advance):
    if advance and self.learner_version < self.rollout_version:
      self.learner_version += 1
    num_groups = min(num_groups, self.budget)
    fresh = []
    for group_id, version in self.ready:
      if self.gap is not None and self.learner_version - version > self.gap:
        self.dropped_in_window += 1
        self.dropped_groups += 1
      else:
        fresh.append((group_id, version))
    self.ready = fresh
    if len(self.ready) >= num_groups:
      groups = self.buffer.get_groups(num_groups, self.learner_version, 1.0)
      assert [group[0].group_id for group in groups] == [g for g, _ in self.ready[:num_groups]]
      del self.ready[:num_groups]
      self.consumed_groups += num_groups
    else:
      with pytest.raises(BufferTimeout):
        self.buffer.get_groups(num_groups, self.learner_version, BLOCKED_S)

  @invariant()
  def ledger_matches_model(self):
    if not hasattr(self, "buffer"):
      return
    counts = self.buffer.counts
    assert self.buffer.available_slots == max(0, self.budget - self.used())
    assert counts["outstanding_groups"] == self.outstanding()
    assert counts["consumed_groups"] == self.consumed_groups
    assert sum(counts["dropped_groups"].values()) == self.dropped_groups
    assert self.outstanding() <= self.used() <= self.budget
    self.buffer.check_invariants()


TestAdmissionModel = AdmissionModel.TestCase
TestAdmissionModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


@settings(max_examples=30, deadline=None)
@given(st.floats(0, 4), st.integers(1, 64))
def test_budget_is_floor_of_product(staleness, groups_per_version):
  budget = admission_budget(staleness, groups_per_version)
  exact = (1 + staleness) * groups_per_version
  assert budget == math.floor(exact) or abs(exact - round(exact)) < 1e-8
  assert groups_per_version <= budget <= exact + 1e-8
