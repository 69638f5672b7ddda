"""Profiles (validation, fit from a run directory, published setups), the sweep, the command."""

import json

import numpy as np
import pytest

from jaxrl_async import cli
from jaxrl_async.config import RunConfig
from jaxrl_async.sim import fit, profile_from_dict, published, simulate, sweep
from jaxrl_async.sim.profile import LengthModel
from launch import simulate as command

PROFILE = {"name": "small", "prompt_tokens": 8,
           "response_length": {"kind": "geometric", "min": 1, "max": 25, "ratio": 0.8},
           "rollout": {"replicas": 1, "slots": 32, "decode_curve": [[1, 0.004]]},
           "reward_latency": {"kind": "fixed", "value": 1e-4},
           "learner": {"per_update_s": 0.01, "s_per_token": 2e-4},
           "sync": {"fixed_s": 0.005}, "sync_mode_overhead_s": 0.02}
GEOMETRY = dict(group_size=4, mini_batch_size=8, max_concurrent_decodes=32, total_samples=3200)


def test_bad_profile_fields_name_the_field_and_the_allowed_values():
  with pytest.raises(ValueError, match="unknown fields \\['slot'\\]"):
    profile_from_dict({**PROFILE, "rollout": {"slot": 3}})
  with pytest.raises(ValueError, match="response_length.kind='poisson'"):
    profile_from_dict({**PROFILE, "response_length": {"kind": "poisson"}})
  with pytest.raises(ValueError, match="reward_fail_prob"):
    profile_from_dict({**PROFILE, "reward_fail_prob": 1.5})


def test_geometric_ratio_matches_the_mean():
  ratio = fit.geometric_ratio(6.0, 1, 25)
  assert LengthModel(kind="geometric", min=1, max=25, ratio=ratio).mean() == pytest.approx(6.0,
                                                                                         rel=0.02)


def test_fit_recovers_a_simulated_sync_run(tmp_path):
  """Round trip: a simulated sync run's metrics.jsonl, fitted, predicts its samples/s."""
  truth = profile_from_dict(PROFILE)
  run = simulate(truth, RunConfig(mode="sync", **GEOMETRY))
  run.write(tmp_path)
  (tmp_path / "config.gin").write_text(
      "x.config.RunConfig.group_size = 4\nx.config.RunConfig.mini_batch_size = 8\n"
      "x.config.RunConfig.max_concurrent_decodes = 32\nx.config.RunConfig.mode = 'sync'\n")
  fitted = fit.profile_from_run(str(tmp_path))
  again = simulate(fitted, RunConfig(mode="sync", **GEOMETRY), seed=1)
  assert again.summary["system/samples_per_s"] == pytest.approx(
      run.summary["system/samples_per_s"], rel=0.05)
  step = fitted.rollout.decode_curve[0][1]
  assert step == pytest.approx(0.004, rel=0.1)
  assert fitted.sync.fixed_s == pytest.approx(0.005)


def test_a_given_fixed_fraction_splits_the_learner_into_its_two_costs(tmp_path):
  """Every update of a sync run has one size, so the run alone cannot separate the cost per
  update from the cost per token; the measured fraction that does not grow with tokens does."""
  truth = profile_from_dict(PROFILE)
  simulate(truth, RunConfig(mode="sync", **GEOMETRY)).write(tmp_path)
  (tmp_path / "config.gin").write_text(
      "x.config.RunConfig.group_size = 4\nx.config.RunConfig.mini_batch_size = 8\n"
      "x.config.RunConfig.max_concurrent_decodes = 32\nx.config.RunConfig.mode = 'sync'\n")
  tokens_per_update = 32 * truth.response_length.mean()
  fraction = 0.01 / (0.01 + 2e-4 * tokens_per_update)
  fitted = fit.profile_from_run(str(tmp_path), learner_fixed_fraction=fraction)
  assert fitted.learner.per_update_s == pytest.approx(0.01, rel=0.05)
  assert fitted.learner.s_per_token == pytest.approx(2e-4, rel=0.05)
  assert any("fixed per update" in note for note in fitted.notes)
  with pytest.raises(ValueError, match="learner_fixed_fraction=1.0 must be in"):
    fit.profile_from_run(str(tmp_path), learner_fixed_fraction=1.0)


def test_fit_refuses_a_directory_without_metrics(tmp_path):
  with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
    fit.profile_from_run(str(tmp_path))


def test_sweep_returns_the_fastest_setting_within_the_budget():
  profile = profile_from_dict(PROFILE)
  result = sweep.sweep(profile, RunConfig(mode="sync", **GEOMETRY), total_samples=768,
                       max_gap=0, max_stale_ratio=0.0, staleness=(0.0, 0.5), triggers=(1, 2),
                       require=(1,))
  assert len(result["rows"]) == 2 + 2 * 2
  best = result["best"]
  assert best["meets_budget"] and best["staleness_threshold"] == 0.0
  fits = [r for r in result["rows"] if r["meets_budget"]]
  assert best["system/samples_per_s"] == max(r["system/samples_per_s"] for r in fits)
  assert all(r["algo/stale_ratio"] > 0 for r in result["rows"]
             if r["staleness_threshold"] > 0 and not r["meets_budget"])
  assert result["total_samples"] == 768


def test_verl_profile_reproduces_the_published_sync_step():
  profile, configs = published.verl_setup(128, calibration_versions=2)
  result = simulate(profile, configs["sync"], num_versions=4)
  step = result.summary["system/wall_s"] / 4
  assert step == pytest.approx(356.30, rel=0.1)  # calibrated on the sync run's stage times
  assert configs["async_partial_s0.5"].groups_per_version * profile.rollout.replicas == 32


def _table(runs, b=0.0):
  return {"assumed": {"learner_gpu_scaling_exponent": {"value": b}},
          "published": {str(g): dict(zip(("split", "sync_step_s", "sync_gen_s",
                                          "sync_old_log_prob_s", "sync_update_actor_s",
                                          "async_step_s", "speedup_400_steps"), r))
                        for g, r in runs.items()}}


def test_table_consistency_bounds_each_speedup_by_its_learner():
  # 64 GPUs (32 train): the 32-GPU run's update took 80 s, so the step is >= 80 s: <= 2.5x.
  spec = _table({32: ([16, 16], 200.0, 100.0, 20.0, 80.0, 100.0, 2.0),
                 64: ([32, 32], 200.0, 100.0, 20.0, 40.0, 66.7, 3.0)}, b=1.0)
  table = published.table_consistency(spec)
  assert table["64"]["learner_bound_s"] == pytest.approx(
      {"scaled_b0": 40.0, "scaled_b": 80.0, "direct": 80.0})
  assert table["64"]["largest_speedup"]["direct"] == pytest.approx(2.5)
  assert table["64"]["published_exceeds"] == ["direct", "scaled_b"]
  # 32 GPUs: 2.0x is within 200 / 80 (b = 0) but not within 200 / (80 * 2) (b = 1).
  assert table["32"]["published_exceeds"] == ["scaled_b"]
  assert "direct" not in table["32"]["learner_bound_s"]
  assert table["64"]["gpu_s_per_step"]["update_actor"] == pytest.approx(40.0 * 64)


def test_the_published_verl_table_exceeds_its_own_learner_bound_at_32_gpus():
  """At 32 GPUs the published async step (294.77 s) is shorter than the sync run's update alone
  (313.81 s on twice the GPUs): no profile with equal work per step can reach 2.66x."""
  table = published.table_consistency()
  assert table["32"]["largest_speedup"]["scaled_b0"] == pytest.approx(790.1 / 313.81)
  assert "scaled_b0" in table["32"]["published_exceeds"]
  assert all("scaled_b" in table[g]["published_exceeds"] for g in ("32", "64", "128"))


def test_simulate_command_writes_real_run_metrics(tmp_path, capsys):
  path = tmp_path / "profile.json"
  path.write_text(json.dumps(PROFILE))
  out = tmp_path / "sim"
  assert cli.main(["simulate", "--profile", str(path), "--modes", "sync,async_stale",
                   "--num_versions", "6", "--gin_bindings", "RunConfig.group_size = 4",
                   "--out", str(out)]) == 0
  line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert line["modes"]["sync"]["speedup_vs_sync"] == 1.0
  assert line["modes"]["async_stale"]["algo/version_gap_max"] <= 2
  records = [json.loads(x) for x in (out / "async_stale" / "metrics.jsonl").read_text().splitlines()]
  assert [r["policy_version"] for r in records] == list(range(1, 7))
  assert np.isfinite(records[-1]["system/samples_per_s"])
  assert command.main(["--profile", str(path), "--modes", "bogus"]) == 2


def test_span_totals_clip_to_the_fitted_window(tmp_path):
  path = tmp_path / "spans.jsonl"
  rows = [("rollout", 0.0, 2.0), ("learner", 2.0, 5.0), ("rollout", 5.0, 6.0)]
  path.write_text("".join(json.dumps({"role": r, "start": a, "end": b}) + "\n"
                          for r, a, b in rows))
  assert fit.span_totals(str(path), 1.0, 5.5) == {"rollout": 1.5, "learner": 3.0}
  assert fit.span_totals(str(path), -1.0, 5.5) is None  # spans start after the window


def test_published_setups_take_run_config_bindings_on_top_and_refuse_others(capsys):
  """`--published` with `RunConfig.<field>` bindings: the published settings with the binding
  applied (a what-if question); any other binding fails naming it."""
  args = command.parse_args(["--published", "verl:128", "--modes", "async_partial_s0.5",
                             "--gin_bindings", "RunConfig.staleness_threshold = 0.3",
                             "--gin_bindings", "RunConfig.require_batches = 2"])
  _, configs = command.load(args)
  _, published_configs = command.load(command.parse_args(["--published", "verl:128"]))
  config = configs["async_partial_s0.5"]
  assert (config.staleness_threshold, config.require_batches) == (0.3, 2)
  assert published_configs["async_partial_s0.5"].staleness_threshold == 0.5
  assert config.group_size == published_configs["async_partial_s0.5"].group_size
  for binding, named in (("LearnerConfig.learning_rate = 1.0", "only 'RunConfig.<field>"),
                         ("RunConfig.stalenes = 0.3", "no field 'stalenes'")):
    assert command.main(["--published", "verl:128", "--gin_bindings", binding]) == 2
    assert named in capsys.readouterr().err
