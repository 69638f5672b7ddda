"""Group assembly, drop reasons, the age bound, capacity, timestamps and metrics."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from jaxrl_async import faults
from jaxrl_async.buffer import (
  GROUP_DROP_PRIORITY,
  LATENCY_WINDOW,
  BufferTimeout,
  drop_uniform_reward,
)
from jaxrl_async.buffer.accounting import TAKE_WAIT_REASONS
from jaxrl_async.types import DROP_REASONS

from .factory import (
  EXPECTED_PRIORITY,
  expected_drop_reason,
  make_buffer,
  make_group,
  make_sample,
  put_group,
)


class FakeClock:

  def __init__(self, start: float = 100.0):
    self.now = start

  def __call__(self) -> float:
    return self.now


def test_group_released_only_when_complete_and_members_sorted():
  buffer = make_buffer(group_size=3, groups_per_version=2)
  buffer.acquire_group_slot(1.0)
  group = make_group(7, 3)
  for sample in (group[2], group[0]):
    buffer.put(sample, 1.0)
  assert buffer.metrics()["queue/ready_groups"] == 0
  with pytest.raises(BufferTimeout, match=r"get_groups\(num_groups=1\) timed out"):
    buffer.get_groups(1, 0, 0.01)
  buffer.put(group[1], 1.0)
  (got,) = buffer.get_groups(1, 0, 1.0)
  assert [s.meta["index_in_group"] for s in got] == [0, 1, 2]
  assert all(s is t for s, t in zip(got, group))


def test_groups_served_fifo_in_completion_order():
  buffer = make_buffer(group_size=2, groups_per_version=3)
  groups = {gid: make_group(gid, 2) for gid in (10, 11, 12)}
  for _ in groups:
    buffer.acquire_group_slot(1.0)
  for sample in (groups[10][0], groups[11][0], groups[12][0], groups[12][1], groups[10][1],
                 groups[11][1]):
    buffer.put(sample, 1.0)
  got = buffer.get_groups(3, 0, 1.0)
  assert [group[0].group_id for group in got] == [12, 10, 11]


def test_documented_drop_priority():
  assert GROUP_DROP_PRIORITY == EXPECTED_PRIORITY
  assert set(GROUP_DROP_PRIORITY) < set(DROP_REASONS)


FAILURES = {
    "none": {},
    "aborted": {"finish_reason": "aborted"},
    "failed": {"reward_status": "failed"},
    "timeout": {"reward_status": "timeout", "reward": float("nan")},
    "length": {"finish_reason": "length"},
    "pending": {"reward_status": "pending", "reward": float("nan")},
    "nan_reward": {"reward": float("nan")},
}


@pytest.mark.parametrize("drop_truncated", [False, True])
@pytest.mark.parametrize("first, second", list(itertools.combinations_with_replacement(
    sorted(FAILURES), 2)))
def test_group_dropped_whole_under_one_reason(first, second, drop_truncated):
  group_size = 3
  buffer = make_buffer(group_size=group_size, groups_per_version=1,
                       drop_truncated=drop_truncated)
  buffer.acquire_group_slot(1.0)
  group = [make_sample(0, 0, group_size, **{"reward": 0.0, **FAILURES[first]}),
           make_sample(0, 1, group_size, reward=1.0),
           make_sample(0, 2, group_size, **{"reward": 1.0, **FAILURES[second]})]
  put_group(buffer, group)
  reason = expected_drop_reason(group, drop_truncated)
  counts = buffer.counts
  if reason is None:
    assert sum(counts["dropped"].values()) == 0
    assert len(buffer.get_groups(1, 0, 1.0)[0]) == group_size
  else:
    assert counts["dropped"][reason] == group_size
    assert sum(counts["dropped"].values()) == group_size
    assert counts["queued"] == 0
  buffer.check_invariants()


def test_uniform_reward_filter():
  assert not drop_uniform_reward(make_group(0, 4, rewards=[1.0] * 4))
  assert not drop_uniform_reward(make_group(0, 4, rewards=[0.0] * 4))
  assert drop_uniform_reward(make_group(0, 4, rewards=[0.0, 0.0, 1.0, 0.0]))
  assert not drop_uniform_reward(make_group(0, 1, rewards=[1.0]))
  buffer = make_buffer(group_size=4, groups_per_version=2, group_filter=drop_uniform_reward)
  buffer.acquire_group_slot(1.0)
  buffer.acquire_group_slot(1.0)
  put_group(buffer, make_group(0, 4, rewards=[1.0] * 4))
  put_group(buffer, make_group(1, 4, rewards=[1.0, 0.0, 1.0, 1.0]))
  assert buffer.counts["dropped"]["filtered_group"] == 4
  assert buffer.get_groups(1, 0, 1.0)[0][0].group_id == 1
  assert buffer.available_slots == 1  # the filtered group refunded its slot
  buffer.check_invariants()


def test_failing_filter_leaves_buffer_unchanged():
  def broken_filter(group):
    raise RuntimeError("filter bug")
  buffer = make_buffer(group_size=2, groups_per_version=1, group_filter=broken_filter)
  buffer.acquire_group_slot(1.0)
  group = make_group(0, 2)
  buffer.put(group[0], 1.0)
  with pytest.raises(RuntimeError, match="filter bug"):
    buffer.put(group[1], 1.0)
  assert buffer.counts["put"] == 1 and buffer.counts["queued"] == 1
  buffer.check_invariants()


def test_age_bound_drops_stale_groups_and_never_returns_them():
  buffer = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=2.0,
                       max_version_gap=1)
  versions = {0: (0, 0), 1: (0, 2), 2: (1, 1), 3: (2, 2)}  # token versions per group
  for group_id, token_versions in versions.items():
    buffer.acquire_group_slot(1.0)
    put_group(buffer, [make_sample(group_id, i, 2, token_versions, reward=float(i))
                       for i in range(2)])
  got = buffer.get_groups(2, 2, 1.0)  # gap > 1 for groups 0 and 1 (oldest token 0)
  assert [group[0].group_id for group in got] == [2, 3]
  counts = buffer.counts
  assert counts["dropped"]["stale"] == 4 and counts["dropped_groups"]["stale"] == 2
  for group in got:
    for sample in group:
      assert 2 - sample.token_versions.min() <= 1
  buffer.check_invariants()


def test_no_age_bound_returns_everything():
  buffer = make_buffer(group_size=1, groups_per_version=1, staleness_threshold=1.0)
  buffer.acquire_group_slot(1.0)
  buffer.put(make_sample(0, 0, 1, (0, 0)), 1.0)
  assert len(buffer.get_groups(1, 1000, 1.0)) == 1


def test_stale_groups_dropped_while_waiting_free_admission():
  buffer = make_buffer(group_size=1, groups_per_version=1, staleness_threshold=0.0,
                       max_version_gap=0)
  buffer.acquire_group_slot(1.0)
  buffer.put(make_sample(0, 0, 1, (0,)), 1.0)
  assert buffer.available_slots == 0
  with pytest.raises(BufferTimeout):
    buffer.get_groups(1, 1, 0.01)
  assert buffer.counts["dropped"]["stale"] == 1
  assert buffer.available_slots == 1  # refunded: the rollouter can replace it


def test_timestamps_and_latency_with_fake_clock():
  clock = FakeClock()
  buffer = make_buffer(group_size=2, groups_per_version=2, clock=clock)
  buffer.acquire_group_slot(1.0)
  buffer.acquire_group_slot(1.0)
  enqueue_times = [100.0, 101.0, 102.0, 103.5]
  samples = make_group(0, 2) + make_group(1, 2)
  for when, sample in zip(enqueue_times, samples):
    clock.now = when
    buffer.put(sample, 1.0)
  clock.now = 110.0
  groups = buffer.get_groups(2, 0, 1.0)
  for sample, when in zip([s for g in groups for s in g], enqueue_times):
    assert sample.timestamps["enqueued"] == when
    assert sample.timestamps["consumed"] == 110.0
  latencies = 110.0 - np.array(enqueue_times)
  metrics = buffer.metrics()
  assert metrics["queue/latency_s_mean"] == pytest.approx(latencies.mean())
  assert metrics["queue/latency_s_p50"] == pytest.approx(np.percentile(latencies, 50))
  assert metrics["queue/latency_s_p99"] == pytest.approx(np.percentile(latencies, 99))


def test_latency_percentiles_cover_recent_window():
  clock = FakeClock()
  buffer = make_buffer(group_size=1, groups_per_version=4, clock=clock)
  latencies = []
  for group_id in range(LATENCY_WINDOW + 100):
    buffer.acquire_group_slot(1.0)
    clock.now = float(group_id)
    buffer.put(make_sample(group_id, 0, 1), 1.0)
    clock.now += group_id % 7
    latencies.append(group_id % 7)
    buffer.get_groups(1, 0, 1.0)
    if buffer.available_slots == 0:
      buffer.publish_version(buffer.rollout_version + 1)
  metrics = buffer.metrics()
  assert metrics["queue/latency_s_mean"] == pytest.approx(np.mean(latencies))
  recent = latencies[-LATENCY_WINDOW:]
  assert metrics["queue/latency_s_p99"] == pytest.approx(np.percentile(recent, 99))


def test_metrics_keys_and_values():
  buffer = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=0.5)
  metrics = buffer.metrics()
  expected = {"queue/depth", "queue/ready_groups", "queue/latency_s_p50", "queue/latency_s_p99",
              "queue/latency_s_mean", "queue/admission_wait_s", "queue/put", "queue/consumed",
              "queue/outstanding_groups", "queue/rollout_version"}
  expected |= {f"queue/dropped/{reason}" for reason in DROP_REASONS}
  expected |= {f"queue/take_wait_s/{reason}" for reason in TAKE_WAIT_REASONS}
  expected |= {f"lengths/{kind}_{stat}" for kind in ("generated", "consumed")
               for stat in ("mean", "p90")} | {"lengths/consumed_over_generated_mean"}
  assert set(metrics) == expected  # no drop yet: no lengths/dropped_le_* bucket
  assert math.isnan(metrics["queue/latency_s_p50"])  # nothing consumed yet
  for _ in range(3):
    buffer.acquire_group_slot(1.0)
  put_group(buffer, make_group(0, 2))
  put_group(buffer, make_group(1, 2, reward_status="timeout"))
  buffer.put(make_group(2, 2)[0], 1.0)
  buffer.acquire_group_slot(1.0)  # the dropped group's slot was refunded
  with pytest.raises(BufferTimeout):
    buffer.acquire_group_slot(0.05)
  buffer.publish_version(3)
  metrics = buffer.metrics()
  assert metrics["queue/depth"] == 3 and metrics["queue/ready_groups"] == 1
  assert metrics["queue/put"] == 5 and metrics["queue/consumed"] == 0
  assert metrics["queue/dropped/reward_timeout"] == 2
  # Outstanding: group 0 (ready), group 2 (partial), one admitted group not started.
  assert metrics["queue/outstanding_groups"] == 3 and metrics["queue/rollout_version"] == 3
  assert metrics["queue/admission_wait_s"] >= 0.05


def test_capacity_blocks_unadmitted_puts_then_times_out():
  buffer = make_buffer(group_size=2, groups_per_version=1, staleness_threshold=0.0)
  assert buffer.config["capacity"] == 2
  buffer.put(make_sample(0, 0, 2), 1.0)  # unadmitted groups are bounded by capacity only
  buffer.put(make_sample(1, 0, 2), 1.0)
  with pytest.raises(BufferTimeout, match=r"put timed out after .* queued 2/2 samples"):
    buffer.put(make_sample(0, 1, 2), 0.02)
  assert buffer.counts["unadmitted_groups"] == 2 and buffer.counts["put"] == 2
  assert buffer.counts["outstanding_groups"] == 0
  buffer.check_invariants()


def test_admitted_groups_never_block_on_capacity():
  buffer = make_buffer(group_size=3, groups_per_version=2, staleness_threshold=0.5)
  for _ in range(buffer.budget):
    buffer.acquire_group_slot(1.0)
  for index in range(3):  # interleave all admitted groups member by member
    for group_id in range(buffer.budget):
      buffer.put(make_sample(group_id, index, 3), 0.05)
  assert buffer.counts["queued"] == buffer.config["capacity"]


@pytest.mark.parametrize("meta, match", [
    ({"index_in_group": 2}, r"index_in_group.*2.*\[0, 2\)"),
    ({"index_in_group": -1}, r"index_in_group.*-1"),
    ({"index_in_group": "a"}, r"index_in_group"),
])
def test_bad_index_in_group_rejected(meta, match):
  buffer = make_buffer(group_size=2)
  sample = make_sample(0, 0, 2)
  sample.meta = meta
  with pytest.raises(ValueError, match=match):
    buffer.put(sample, 1.0)


def test_duplicate_and_mismatched_samples_rejected():
  buffer = make_buffer(group_size=2)
  buffer.acquire_group_slot(1.0)
  buffer.put(make_sample(0, 0, 2), 1.0)
  with pytest.raises(ValueError, match="duplicate sample: group 0 already holds index_in_group"):
    buffer.put(make_sample(0, 0, 2), 1.0)
  with pytest.raises(ValueError, match=r"group_size=3 .* group_size=2"):
    buffer.put(make_sample(1, 0, 3), 1.0)
  sample = make_sample(2, 0, 2)
  sample.finish_reason = "exploded"
  with pytest.raises(ValueError, match="finish_reason='exploded'"):
    buffer.put(sample, 1.0)
  assert buffer.counts["put"] == 1
  buffer.check_invariants()


def test_discard_queued_counts_everything_and_refunds():
  buffer = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=0.5)
  for _ in range(3):
    buffer.acquire_group_slot(1.0)
  put_group(buffer, make_group(0, 2))
  buffer.put(make_group(1, 2)[1], 1.0)
  assert buffer.discard_queued("shutdown") == 3
  counts = buffer.counts
  assert counts["dropped"]["shutdown"] == 3 and counts["queued"] == 0
  assert counts["outstanding_groups"] == 1  # the group still in flight
  assert buffer.available_slots == 2
  buffer.check_invariants()


def test_check_invariants_reports_numbers():
  buffer = make_buffer(group_size=2)
  buffer.acquire_group_slot(1.0)
  buffer.put(make_sample(0, 0, 2), 1.0)
  buffer._acc.queued += 1  # corrupt the accounting on purpose
  with pytest.raises(AssertionError, match=r"put=1 != consumed=0 \+ dropped=0 .* queued=2"):
    buffer.check_invariants()


def test_the_get_groups_fault_point_counts_takes_not_polls_and_fires_before_the_take():
  faults.configure("buffer.get_groups=raise@2")
  try:
    buffer = make_buffer(group_size=2, groups_per_version=2)
    for _ in range(3):  # polls of an empty buffer pass no hit
      with pytest.raises(BufferTimeout):
        buffer.get_groups(1, 0, 0.001)
    buffer.acquire_group_slot(1.0)
    put_group(buffer, make_group(0, 2))
    assert buffer.get_groups(1, 0, 1.0)[0][0].group_id == 0  # hit 1
    buffer.acquire_group_slot(1.0)
    put_group(buffer, make_group(1, 2))
    with pytest.raises(faults.FaultInjected, match="hit 2"):
      buffer.get_groups(1, 0, 1.0)
    assert buffer.metrics()["queue/ready_groups"] == 1  # nothing was taken
    assert buffer.get_groups(1, 0, 1.0)[0][0].group_id == 1  # the lock was given back
  finally:
    faults.configure(None)


def test_response_lengths_of_generated_consumed_and_dropped_samples():
  """The length figures: generated (put) and consumed mean and p90, and the drops by length
  bucket; a checkpoint of the buffer keeps them."""
  buffer = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.0)
  lengths = {0: (1, 3), 1: (8, 8), 2: (2, 2)}  # group -> its two samples' response lengths
  for group_id, (a, b) in lengths.items():
    buffer.acquire_group_slot(1.0)
    status = "timeout" if group_id == 1 else "ok"  # group 1 is dropped (reward_timeout)
    put_group(buffer, [make_sample(group_id, i, 2, (0,) * n, reward_status=status)
                       for i, n in enumerate((a, b))])
  buffer.get_groups(2, 0, 1.0)
  metrics = buffer.metrics()
  assert metrics["lengths/generated_mean"] == pytest.approx(24 / 6)
  assert metrics["lengths/generated_p90"] == np.percentile([1, 3, 8, 8, 2, 2], 90,
                                                           method="lower") == 8.0
  assert metrics["lengths/consumed_mean"] == pytest.approx(8 / 4)
  assert metrics["lengths/consumed_p90"] == np.percentile([1, 3, 2, 2], 90, method="lower")
  assert metrics["lengths/consumed_over_generated_mean"] == pytest.approx(0.5)
  assert metrics["lengths/dropped_le_15"] == 2.0  # both 8-token samples, in bucket 8..15
  restored = make_buffer(group_size=2, groups_per_version=4, staleness_threshold=0.0)
  restored.set_state(buffer.get_state())
  assert {k: v for k, v in restored.metrics().items() if k.startswith("lengths/")} == {
      k: v for k, v in metrics.items() if k.startswith("lengths/")}
