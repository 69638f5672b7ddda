"""launch/sweep.py: the shipped sweep (two of its four trials, on a tiny budget) runs to completion
with its summary table and a second run skips every trial; a crashed trial is reported, left alone, and re-run on
request. Trials are real `python -m launch.train` subprocesses."""

import json
import os

import pytest

from launch import sweep
from tests import run_lives

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "launch", "sweeps", "staleness_x_trigger.py")
# The example's trials vary mini_batch_size and trigger (8 groups per version); group_size 4 and
# 64 samples make 2 policy versions a trial.
TINY = ["DigitReverseTask.max_len = 8", "WarmStartConfig.steps = 20",
        "WarmStartConfig.batch_size = 16", "RunConfig.group_size = 4",
        "RunConfig.total_samples = 64", "RunConfig.max_concurrent_decodes = 8",
        "RunConfig.eval_size = 16", "RunConfig.eval_every_versions = 2",
        "RunConfig.checkpoint_every_versions = 2"]


def test_example_sweep_defines_the_four_trials():
  loaded = sweep.load_sweep(EXAMPLE)
  assert loaded.name == "staleness_x_trigger"
  assert [(t["RunConfig.staleness_threshold"], t["RunConfig.trigger_parameter_sync_step"],
           t["RunConfig.mini_batch_size"]) for t in loaded.trials] == [
               (0.5, 1, 8), (0.5, 2, 4), (1.0, 1, 8), (1.0, 2, 4)]
  names = [sweep.trial_name(i, t) for i, t in enumerate(loaded.trials)]
  assert len(set(names)) == 4 and names[1].startswith("001-staleness_threshold=0.5,")


def test_trial_bindings_are_gin_literals():
  assert sweep.trial_bindings({"RunConfig.mode": "sync", "RunConfig.max_version_gap": None,
                               "RunConfig.staleness_threshold": 0.5,
                               "RunConfig.partial_rollout": True}) == [
      "RunConfig.mode = 'sync'", "RunConfig.max_version_gap = None",
      "RunConfig.staleness_threshold = 0.5", "RunConfig.partial_rollout = True"]


def test_bad_sweep_files_are_refused(tmp_path):
  empty = tmp_path / "empty.py"
  empty.write_text("TRIALS = []\n")
  with pytest.raises(ValueError, match="no trials"):
    sweep.load_sweep(str(empty))
  nothing = tmp_path / "nothing.py"
  nothing.write_text("x = 1\n")
  with pytest.raises(ValueError, match="TRIALS"):
    sweep.load_sweep(str(nothing))
  assert sweep.main([str(tmp_path / "missing.py")]) == 2
  assert sweep.main([str(empty), "--parallel", "0"]) == 2


def _half_of_the_example(tmp_path) -> str:
  """The example with its trigger-1 trials only (one compiled update shape for both): what
  `run_sweep` does is the same for two trials as for four, at half the cost."""
  path = tmp_path / "half.py"
  path.write_text(f"import runpy\n_EXAMPLE = runpy.run_path({EXAMPLE!r})\n"
                  "NAME, GIN_FILES, BINDINGS = (_EXAMPLE[k] for k in ('NAME', 'GIN_FILES', "
                  "'BINDINGS'))\nTRIALS = _EXAMPLE['TRIALS'][::2]\n")
  return str(path)


@pytest.mark.slow
def test_a_sweep_completes_and_resume_skips_it(tmp_path, monkeypatch):
  for name, value in run_lives.TINY_ENV.items():  # the trials are tiny runs
    monkeypatch.setenv(name, value)
  example = _half_of_the_example(tmp_path)
  assert [t["RunConfig.trigger_parameter_sync_step"]
          for t in sweep.load_sweep(example).trials] == [1, 1]
  root = tmp_path / "sweep"
  logs = []
  rows = sweep.run_sweep(example, root=str(root), parallel=2, extra_bindings=TINY,
                         log=logs.append)
  assert [row["status"] for row in rows] == ["done"] * 2, "\n".join(logs)
  for row in rows:
    assert 0.0 <= row["eval/accuracy"] <= 1.0
    assert row["system/samples_per_s"] > 0 and row["process_s"] > 0
    assert 0.0 <= row["stale_ratio"] <= 1.0
    assert row["policy_version"] == 2
    with open(os.path.join(row["run_dir"], "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
    assert summary["mode"] == "async_stale"
    with open(os.path.join(row["run_dir"], "trial.json"), encoding="utf-8") as f:
      state = json.load(f)
    assert state["attempts"] == 1
    assert f"RunConfig.staleness_threshold = {row['bindings']['RunConfig.staleness_threshold']}" \
        in state["bindings"]
  table = (root / "summary.md").read_text()
  for row in rows:
    assert row["trial"] in table
  for column in ("final accuracy", "samples/s", "stale ratio", "train wall-clock s"):
    assert column in table
  assert json.loads((root / "summary.json").read_text())[0]["trial"] == rows[0]["trial"]
  assert table.strip().splitlines()[-1] in "\n".join(logs)  # printed too

  again = []
  rows_again = sweep.run_sweep(example, root=str(root), parallel=2, extra_bindings=TINY,
                               log=again.append)
  assert sum("done, skipped" in line for line in again) == 2
  assert not any("started" in line for line in again)
  assert [r["eval/accuracy"] for r in rows_again] == [r["eval/accuracy"] for r in rows]


def test_crashed_trial_is_reported_and_rerun_on_request(tmp_path):
  sweep_file = tmp_path / "bad.py"
  sweep_file.write_text(
      "from launch import hyper\n"
      "GIN_FILES = ['gin/modes/sync.gin']\n"
      "TRIALS = hyper.sweep('RunConfig.group_size', [1])\n")  # refused at start: exit 2
  root = tmp_path / "runs"
  logs = []
  rows = sweep.run_sweep(str(sweep_file), root=str(root), log=logs.append)
  assert [row["status"] for row in rows] == ["failed"]
  run_dir = rows[0]["run_dir"]
  with open(os.path.join(run_dir, "train.log"), encoding="utf-8") as f:
    assert "group_size" in f.read()
  assert "failed" in (root / "summary.md").read_text()
  assert sweep.main([str(sweep_file), "--root", str(root)]) == 1  # not all done

  logs = []
  sweep.run_sweep(str(sweep_file), root=str(root), log=logs.append)
  assert any("not re-run" in line for line in logs)
  assert not os.path.exists(run_dir + ".failed-1")

  logs = []
  rows = sweep.run_sweep(str(sweep_file), root=str(root), rerun_failed=True, log=logs.append)
  assert rows[0]["status"] == "failed"
  assert any("started" in line for line in logs)
  assert os.path.isdir(run_dir + ".failed-1")  # no checkpoint: the attempt was set aside
