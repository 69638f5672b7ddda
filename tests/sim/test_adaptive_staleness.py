"""Adaptive staleness in the simulator: the live loop's controller moves s window by window,
and the real buffer's admission follows it."""

from __future__ import annotations

import numpy as np

from jaxrl_async.buffer import admission_budget
from jaxrl_async.config import RunConfig
from jaxrl_async.sim import profile_from_dict, simulate

# Slow generation (100 tokens at 0.02 s a step) and a quick learner (0.2 s an update): the
# learner waits for the rollout most of the time.
ROLLOUT_BOUND = {"name": "rollout_bound", "prompt_tokens": 4,
                 "response_length": {"kind": "fixed", "min": 1, "max": 400, "value": 100},
                 "rollout": {"replicas": 1, "slots": 64, "decode_curve": [[1, 0.02]]},
                 "learner": {"per_update_s": 0.2, "s_per_token": 0.0},
                 "sync": {"fixed_s": 0.05}}
# Quick generation, slow learner: with s = 1 the rollout runs a version ahead and nearly every
# consumed token is stale.
LEARNER_BOUND = {"name": "learner_bound", "prompt_tokens": 4,
                 "response_length": {"kind": "fixed", "min": 1, "max": 100, "value": 10},
                 "rollout": {"replicas": 1, "slots": 64, "decode_curve": [[1, 0.01]]},
                 "learner": {"per_update_s": 0.5, "s_per_token": 0.0},
                 "sync": {"fixed_s": 0.25}}
SMALL = dict(group_size=4, mini_batch_size=4, max_concurrent_decodes=64, total_samples=16 * 30)
ADAPTIVE = dict(mode="async_stale", staleness_controller="adaptive", staleness_window_versions=3,
                staleness_step=0.25, staleness_min=0.0, staleness_max=1.5)


def trajectory(records) -> list[float]:
  return [r["staleness/threshold"] for r in records]


def test_s_rises_while_the_learner_waits_for_the_rollout():
  config = RunConfig(**ADAPTIVE, staleness_threshold=0.25, idle_target=0.1,
                     stale_ratio_budget=1.0, staleness_hysteresis=0.0, **SMALL)
  result = simulate(profile_from_dict(ROLLOUT_BOUND), config)
  s = trajectory(result.records)
  assert s[0] == 0.25 and s[-1] == 1.5, s
  assert np.all(np.diff(s) >= 0), s  # only up
  # One step per window of 3 versions, each for an idle learner, until staleness_max.
  changes = [(r["policy_version"], r["staleness/change"]) for r in result.records
             if r.get("staleness/change")]
  assert changes == [(3 * k, 0.25) for k in range(1, 6)], changes
  assert all(r["staleness/window_idle_ratio"] > 0.1 for r in result.records
             if r.get("staleness/change"))
  assert result.summary["staleness/threshold"] == 1.5
  # The buffer's admission follows: a record's outstanding groups stay within the budget of
  # the window its rollout version opened (record r's s is window r's), and reach the budget
  # of staleness_max, twice the first one.
  n = config.groups_per_version
  for record in result.records:
    window = int(record["queue/rollout_version"])
    window_s = s[window - 1] if window >= 1 else 0.25
    assert record["queue/outstanding_groups"] <= admission_budget(window_s, n), record
  assert max(r["queue/outstanding_groups"] for r in result.records) == admission_budget(1.5, n)
  assert admission_budget(1.5, n) == 2 * admission_budget(0.25, n)


def test_s_falls_while_the_stale_ratio_is_over_budget():
  config = RunConfig(**ADAPTIVE, staleness_threshold=1.0, stale_ratio_budget=0.2, **SMALL)
  result = simulate(profile_from_dict(LEARNER_BOUND), config)
  s = trajectory(result.records)
  assert s[0] == 1.0 and s[-1] == 0.0, s
  assert np.all(np.diff(s) <= 0), s  # only down
  falls = [r for r in result.records if r.get("staleness/change")]
  assert [r["staleness/change"] for r in falls] == [-0.25] * 4
  assert all("stale_ratio" in r["staleness/reason"] for r in falls)
  # At the floor the reason still names the budget, and s stays.
  last = [r for r in result.records if "staleness/reason" in r][-1]
  assert last["staleness/change"] == 0.0 and "at staleness_min" in last["staleness/reason"]


def test_fixed_records_carry_no_controller_fields():
  config = RunConfig(mode="async_stale", staleness_threshold=1.0, **SMALL)
  result = simulate(profile_from_dict(LEARNER_BOUND), config)
  assert not any(key.startswith("staleness/") for r in result.records for key in r)
