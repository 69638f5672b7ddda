"""The simulator's benchmark scripts run end to end on small settings and print their fields.
(Their figures come from running them as documented; nothing here times.)"""

import dataclasses
import json
import os

import pytest

from benchmarks import concurrency_ceiling, sim_calibration, sim_speed, sim_verl
from jaxrl_async.config import RunConfig
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.sim import calibrate, profile_from_dict, simulate
from jaxrl_async.sinks import SPANS_FILE, read_spans
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


def calibrate_on(work_dir, *extra: str) -> int:
  """`sim_calibration.main --reuse` on sync and async_stale directories in `work_dir`, the
  geometry of the tests' profile, no contention, a given learner fixed fraction."""
  return sim_calibration.main(["--reuse", "--work_dir", str(work_dir), "--modes",
                               "sync,async_stale", "--total_samples", "3200",
                               "--gin_bindings", "RunConfig.group_size = 4",
                               "--gin_bindings", "RunConfig.max_concurrent_decodes = 32",
                               "--contention", "0", "--learner_fixed_fraction", "0.2",
                               "--recipes", "", "--backend", "threads", *extra])


def test_sim_calibration_on_run_directories(tmp_path, capsys):
  """--reuse: run directories shaped as real runs write them (here made by the simulator)."""
  profile = profile_from_dict(PROFILE)
  for mode, extra in (("sync", {}), ("async_stale", {"staleness_threshold": 0.5})):
    simulate(profile, RunConfig(mode=mode, **GEOMETRY, **extra)).write(tmp_path / mode)
  # the hand-off comes from the warm-up run of on_policy: here one with a 10 ms hand-off
  late = dataclasses.replace(profile, handoff_s=0.01)
  simulate(late, RunConfig(mode="on_policy", **{**GEOMETRY, "total_samples": 1280})).write(
      tmp_path / "warmup-on_policy")
  (tmp_path / "sync" / "config.gin").write_text("x.config.RunConfig.group_size = 4\n"
                                                "x.config.RunConfig.max_concurrent_decodes = 32\n")
  assert calibrate_on(tmp_path, "--warmup_samples", "1280") == 0
  line = _last_line(capsys)
  assert line["once_measured"]["handoff_s"] == pytest.approx(0.01, abs=0.003)
  assert line["async_profile"]["handoff_s"] == line["once_measured"]["handoff_s"]
  assert line["profile"]["handoff_s"] == 0.0  # sync keeps the sync run's own profile
  assert line["learner_fixed_fraction"] == 0.2
  assert line["profile"]["learner"]["per_update_s"] > 0
  table = line["modes"]
  assert abs(table["sync"]["error"]) < 0.05  # the profile was fitted on this very run
  assert table["async_stale"]["measured_samples_per_s"] > 0


def write_rounds(tmp_path, scales) -> dict:
  """sync and async_stale run directories of rounds 1, 2, ... whose rollout is slower by each
  round's scale (a host drifting between rounds); returns each run's samples/s."""
  profile = profile_from_dict(PROFILE)
  speeds = {}
  for mode, extra in (("sync", {}), ("async_stale", {"staleness_threshold": 0.5})):
    for k, scale in enumerate(scales, start=1):
      slower = dataclasses.replace(profile, rollout=dataclasses.replace(
          profile.rollout, decode_curve=tuple((slots, seconds * scale)
                                              for slots, seconds in profile.rollout.decode_curve)))
      run = simulate(slower, RunConfig(mode=mode, **GEOMETRY, **extra))
      run.write(tmp_path / f"{mode}-r{k}")
      speeds[(mode, k)] = run.summary["system/samples_per_s"]
      (tmp_path / f"{mode}-r{k}" / "config.gin").write_text(
          "x.config.RunConfig.group_size = 4\nx.config.RunConfig.max_concurrent_decodes = 32\n")
  return speeds


def test_sim_calibration_takes_the_median_of_its_rounds(tmp_path, capsys):
  """--repeats 3: each mode's figure is the median of its rounds' directories, and the profile
  is fitted on the sync round of median samples/s (here the rounds differ in their speed)."""
  speeds = write_rounds(tmp_path, (1.0, 2.0, 0.8))  # round 2 twice as slow, round 3 faster
  assert calibrate_on(tmp_path, "--warmup_samples", "0", "--repeats", "3") == 0
  line = _last_line(capsys)
  assert line["repeats"] == 3 and line["profile_run"] == "sync-r1"  # 1.0x: the median round
  for mode in ("sync", "async_stale"):
    rounds = [speeds[(mode, k)] for k in (1, 2, 3)]
    assert line["modes"][mode]["measured_rounds"] == rounds
    assert line["modes"][mode]["measured_samples_per_s"] == sorted(rounds)[1]
  assert abs(line["modes"]["sync"]["error"]) < 0.05  # fitted on the median round itself
  with pytest.raises(SystemExit):
    sim_calibration.main(["--reuse", "--work_dir", str(tmp_path), "--repeats", "0"])
  # An earlier calibration's runs there: measuring again would mix them with the new ones.
  (tmp_path / "sync").mkdir(exist_ok=True)
  with pytest.raises(SystemExit):
    sim_calibration.main(["--work_dir", str(tmp_path), "--modes", "sync", "--recipes", ""])


def test_paired_rounds_predict_each_round_from_its_own_sync_run(tmp_path, capsys):
  """--paired_rounds: round k's sync run gives round k's prediction, so each round's error is
  small though the rounds' speeds differ 2.5x; the median-round fit is reported beside it."""
  speeds = write_rounds(tmp_path, (1.0, 2.0, 0.8))
  assert calibrate_on(tmp_path, "--warmup_samples", "0", "--repeats", "3",
                      "--paired_rounds") == 0
  line = _last_line(capsys)
  assert line["paired_within_15_percent"] is True
  for mode in ("sync", "async_stale"):
    paired = line["modes"][mode]["paired"]
    measured = [speeds[(mode, k)] for k in (1, 2, 3)]
    assert paired["errors"] == pytest.approx(
        [p / m - 1 for p, m in zip(paired["predicted_rounds"], measured)])
    assert max(map(abs, paired["errors"])) < 0.1
    assert paired["median_error"] == sorted(paired["errors"])[1]
  predicted = line["modes"]["async_stale"]["paired"]["predicted_rounds"]
  assert predicted[1] < 0.7 * predicted[0] and predicted[2] > predicted[0]  # the rounds' hosts
  with pytest.raises(SystemExit):  # one round has nothing to pair
    sim_calibration.main(["--reuse", "--work_dir", str(tmp_path), "--paired_rounds"])


def test_paired_errors_take_the_median_of_the_rounds():
  row = sim_calibration.paired_errors([110.0, 80.0, 130.0], [100.0, 100.0, 100.0])
  assert row["errors"] == pytest.approx([0.1, -0.2, 0.3])
  assert row["median_error"] == pytest.approx(0.1) and row["within_15_percent"]
  assert not sim_calibration.paired_errors([120.0, 120.0], [100.0, 100.0])["within_15_percent"]


def test_contention_rounds_read_the_contentions_from_the_round_of_median_speed(tmp_path, capsys):
  """--contention_rounds: a run of the contention mode in every round (contention-r<k>); the
  contentions come from the one of median samples/s (here round 3: round 1 is the slowest)."""
  profile = profile_from_dict(PROFILE)
  for k, scale in ((1, 2.0), (2, 0.8), (3, 1.0)):
    slower = calibrate.scaled_learner(profile, scale)
    stale = RunConfig(mode="async_stale", staleness_threshold=0.5, **GEOMETRY)
    simulate(slower, stale, spans=True).write(tmp_path / f"contention-r{k}")
    for mode, config in (("sync", RunConfig(mode="sync", **GEOMETRY)), ("async_stale", stale)):
      simulate(slower, config).write(tmp_path / f"{mode}-r{k}")
      (tmp_path / f"{mode}-r{k}" / "config.gin").write_text(
          "x.config.RunConfig.group_size = 4\nx.config.RunConfig.max_concurrent_decodes = 32\n")
  assert calibrate_on(tmp_path, "--warmup_samples", "0", "--repeats", "3", "--contention_mode",
                      "async_stale", "--contention_rounds", "--contention_model", "scale",
                      "--contention_samples", "3200") == 0
  measured = _last_line(capsys)["once_measured"]
  assert measured["contention_source"].startswith("contention-r3 (async_stale)")
  assert measured["run_contention"]["learner"]["model"] == "scale"
  with pytest.raises(SystemExit):  # the rounds need a mode to run
    sim_calibration.main(["--reuse", "--work_dir", str(tmp_path), "--contention_rounds"])


def test_beside_counts_only_the_batches_inside_the_overlap():
  """The learner ran 0..2 s, the rollout 0.5..4 s: only batches wholly inside 0.5..2 count."""
  times = {"learner": (0.0, 2.0, [0.5, 1.0, 1.5, 2.0]),
           "rollout": (0.5, 4.0, [1.5, 2.5, 4.0])}
  assert concurrency_ceiling.beside_ms_per_batch(times, "learner") == (500.0, 3)
  assert concurrency_ceiling.beside_ms_per_batch(times, "rollout") == (1000.0, 1)
  assert concurrency_ceiling.beside_ms_per_batch(
      {"learner": (0.0, 1.0, [1.0]), "rollout": (2.0, 3.0, [3.0])}, "learner") == (None, 0)


def test_sim_calibration_reads_task_files_after_each_modes_gin(monkeypatch):
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
  configs = sim_calibration.run_configs(["sync", "recipes/rlvr_async"], [],
                                        ["gin/tasks/rlvr.gin"])
  assert {type(config.task).__name__ for config in configs.values()} == {"RLVRReverseTask"}
  assert configs["recipes/rlvr_async"].require_batches == 4  # the recipe's own settings kept
  with pytest.raises(SystemExit):
    sim_calibration.main(["--reuse", "--task_file", "gin/tasks/no_such_task.gin"])


LONG_TAIL = {**PROFILE, "response_length": {"kind": "groups", "min": 1, "max": 25,
                                           "groups": [[3, 3, 4, 3], [20, 25, 22, 21],
                                                      [6, 6, 6, 5]]}}
OVERLAP = RunConfig(mode="async_partial", staleness_threshold=1.0, partial_rollout=True,
                    **{**GEOMETRY, "total_samples": 6400})


def _measured(truth, tmp_path, model):
  """`truth`'s async run, written with its spans, measured against the long-tail profile."""
  run = simulate(truth, OVERLAP, spans=True)
  assert run.spans and {role for role, _, _ in run.spans} >= {"learner", "rollout"}
  run.write(tmp_path)
  return calibrate.contention_from_run(
      profile_from_dict(LONG_TAIL), read_spans(str(tmp_path / SPANS_FILE)),
      read_jsonl(str(tmp_path / "metrics.jsonl")), OVERLAP, model=model)


def test_contentions_from_an_async_runs_spans_recover_the_runs_own(tmp_path):
  """Round trip: an async run simulated with known contentions (the learner 1.0 beside the
  rollout, the rollout 0.5 beside the learner) writes its spans; measured against the same
  profile without contention, they give those contentions back."""
  truth = dataclasses.replace(profile_from_dict(LONG_TAIL), contention=0.5,
                              learner_contention=1.0)
  measured = _measured(truth, tmp_path, "contention")
  assert measured["learner"]["contention"] == pytest.approx(1.0, rel=0.1)
  assert measured["rollout"]["contention"] == pytest.approx(0.5, rel=0.1)
  assert measured["learner"]["beside_s"] > 0.3 * measured["learner"]["busy_s"]


def test_the_scale_model_recovers_a_learner_slower_by_one_factor(tmp_path):
  truth = dataclasses.replace(calibrate.scaled_learner(profile_from_dict(LONG_TAIL), 1.5),
                              contention=0.5, learner_contention=0.0)
  measured = _measured(truth, tmp_path, "scale")
  assert measured["learner"]["scale"] == pytest.approx(1.5, rel=0.1)
  assert measured["learner"]["contention"] == 0.0
  assert measured["rollout"]["contention"] == pytest.approx(0.5, rel=0.15)
  assert measured["learner"]["model"] == "scale"
  # 'auto' reads a learner three times slower everywhere as a scale (as a contention it would
  # be slower alone than its work) and the run of the test above as a contention.
  slow = dataclasses.replace(calibrate.scaled_learner(profile_from_dict(LONG_TAIL), 3.0),
                             contention=0.5, learner_contention=0.0)
  auto = _measured(slow, tmp_path / "a", "auto")["learner"]
  assert auto["model"] == "scale" and auto["scale"] == pytest.approx(3.0, rel=0.1)
  contended = dataclasses.replace(profile_from_dict(LONG_TAIL), contention=0.5,
                                  learner_contention=1.0)
  auto = _measured(contended, tmp_path / "b", "auto")["learner"]
  assert auto["model"] == "contention" and auto["contention"] == pytest.approx(1.0, rel=0.1)
  with pytest.raises(ValueError, match="model='both'"):
    calibrate.contention_from_run(truth, [], [], OVERLAP, model="both")
