"""RunConfig's adaptive staleness knobs: what 'adaptive' refuses, and the buffer sized for the
largest s the controller may choose."""

from __future__ import annotations

import pytest

from jaxrl_async.buffer import admission_budget
from jaxrl_async.config import RunConfig

ADAPTIVE = dict(mode="async_stale", staleness_controller="adaptive", staleness_threshold=0.5,
                staleness_min=0.0, staleness_max=2.0)


@pytest.mark.parametrize("mode, extra", [
    ("sync", {}), ("on_policy", {}), ("stream_off_policy", {"trigger_parameter_sync_step": 2}),
])
def test_adaptive_is_refused_where_s_must_stay_0(mode, extra):
  with pytest.raises(ValueError, match=rf"staleness_controller='adaptive' needs mode "
                     rf"'async_stale' or 'async_partial', got mode='{mode}'"):
    RunConfig(**{**ADAPTIVE, "mode": mode, "staleness_threshold": 0.0, **extra})


@pytest.mark.parametrize("bounds", [
    dict(staleness_min=0.6),  # min > s
    dict(staleness_max=0.4),  # s > max
    dict(staleness_min=-0.1),
    dict(staleness_threshold=-0.5, staleness_min=-1.0),
])
def test_bounds_must_hold_s(bounds):
  with pytest.raises(ValueError, match=r"needs 0 <= staleness_min <= staleness_threshold <= "
                     r"staleness_max .* got staleness_min="):
    RunConfig(**{**ADAPTIVE, **bounds})


@pytest.mark.parametrize("field, value, match", [
    ("staleness_max", float("inf"), "staleness_max must be finite"),
    ("staleness_min", float("nan"), "staleness_min must be finite"),
    ("staleness_step", 0.0, "staleness_step must be > 0, got 0.0"),
    ("idle_target", 1.5, r"idle_target must be in \[0, 1\]"),
    ("stale_ratio_budget", -0.1, r"stale_ratio_budget must be in \[0, 1\]"),
    ("kl_budget", -1.0, "kl_budget must be >= 0"),
    ("staleness_hysteresis", 1.0, r"staleness_hysteresis must be in \[0, 1\)"),
    ("staleness_window_versions", 0, "staleness_window_versions must be a positive int"),
    ("staleness_controller", "pid", r"staleness_controller must be one of \('fixed', "
     r"'adaptive'\), got 'pid'"),
])
def test_each_knob_is_checked_by_name(field, value, match):
  with pytest.raises(ValueError, match=match):
    RunConfig(**{**ADAPTIVE, field: value})


def test_partial_rollout_needs_a_positive_floor():
  with pytest.raises(ValueError, match="partial_rollout=True needs staleness_min > 0"):
    RunConfig(**{**ADAPTIVE, "mode": "async_partial", "partial_rollout": True})
  RunConfig(**{**ADAPTIVE, "mode": "async_partial", "partial_rollout": True,
               "staleness_min": 0.25})


def test_the_buffer_is_sized_for_staleness_max():
  config = RunConfig(**ADAPTIVE)
  n = config.groups_per_version
  assert config.min_capacity == config.group_size * admission_budget(2.0, n)
  assert config.capacity == config.min_capacity
  small = config.group_size * admission_budget(0.5, n)  # enough for s, not for staleness_max
  with pytest.raises(ValueError, match=rf"buffer_capacity={small} must be >= group_size \* "
                     rf"floor\(\(1 \+ staleness_max\)"):
    RunConfig(**ADAPTIVE, buffer_capacity=small)
  assert not config.asserts_on_policy  # s may rise: the learner cannot assert gap 0


def test_fixed_keeps_todays_checks_and_sizes():
  # The adaptive bounds are not checked for 'fixed' (s = 3 above the default staleness_max).
  config = RunConfig(mode="async_stale", staleness_threshold=3.0)
  assert config.min_capacity == config.group_size * admission_budget(3.0,
                                                                     config.groups_per_version)
  assert RunConfig(mode="on_policy").asserts_on_policy
  assert not RunConfig(mode="async_stale", staleness_threshold=0.5).asserts_on_policy
