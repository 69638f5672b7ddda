"""The adaptive staleness controller (buffer/staleness_control.py): the rule on a table of
hand-made windows, the window's metrics from version records, and its checkpoint form."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from jaxrl_async.buffer import staleness_control as sc
from jaxrl_async.buffer.staleness_control import (
  Decision,
  StalenessControl,
  VersionSample,
  WindowMetrics,
  WindowOutcome,
)

ADAPTIVE = StalenessControl(controller="adaptive", window_versions=2, step=0.25, minimum=0.0,
                            maximum=1.0, idle_target=0.1, stale_ratio_budget=0.5,
                            kl_budget=0.02, hysteresis=0.2)
NAN = math.nan
CALM = WindowMetrics(idle_ratio=0.05, stale_ratio=0.1, kl=0.001)  # nothing to do
IDLE = WindowMetrics(idle_ratio=0.4, stale_ratio=0.1, kl=0.001)  # room to raise


@pytest.mark.parametrize("threshold, metrics, history, expected, reason", [
    # a budget broken lowers s by a step, whatever the idle ratio
    (0.5, WindowMetrics(0.4, 0.1, 0.03), (), 0.25, "kl 0.03 > kl_budget 0.02"),
    (0.5, WindowMetrics(0.0, 0.6, 0.001), (), 0.25, "stale_ratio 0.6 > stale_ratio_budget 0.5"),
    (0.5, WindowMetrics(0.4, 0.6, 0.03), (), 0.25, "stale_ratio 0.6 > stale_ratio_budget 0.5; "
     "kl 0.03 > kl_budget 0.02"),
    # ... never below staleness_min
    (0.1, WindowMetrics(0.4, 0.6, 0.001), (), 0.0, "stale_ratio"),
    (0.0, WindowMetrics(0.4, 0.6, 0.001), (), 0.0, "at staleness_min 0"),
    # idle over target, within budget: up by a step, never above staleness_max
    (0.5, IDLE, (), 0.75, "idle_ratio 0.4 > idle_target 0.1"),
    (0.9, IDLE, (), 1.0, "idle_ratio 0.4 > idle_target 0.1"),
    (1.0, IDLE, (), 1.0, "at staleness_max 1"),
    # idle at or under target: kept
    (0.5, CALM, (), 0.5, "idle_ratio 0.05 <= idle_target 0.1"),
    (0.5, WindowMetrics(0.1, 0.1, 0.001), (), 0.5, "<= idle_target"),
    # hysteresis: inside the band below a budget ((1 - h) x budget, budget], s does not rise
    (0.5, WindowMetrics(0.4, 0.45, 0.001), (), 0.5, "stale_ratio 0.45 > 0.8 x "
     "stale_ratio_budget 0.5 (hysteresis)"),
    (0.5, WindowMetrics(0.4, 0.1, 0.018), (), 0.5, "(hysteresis)"),
    # hysteresis: a level that broke a budget in the remembered windows is not tried again
    (0.5, IDLE, (WindowOutcome(0.75, WindowMetrics(0.4, 0.7, 0.0), -0.25),), 0.5,
     "s=0.75 broke a budget"),
    # ... but a lower level's breach does not block, nor does a higher level that kept budget
    (0.5, IDLE, (WindowOutcome(0.25, WindowMetrics(0.4, 0.7, 0.0), -0.25),
                 WindowOutcome(0.75, WindowMetrics(0.4, 0.1, 0.0), -0.25)), 0.75, "idle_ratio"),
    # an unmeasured KL (NaN) is under no budget
    (0.5, WindowMetrics(0.4, 0.1, NAN), (), 0.75, "idle_ratio"),
])
def test_the_rule(threshold, metrics, history, expected, reason):
  decision = sc.decide(ADAPTIVE, threshold, metrics, history)
  assert decision.threshold == pytest.approx(expected)
  assert decision.change == pytest.approx(expected - threshold)
  assert reason in decision.reason


def test_a_stale_ratio_budget_of_one_is_no_budget():
  """At 1.0 (RunConfig's default) every stale ratio is within budget and outside the
  hysteresis band, so idleness alone raises s; the KL budget still lowers it."""
  unbounded = dataclasses.replace(ADAPTIVE, stale_ratio_budget=1.0)
  all_stale = WindowMetrics(idle_ratio=0.4, stale_ratio=1.0, kl=0.001)
  assert sc.over_budget(unbounded, all_stale) == []
  assert sc.decide(unbounded, 0.5, all_stale).threshold == 0.75
  assert sc.decide(unbounded, 0.5, all_stale._replace(kl=0.03)).threshold == 0.25
  # just under 1.0 it is a budget again, with its band
  assert sc.decide(dataclasses.replace(ADAPTIVE, stale_ratio_budget=0.99), 0.5,
                   all_stale).threshold == 0.25


def test_a_breach_is_forgotten_after_the_memory():
  breach = WindowOutcome(0.75, WindowMetrics(0.4, 0.7, 0.0), -0.25)
  calm = WindowOutcome(0.5, IDLE, 0.0)
  remembered = (breach,) + (calm,) * (sc.MEMORY_WINDOWS - 1)
  assert sc.decide(ADAPTIVE, 0.5, IDLE, remembered).change == 0.0
  forgotten = (breach,) + (calm,) * sc.MEMORY_WINDOWS
  assert sc.decide(ADAPTIVE, 0.5, IDLE, forgotten).threshold == 0.75


@pytest.mark.parametrize("metrics", [CALM, IDLE, WindowMetrics(1.0, 1.0, 5.0),
                                     WindowMetrics(0.0, 0.0, NAN)])
def test_fixed_never_changes(metrics):
  fixed = dataclasses.replace(ADAPTIVE, controller="fixed", window_versions=1)
  assert sc.decide(fixed, 0.5, metrics) == Decision(0.5, 0.0, "fixed")
  state = sc.init_state(0.5)
  for _ in range(5):
    state, decision = sc.observe(fixed, state, VersionSample(1.0, 0.0, 1.0, 9.0))
    assert decision.change == 0.0 and state.threshold == 0.5


def test_steps_do_not_drift():
  control = dataclasses.replace(ADAPTIVE, window_versions=1, step=0.1)
  state = sc.init_state(0.0)
  for _ in range(12):
    state, _ = sc.observe(control, state, VersionSample(1.0, 0.0, 0.0, 0.0))
  assert state.threshold == 1.0  # ten steps of 0.1, exactly, then held at the bound


def test_no_swing_between_two_levels():
  """A plant whose stale ratio breaks the budget above s = 0.5 and whose learner is always
  idle: s climbs to 0.75, falls back to 0.5 and stays there for the memory's windows before
  it tries 0.75 again (a controller without memory would swing every window)."""
  control = dataclasses.replace(ADAPTIVE, window_versions=1)
  state, trajectory = sc.init_state(0.25), []
  for _ in range(16):
    stale = 0.8 if state.threshold > 0.5 else 0.2
    state, _ = sc.observe(control, state, VersionSample(1.0, 0.5, stale, 0.0))
    trajectory.append(state.threshold)
  assert trajectory[:3] == [0.5, 0.75, 0.5]
  changes = sum(a != b for a, b in itertools.pairwise(trajectory))
  # After a fall, s holds until the breach leaves the memory, then probes 0.75 again: two
  # changes per MEMORY_WINDOWS + 2 windows (a controller without memory changes every window).
  hold = sc.MEMORY_WINDOWS + 1
  assert trajectory[2:2 + hold] == [0.5] * hold and trajectory[2 + hold] == 0.75, trajectory
  assert changes <= 6, trajectory


def test_window_metrics_sum_busy_and_wall_and_average_the_ratios():
  metrics = sc.window_metrics([VersionSample(2.0, 1.0, 0.2, 0.01),
                               VersionSample(6.0, 5.0, 0.6, NAN)])
  assert metrics.idle_ratio == pytest.approx(1 - 6.0 / 8.0)
  assert metrics.stale_ratio == pytest.approx(0.4)
  assert metrics.kl == pytest.approx(0.01)  # the measured one
  assert math.isnan(sc.window_metrics([VersionSample(1.0, 1.0, 0.0, NAN)]).kl)
  with pytest.raises(ValueError):
    sc.window_metrics([])


def test_on_record_takes_deltas_of_the_cumulative_timers_and_closes_windows():
  state = sc.init_state(0.5, mark=(10.0, 4.0))
  records = [{"system/wall_s": 14.0, "learner/busy_s": 5.0, "algo/stale_ratio": 0.2,
              "algo/behaviour_kl": 0.0},
             {"system/wall_s": 18.0, "learner/busy_s": 6.0, "algo/stale_ratio": 0.0,
              "algo/behaviour_kl": 0.0}]
  state, fields, decision = sc.on_record(ADAPTIVE, state, records[0])
  assert decision is None and fields == {"staleness/threshold": 0.5}
  assert state.window == (VersionSample(4.0, 1.0, 0.2, 0.0),)
  state, fields, decision = sc.on_record(ADAPTIVE, state, records[1])
  # idle over the window: 1 - (1 + 1) / (4 + 4) = 0.75 > 0.1, stale 0.1, kl 0: raise
  assert decision.threshold == 0.75 and state.threshold == 0.75 and state.window == ()
  assert fields["staleness/threshold"] == 0.5  # the s this version ran at
  assert fields["staleness/change"] == 0.25
  assert fields["staleness/window_idle_ratio"] == pytest.approx(0.75)
  assert fields["staleness/window_stale_ratio"] == pytest.approx(0.1)
  assert state.mark == (18.0, 6.0)


def test_the_state_round_trips_through_json():
  import json
  state = sc.StalenessState(0.75, (VersionSample(1.0, 0.5, 0.2, NAN),),
                            (WindowOutcome(0.5, WindowMetrics(0.3, 0.1, NAN), 0.25),),
                            mark=(3.0, 1.0))
  data = json.loads(json.dumps(sc.state_to_json(state), allow_nan=False))
  again = sc.state_from_json(data, mark=(3.0, 1.0))
  assert again.threshold == 0.75 and again.mark == (3.0, 1.0)
  assert again.window[0][:3] == (1.0, 0.5, 0.2) and math.isnan(again.window[0].kl)
  assert again.history[0].threshold == 0.5 and again.history[0].change == 0.25
  assert math.isnan(again.history[0].metrics.kl)
  assert sc.state_from_json(data).mark == (0.0, 0.0)  # the mark is per life, not saved
