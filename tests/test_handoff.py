"""run/handoff.py: publish -> first sample of the version in the buffer -> the learner's take."""

import math

import numpy as np
import pytest

from jaxrl_async.run.handoff import Handoffs
from tests.buffer.factory import make_sample


def sample(versions, enqueued, consumed):
  s = make_sample(0, 0, 1, versions)
  s.timestamps.update(enqueued=enqueued, consumed=consumed)
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


def test_no_complete_version_gives_nan_figures():
  handoffs = Handoffs({0: 1.0})
  summary = handoffs.summary()
  assert summary["handoff/versions"] == 0
  assert math.isnan(summary["handoff/publish_to_enqueue_s_p50"])
