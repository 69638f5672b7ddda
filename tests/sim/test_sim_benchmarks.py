"""The simulator's benchmark scripts run end to end on small settings and print their fields.
(Their figures come from running them as documented; nothing here times.)"""

import json

from benchmarks import concurrency_ceiling, sim_calibration, sim_speed, sim_verl
from jaxrl_async.config import RunConfig
from jaxrl_async.sim import profile_from_dict, simulate
from tests.sim.test_profiles_and_command import GEOMETRY, PROFILE


def _last_line(capsys):
  return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_sim_verl_puts_predictions_beside_the_published_table(capsys):
  assert sim_verl.main(["--gpus", "128", "--num_versions", "2", "--exponents", ""]) == 0
  row = _last_line(capsys)["gpus"]["128"]
  assert row["published_speedup_400_steps"] == 2.35
  assert row["predicted_speedup"] > 0
  assert set(row["modes"]) == set(sim_verl.MODE_ROWS)


def test_sim_speed_reports_its_timing(capsys):
  assert sim_speed.main(["--num_versions", "3"]) == 0
  line = _last_line(capsys)
  assert line["num_versions"] == 3 and line["simulate_s"] > 0 and line["samples"] > 0


def test_sim_calibration_on_run_directories(tmp_path, capsys):
  """--reuse: run directories shaped as real runs write them (here made by the simulator)."""
  profile = profile_from_dict(PROFILE)
  for mode, extra in (("sync", {}), ("async_stale", {"staleness_threshold": 0.5})):
    simulate(profile, RunConfig(mode=mode, **GEOMETRY, **extra)).write(tmp_path / mode)
  (tmp_path / "sync" / "config.gin").write_text("x.config.RunConfig.group_size = 4\n"
                                                "x.config.RunConfig.max_concurrent_decodes = 32\n")
  assert sim_calibration.main(["--reuse", "--work_dir", str(tmp_path), "--modes",
                               "sync,async_stale", "--total_samples", "3200",
                               "--gin_bindings", "RunConfig.group_size = 4",
                               "--gin_bindings", "RunConfig.max_concurrent_decodes = 32",
                               "--contention", "0", "--learner_fixed_fraction", "0.2"]) == 0
  line = _last_line(capsys)
  assert line["learner_fixed_fraction"] == 0.2
  assert line["profile"]["learner"]["per_update_s"] > 0
  table = line["modes"]
  assert abs(table["sync"]["error"]) < 0.05  # the profile was fitted on this very run
  assert table["async_stale"]["measured_samples_per_s"] > 0


def test_the_processes_layout_scales_each_role_by_the_measured_loops():
  profile = profile_from_dict(PROFILE)
  ceiling = {"roles": {"learner_ms_per_batch": 8.0, "rollout_ms_per_batch": 10.0},
             "roles_processes": {"learner_ms_per_batch": 10.0, "rollout_pinned_ms_per_batch": 13.0,
                                 "both_ms_per_batch": 14.3}}
  moved, factors = sim_calibration.processes_layout(profile, ceiling)
  assert factors["rollout_scale"] == 1.3 and factors["learner_scale"] == 1.25
  assert abs(factors["contention"] - 0.1) < 1e-12 and moved.contention == factors["contention"]
  assert factors["learner_contention"] is None and moved.learner_contention is None
  for (n, seconds), (n0, seconds0) in zip(moved.rollout.decode_curve,
                                          profile.rollout.decode_curve, strict=True):
    assert n == n0 and abs(seconds - 1.3 * seconds0) < 1e-15
  assert abs(moved.learner.s_per_token - 1.25 * profile.learner.s_per_token) < 1e-15
  assert moved.reward_latency == profile.reward_latency and moved.sync == profile.sync


def test_the_processes_layout_gives_each_role_its_own_measured_contention():
  """The learner on every core slows beside the pinned server more than the server beside it."""
  profile = profile_from_dict(PROFILE)
  ceiling = {"roles": {"learner_ms_per_batch": 8.0, "rollout_ms_per_batch": 10.0},
             "roles_processes": {"learner_ms_per_batch": 10.0, "rollout_pinned_ms_per_batch": 13.0,
                                 "both_ms_per_batch": 14.3, "learner_beside_ms_per_batch": 18.0,
                                 "rollout_beside_ms_per_batch": 13.65}}
  moved, factors = sim_calibration.processes_layout(profile, ceiling)
  assert abs(factors["contention"] - 0.05) < 1e-12 and moved.contention == factors["contention"]
  assert abs(factors["learner_contention"] - 0.8) < 1e-12
  assert moved.learner_contention == factors["learner_contention"]


def test_beside_counts_only_the_batches_inside_the_overlap():
  """The learner ran 0..2 s, the rollout 0.5..4 s: only batches wholly inside 0.5..2 count."""
  times = {"learner": (0.0, 2.0, [0.5, 1.0, 1.5, 2.0]),
           "rollout": (0.5, 4.0, [1.5, 2.5, 4.0])}
  assert concurrency_ceiling.beside_ms_per_batch(times, "learner") == (500.0, 3)
  assert concurrency_ceiling.beside_ms_per_batch(times, "rollout") == (1000.0, 1)
  assert concurrency_ceiling.beside_ms_per_batch(
      {"learner": (0.0, 1.0, [1.0]), "rollout": (2.0, 3.0, [3.0])}, "learner") == (None, 0)
