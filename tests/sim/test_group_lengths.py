"""Response lengths drawn as whole measured groups: the length model, the fit that reads them
from a run's records, and why it matters (a long tail fitted by its mean alone is lost)."""

import json

import numpy as np
import pytest

from jaxrl_async.config import RunConfig
from jaxrl_async.sim import fit, profile_from_dict, simulate
from jaxrl_async.sim.profile import LengthModel

SHORT, LONG = (2, 2, 3, 2), (40, 41, 40, 39)


def test_groups_are_drawn_whole_and_clipped_to_the_cap():
  model = LengthModel(kind="groups", min=1, max=40, groups=(SHORT, LONG))
  rows = model.sample_groups(np.random.default_rng(0), 400, 4)
  assert {tuple(r) for r in rows} == {SHORT, (40, 40, 40, 39)}  # 41 clipped to the cap
  # Another group size: members of one measured group, drawn with replacement.
  rows = model.sample_groups(np.random.default_rng(1), 400, 3)
  assert all(set(r) <= set(SHORT) or set(r) <= {39, 40} for r in rows)
  assert {min(r) >= 39 for r in rows} == {True, False}
  # The marginal: a random member of a random group.
  draws = model.sample(np.random.default_rng(2), 20_000)
  assert set(np.unique(draws)) == {2, 3, 39, 40}
  assert draws.mean() == pytest.approx((sum(SHORT) + 40 * 3 + 39) / 8, rel=0.03)


def test_other_kinds_draw_members_on_their_own():
  model = LengthModel(kind="fixed", value=5, min=1, max=9)
  assert model.sample_groups(np.random.default_rng(0), 3, 2) == [[5, 5]] * 3


@pytest.mark.parametrize("groups", [(), ((),), ((3, -1),), ((2.5, 3),)])
def test_bad_groups_are_refused_by_name(groups):
  with pytest.raises(ValueError, match="response_length.groups"):
    LengthModel(kind="groups", groups=groups)


def test_a_groups_profile_survives_json():
  base = {"response_length": {"kind": "groups", "min": 1, "max": 41, "groups": [SHORT, LONG]}}
  loaded = profile_from_dict(json.loads(json.dumps(profile_from_dict(base).to_dict())))
  assert loaded.response_length.groups == (SHORT, LONG)


TRUTH = {"name": "long_tail", "prompt_tokens": 8,
         # 7 in 8 groups answer in 2-3 tokens, 1 in 8 runs to 60-64: the tail holds the step.
         "response_length": {"kind": "groups", "min": 1, "max": 64,
                             "groups": [[2, 3, 2, 2]] * 7 + [[60, 64, 62, 64]]},
         "rollout": {"replicas": 1, "slots": 32, "decode_curve": [[1, 0.004]]},
         "reward_latency": {"kind": "fixed", "value": 1e-4},
         "learner": {"per_update_s": 0.01, "s_per_token": 2e-4},
         "sync": {"fixed_s": 0.005}}
GEOMETRY = dict(group_size=4, mini_batch_size=8, max_concurrent_decodes=32, total_samples=6400)
CONFIG_GIN = ("x.config.RunConfig.group_size = 4\nx.config.RunConfig.mini_batch_size = 8\n"
              "x.config.RunConfig.max_concurrent_decodes = 32\nx.config.RunConfig.mode = 'sync'\n"
              "x.tasks.rlvr.RLVRReverseTask.max_len = 63\n")


def _fitted(tmp_path, *, keep_groups: bool):
  run = simulate(profile_from_dict(TRUTH), RunConfig(mode="sync", **GEOMETRY))
  run.write(tmp_path)
  (tmp_path / "config.gin").write_text(CONFIG_GIN)
  if not keep_groups:  # a run recorded before `lengths/groups` existed
    path = tmp_path / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "lengths/groups"})
                            + "\n" for r in rows))
  return fit.profile_from_run(str(tmp_path))


def test_the_fit_keeps_the_runs_groups_and_the_tasks_cap(tmp_path):
  fitted = _fitted(tmp_path, keep_groups=True)
  length = fitted.response_length
  assert (length.kind, length.max) == ("groups", 64)  # RLVRReverseTask.max_len + 1
  assert set(length.groups) == {(2, 3, 2, 2), (60, 64, 62, 64)}
  assert fitted.rollout.decode_curve[0][1] == pytest.approx(0.004, rel=0.1)


def test_simulated_runs_draw_the_fitted_groups_and_keep_the_tail(tmp_path):
  """A run fitted with its groups simulates groups of the run (as `lengths/groups` records
  show) and its long tail (p90); the mean-only family, the fallback, spreads the same mean
  over every member and loses the tail."""
  config = RunConfig(mode="async_partial", staleness_threshold=0.5, partial_rollout=True,
                     max_version_gap=2, **GEOMETRY)
  truth = simulate(profile_from_dict(TRUTH), config).summary
  with_groups = simulate(_fitted(tmp_path / "a", keep_groups=True), config, seed=1)
  mean_only = simulate(_fitted(tmp_path / "b", keep_groups=False), config, seed=1)
  measured = {(2, 3, 2, 2), (60, 64, 62, 64)}
  drawn = {tuple(g) for r in with_groups.records for g in r.get("lengths/groups", ())}
  assert drawn and {tuple(sorted(g)) for g in drawn} <= {tuple(sorted(g)) for g in measured}
  assert with_groups.summary["lengths/generated_p90"] == truth["lengths/generated_p90"] >= 60
  assert mean_only.summary["lengths/generated_p90"] < 0.6 * truth["lengths/generated_p90"]
  assert with_groups.summary["lengths/generated_mean"] == pytest.approx(
      truth["lengths/generated_mean"], rel=0.1)
