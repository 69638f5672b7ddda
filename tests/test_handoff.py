"""run/handoff.py: publish -> first rollout work under the version -> its first sample in the
buffer -> the learner's take."""

import math

import numpy as np
import pytest

from jaxrl_async.run.handoff import Handoffs
from tests.buffer.factory import make_sample


def sample(versions, enqueued, consumed, began=None):
  s = make_sample(0, 0, 1, versions)
  s.timestamps.update(enqueued=enqueued, consumed=consumed)
  for version, when in (began or {}).items():
    s.stamp_version_began(version, when)
  return s


def test_intervals_are_measured_from_the_first_sample_carrying_each_version():
  published = {1: 10.0}
  handoffs = Handoffs(published)
  assert handoffs.intervals(1) is None  # no sample of version 1 seen yet
  handoffs.observe([[sample((1, 1), enqueued=12.0, consumed=15.0)]])
  published[2] = 20.0  # the publisher adds versions as it publishes them
  handoffs.observe([[sample((1, 2), enqueued=21.5, consumed=24.0),  # partial: tokens of 1, 2
                     sample((2, 2), enqueued=22.0, consumed=23.0)]])
  assert handoffs.intervals(1) == {"publish_to_enqueue_s": 2.0, "enqueue_to_take_s": 3.0,
                                   "publish_to_take_s": 5.0}
  assert handoffs.intervals(2) == {"publish_to_enqueue_s": 1.5, "enqueue_to_take_s": 1.5,
                                   "publish_to_take_s": 3.0}
  summary = handoffs.summary()
  assert summary["handoff/versions"] == 2
  assert summary["handoff/publish_to_take_s_p50"] == pytest.approx(4.0)
  assert summary["handoff/enqueue_to_take_s_p99"] == pytest.approx(
      np.percentile([3.0, 1.5], 99))


def test_first_work_is_the_earliest_stamp_over_consumed_samples():
  published = {1: 10.0, 2: 20.0}
  handoffs = Handoffs(published)
  handoffs.observe([[sample((1, 2), enqueued=23.0, consumed=24.0, began={1: 11.0, 2: 20.5}),
                     sample((2, 2), enqueued=22.0, consumed=24.0, began={2: 20.25})]])
  handoffs.observe([[sample((1, 1), enqueued=12.0, consumed=30.0, began={1: 10.5})]])
  assert handoffs.intervals(1) == {"publish_to_work_s": 0.5, "work_to_enqueue_s": 1.5,
                                   "publish_to_enqueue_s": 2.0, "enqueue_to_take_s": 12.0,
                                   "publish_to_take_s": 14.0}
  assert handoffs.intervals(2)["publish_to_work_s"] == 0.25
  assert handoffs.intervals(2)["work_to_enqueue_s"] == 1.75
  summary = handoffs.summary()
  assert summary["handoff/publish_to_work_s_p50"] == pytest.approx(0.375)


def test_a_stamp_is_kept_from_the_first_call_of_its_version():
  s = make_sample(0, 0, 1, (3, 3))
  s.stamp_version_began(3, 5.0)
  s.stamp_version_began(3, 9.0)  # resumed later under the same version
  s.stamp_version_began(4, 7.0)
  assert s.versions_began() == {3: 5.0, 4: 7.0}


def test_samples_without_first_work_stamps_leave_those_intervals_out():
  handoffs = Handoffs({1: 10.0})
  handoffs.observe([[sample((1,), enqueued=12.0, consumed=15.0)]])
  assert set(handoffs.intervals(1)) == {"publish_to_enqueue_s", "enqueue_to_take_s",
                                        "publish_to_take_s"}
  summary = handoffs.summary()
  assert math.isnan(summary["handoff/publish_to_work_s_p50"])
  assert summary["handoff/publish_to_enqueue_s_p50"] == 2.0


def test_no_complete_version_gives_nan_figures():
  handoffs = Handoffs({0: 1.0})
  summary = handoffs.summary()
  assert summary["handoff/versions"] == 0
  assert math.isnan(summary["handoff/publish_to_enqueue_s_p50"])
