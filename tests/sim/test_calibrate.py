"""What a sync run cannot show, measured once (sim/calibrate.py), and how the simulator uses it:
the processes layout and contention, the hand-off latency, the buffer's cost per sample."""

import dataclasses

import pytest

from jaxrl_async.config import RunConfig
from jaxrl_async.sim import calibrate, profile_from_dict, simulate
from tests.sim.test_profiles_and_command import GEOMETRY, PROFILE

FIXED = {**PROFILE, "response_length": {"kind": "fixed", "min": 1, "max": 25, "value": 5},
         "sync_mode_overhead_s": 0.0}
CEILING = {"roles": {"learner_ms_per_batch": 8.0, "rollout_ms_per_batch": 10.0},
           "roles_processes": {"learner_ms_per_batch": 10.0, "rollout_pinned_ms_per_batch": 13.0,
                               "both_ms_per_batch": 14.3}}


def test_the_processes_layout_scales_each_role_by_the_measured_loops():
  """13 / 10 and 10 / 8; one contention, both at once over the pinned rollout: 14.3 / 13 - 1."""
  profile = profile_from_dict(PROFILE)
  factors = calibrate.layout_factors(CEILING)
  moved = calibrate.processes_layout(profile, factors)
  assert factors["rollout_scale"] == pytest.approx(1.3)
  assert factors["learner_scale"] == pytest.approx(1.25)
  assert factors["contention"] == pytest.approx(0.1) and moved.contention == factors["contention"]
  assert factors["learner_contention"] is None and moved.learner_contention is None
  assert moved.rollout.decode_curve[0][1] == pytest.approx(1.3 * 0.004)
  assert moved.learner.s_per_token == pytest.approx(1.25 * 2e-4)
  assert moved.learner.per_update_s == pytest.approx(1.25 * 0.01)
  assert moved.reward_latency == profile.reward_latency and moved.sync == profile.sync


def test_each_role_gets_its_own_contention_from_its_batches_beside_the_other():
  """rollout: 13.65 / 13 - 1 = 0.05; learner: 18 / 10 - 1 = 0.8."""
  ceiling = {**CEILING, "roles_processes": {**CEILING["roles_processes"],
                                            "learner_beside_ms_per_batch": 18.0,
                                            "rollout_beside_ms_per_batch": 13.65}}
  factors = calibrate.layout_factors(ceiling)
  assert factors["contention"] == pytest.approx(0.05)
  assert factors["learner_contention"] == pytest.approx(0.8)
  moved = calibrate.processes_layout(profile_from_dict(PROFILE), factors)
  assert moved.learner_contention == pytest.approx(0.8)


def test_a_ceiling_without_the_layout_or_with_a_zero_time_is_refused():
  with pytest.raises(ValueError, match="roles_processes"):
    calibrate.layout_factors({"roles": CEILING["roles"]})
  bad = {**CEILING, "roles": {**CEILING["roles"], "rollout_ms_per_batch": 0.0}}
  with pytest.raises(ValueError, match="rollout_ms_per_batch must be a positive number"):
    calibrate.layout_factors(bad)


def _records(values, first_version=1):
  return [{"policy_version": first_version + i, calibrate.HANDOFF_FIELD: v}
          for i, v in enumerate(values)]


def test_the_handoff_is_the_measured_median_less_the_simulated_one():
  """Versions 1, 2 are skipped (warm-up): measured median of 0.012, 0.010, 0.014 is 0.012;
  simulated median of 0.003, 0.004, 0.002 is 0.003; the hand-off is 0.009."""
  measured = _records([0.5, 0.4, 0.012, 0.010, 0.014])
  simulated = _records([0.003, 0.003, 0.003, 0.004, 0.002])
  assert calibrate.median_handoff(measured) == pytest.approx(0.012)
  assert calibrate.handoff_latency(measured, simulated) == pytest.approx(0.009)
  assert calibrate.handoff_latency(simulated, measured) == 0.0  # never negative
  with pytest.raises(ValueError, match="the sync loop's do not"):
    calibrate.median_handoff([{"policy_version": 5, "samples": 64}])


def test_the_buffer_cost_is_the_cross_process_time_per_sample_less_the_in_process_one():
  """1 / 20,000 - 1 / 200,000 = 45 us per sample."""
  assert calibrate.buffer_s_per_sample(20_000, 200_000) == pytest.approx(4.5e-5)
  assert calibrate.buffer_s_per_sample(300_000, 200_000) == 0.0
  with pytest.raises(ValueError, match="cross_process_samples_per_s"):
    calibrate.buffer_s_per_sample(0.0, 200_000)


def test_the_handoff_delays_each_published_version_by_its_latency():
  """on_policy: the rollout waits for every publish, so a hand-off h adds h to publish ->
  first enqueued and h to every version's wall time (no contention, fixed lengths)."""
  config = RunConfig(mode="on_policy", **GEOMETRY)
  base = profile_from_dict(FIXED)
  late = dataclasses.replace(base, handoff_s=0.01)
  plain, delayed = simulate(base, config), simulate(late, config)
  key = "handoff/publish_to_enqueue_s_p50"
  assert delayed.summary[key] - plain.summary[key] == pytest.approx(0.01)
  versions = delayed.summary["policy_version"]
  assert delayed.summary["system/wall_s"] - plain.summary["system/wall_s"] == pytest.approx(
      0.01 * versions)
  # the fit recovers it from the delayed run's records against the plain simulation
  assert calibrate.handoff_latency(delayed.records, plain.records) == pytest.approx(0.01)
  # sync has no hand-off between processes: unchanged
  sync = RunConfig(mode="sync", **GEOMETRY)
  assert simulate(late, sync).summary["system/wall_s"] == simulate(base, sync).summary[
      "system/wall_s"]


def test_the_buffer_cost_adds_host_time_per_consumed_sample_on_the_learner_in_async_modes():
  """Every consumed sample adds buffer_s_per_sample to the learner's busy time (on_policy);
  sync's in-process buffer is already inside its fitted costs."""
  config = RunConfig(mode="on_policy", **GEOMETRY)
  base = profile_from_dict(FIXED)
  costly = dataclasses.replace(base, buffer_s_per_sample=1e-4)
  plain, slow = simulate(base, config).summary, simulate(costly, config).summary
  consumed = slow["consumed_samples"]
  assert consumed == plain["consumed_samples"]
  assert slow["learner/busy_s"] - plain["learner/busy_s"] == pytest.approx(1e-4 * consumed)
  sync = RunConfig(mode="sync", **GEOMETRY)
  assert simulate(costly, sync).summary["learner/busy_s"] == pytest.approx(
      simulate(base, sync).summary["learner/busy_s"])


def test_bad_handoff_and_buffer_fields_are_refused_by_name():
  with pytest.raises(ValueError, match="handoff_s=-0.1"):
    profile_from_dict({**PROFILE, "handoff_s": -0.1})
  with pytest.raises(ValueError, match="buffer_s_per_sample='x'"):
    profile_from_dict({**PROFILE, "buffer_s_per_sample": "x"})


def test_the_recompute_pass_costs_a_third_of_the_update_per_token_unless_given():
  """s_per_token 2e-4 -> recompute 2e-4 / 3; a profile that has its own keeps it."""
  profile = profile_from_dict(PROFILE)
  assert calibrate.with_recompute(profile).learner.recompute_s_per_token == pytest.approx(
      2e-4 / 3)
  given = profile_from_dict({**PROFILE, "learner": {**PROFILE["learner"],
                                                    "recompute_s_per_token": 1e-5}})
  assert calibrate.with_recompute(given).learner.recompute_s_per_token == 1e-5
  with pytest.raises(ValueError, match="forward_fraction=2"):
    calibrate.with_recompute(profile, 2)


def test_run_edges_are_the_measured_startup_beyond_the_simulated_one_and_the_tail():
  """First version at 1.5 s measured, 0.25 s simulated: startup 1.25 s; wall 12 s, last
  version at 10.5 s: shutdown 1.5 s."""
  measured = [{"policy_version": 0, "time_s": 0.1},  # an eval record: not a version
              {"policy_version": 1, "algo/version_gap_max": 0, "time_s": 1.5},
              {"policy_version": 2, "algo/version_gap_max": 0, "time_s": 10.5}]
  simulated = [{"policy_version": 1, "algo/version_gap_max": 0, "time_s": 0.25}]
  assert calibrate.run_edges(measured, 12.0, simulated) == pytest.approx((1.25, 1.5))
  assert calibrate.run_edges(measured, 12.0, [{**simulated[0], "time_s": 2.0}])[0] == 0.0
  with pytest.raises(ValueError, match="measured_wall_s=9.0"):
    calibrate.run_edges(measured, 9.0, simulated)


def test_shutdown_counts_in_the_summarys_wall_time_and_samples_per_s():
  config = RunConfig(mode="async_stale", staleness_threshold=0.5, **GEOMETRY)
  base = profile_from_dict(FIXED)
  plain = simulate(base, config).summary
  tail = simulate(dataclasses.replace(base, shutdown_s=2.0), config).summary
  assert tail["system/wall_s"] == pytest.approx(plain["system/wall_s"] + 2.0)
  assert tail["system/samples_per_s"] == pytest.approx(
      plain["consumed_samples"] / (plain["system/wall_s"] + 2.0))


def test_the_median_ceiling_takes_each_figure_s_median_over_the_repeats():
  runs = [{"kind": "core_overlap", "roles": {"learner_ms_per_batch": v, "batches": 100}}
          for v in (10.0, 30.0, 12.0)]
  out = calibrate.median_ceiling(runs)
  assert out == {"kind": "core_overlap", "roles": {"learner_ms_per_batch": 12.0, "batches": 100}}
  with pytest.raises(ValueError, match="at least one"):
    calibrate.median_ceiling([])


def _versions(times, samples_per_version=10):
  return [{"policy_version": v, "time_s": t, "samples": v * samples_per_version,
           "algo/version_gap_max": 0} for v, t in enumerate(times, start=1)]


def test_the_learners_contention_is_its_slowdown_beside_a_busy_rollout():
  """Learner busy 1.5 s alone and 4.5 s beside the rollout, for 3.75 s of work: T_n + T_o /
  (1 + c) = 3.75 gives c = 1. Spans before the window (from version 3's record) do not count."""
  records = _versions([1.0, 5.0, 10.0, 14.0, 20.0])  # window 10 -> 20 s: 20 samples
  spans = [("learner", 6.0, 9.0), ("rollout", 6.0, 9.0),  # before the window
           ("learner", 10.0, 12.0), ("learner", 12.0, 14.0), ("learner", 15.0, 17.0),
           ("rollout", 11.5, 12.0), ("rollout", 12.0, 14.0), ("rollout", 13.0, 17.5),
           ("reward", 10.0, 20.0)]
  # learner 10-14 and 15-17 (6 s); rollout 11.5-17.5: beside it 11.5-14 and 15-17 (4.5 s).
  assert calibrate.overlap_s([[10.0, 14.0], [15.0, 17.0]], [[11.5, 17.5]]) == pytest.approx(4.5)
  out = calibrate.role_contention(spans, records, work_s_per_sample=3.75 / 20)
  assert out["busy_s"] == pytest.approx(6.0)
  assert out["beside_s"] == pytest.approx(4.5)
  assert out["contention"] == pytest.approx(4.5 / (3.75 - 1.5) - 1.0)  # 1.0
  # Work at least as long as the busy time: no slowdown, c = 0.
  assert calibrate.role_contention(spans, records, 0.5)["contention"] == 0.0
  # The rollout, the other way round: busy 6 s (11.5-17.5), 4.5 s of them beside the learner;
  # 1.5 s alone + 4.5 s / (1 + c) = 3 s of work gives c = 2.
  rollout = calibrate.role_contention(spans, records, 3.0 / 20, role="rollout",
                                      beside="learner")
  assert rollout["contention"] == pytest.approx(2.0)


def test_a_run_whose_roles_did_not_overlap_or_whose_role_is_slower_alone_is_refused():
  records = _versions([1.0, 5.0, 10.0, 14.0, 20.0])
  apart = [("learner", 10.0, 14.0), ("rollout", 14.0, 18.0)]
  with pytest.raises(ValueError, match="no contention to measure"):
    calibrate.role_contention(apart, records, 0.1)
  beside = [("learner", 10.0, 18.0), ("rollout", 16.0, 18.0)]  # 6 s alone
  with pytest.raises(ValueError, match="does not fit this run"):
    calibrate.role_contention(beside, records, 5.0 / 20)
  with pytest.raises(ValueError, match="more than 3 version records"):
    calibrate.role_contention(beside, records[:3], 0.1)


def test_match_contention_finds_where_a_growing_busy_time_meets_the_target():
  busy = lambda c: 0.002 * (1.0 + 0.5 * c)  # noqa: E731
  assert calibrate.match_contention(busy, 0.003) == pytest.approx(1.0, abs=1e-3)
  assert calibrate.match_contention(busy, 0.001) == 0.0  # faster than with no contention
  assert calibrate.match_contention(busy, 1.0, high=8.0) == 8.0  # beyond the range
  with pytest.raises(ValueError, match="target"):
    calibrate.match_contention(busy, float("nan"))
