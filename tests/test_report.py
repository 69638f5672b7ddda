"""jaxrl_async.report on two small real runs (sync and async_partial): every figure and the HTML
page that shows them; the stage timeline's window; the version-gap shares; and the TensorBoard
events of a real run, read back with TensorBoard's reader. Hand-made run directories for the rest."""

import json
import os
import re

import pytest

from jaxrl_async import cli, report
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.metrics import ROLES
from jaxrl_async.run import api
from jaxrl_async.tasks.reverse import DigitReverseTask

pytest.importorskip("matplotlib")

VERSIONS = 6


def tiny_config(**overrides) -> RunConfig:
  # precompile_updates off: a tiny run meets few of the row counts it would compile ahead
  settings = dict(task=DigitReverseTask(0, max_len=8), precompile_updates=False,
                  warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=4,
                  mini_batch_size=2, total_samples=VERSIONS * 8, max_concurrent_decodes=8,
                  eval_size=16, eval_every_versions=2, checkpoint_every_versions=VERSIONS)
  settings.update(overrides)
  return RunConfig(**settings)


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
  root = tmp_path_factory.mktemp("runs")
  configs = {"sync": tiny_config(),
             "async_partial": tiny_config(mode="async_partial", staleness_threshold=1.0,
                                          partial_rollout=True, max_version_gap=2)}
  dirs = []
  for name, config in configs.items():
    run_dir = str(root / name)
    api.run(config, run_dir, progress=False, log=lambda *a: None)
    dirs.append(run_dir)
  out = str(root / "report")
  return {"dirs": dirs, "out": out, "paths": report.write_report(dirs, out)}


@pytest.mark.slow
def test_report_writes_every_figure_and_the_page_shows_them(two_runs):
  paths = two_runs["paths"]
  assert set(paths) == {*report.FIGURES, "html"}
  for name in report.FIGURES:
    with open(paths[name], "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n", name
    assert os.path.getsize(paths[name]) > 10_000, name  # a drawn figure, not an empty canvas
  with open(paths["html"], encoding="utf-8") as f:
    page = f.read()
  assert sorted(re.findall(r'<img src="([^"]+)"', page)) == sorted(
      f"{name}.png" for name in report.FIGURES)
  for run_dir in two_runs["dirs"]:
    assert os.path.abspath(run_dir) in page
  assert "<th>sync</th>" in page and "<th>async_partial</th>" in page


@pytest.mark.slow
def test_runs_record_spans_of_every_role_and_gap_counts(two_runs):
  sync, async_run = (report.load_run(d) for d in two_runs["dirs"])
  for run in (sync, async_run):
    assert {role for role, _, _ in run.spans} == set(ROLES), run.name
    assert all(0.0 <= start <= end for _, start, end in run.spans)
    assert [r["policy_version"] for r in run.versions] == list(range(1, VERSIONS + 1))
    window = report.timeline_window(run, 4)
    assert window is not None and window[1] - window[0] == 4
  assert report.gap_shares(sync) == [1.0]  # on-policy: every token at gap 0
  shares = report.gap_shares(async_run)
  assert sum(shares) == pytest.approx(1.0) and len(shares) <= 3  # max_version_gap = 2
  # Every consumed token is counted once, in one gap bucket.
  tokens = sum(sum(r["algo/version_gap_counts"]) for r in async_run.versions)
  with open(os.path.join(two_runs["dirs"][1], "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  assert tokens == pytest.approx(summary["system/tokens_per_s"] * summary["system/wall_s"],
                                 abs=0.5)


@pytest.mark.slow
def test_a_real_run_writes_tensorboard_events_on_every_axis(two_runs):
  accumulator_module = pytest.importorskip(
      "tensorboard.backend.event_processing.event_accumulator")
  run = report.load_run(two_runs["dirs"][0])
  accumulator = accumulator_module.EventAccumulator(
      os.path.join(two_runs["dirs"][0], "tensorboard", "policy_version"),
      size_guidance={accumulator_module.SCALARS: 0})
  accumulator.Reload()
  tags = set(accumulator.Tags()["scalars"])
  assert {"result/reward_mean", "algo/stale_ratio", "learner/idle_ratio",
          "eval/accuracy"} <= tags
  steps = [event.step for event in accumulator.Scalars("result/reward_mean")]
  assert steps == [r["policy_version"] for r in run.versions]


def write_run(path, versions, spans=()):
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for version, time_s in versions:
      f.write(json.dumps({"policy_version": version, "learner_step": version,
                          "samples": 8 * version, "time_s": time_s,
                          "algo/version_gap_max": 0, "result/reward_mean": 0.5}) + "\n")
  with open(os.path.join(path, "spans.jsonl"), "w", encoding="utf-8") as f:
    for role, start, end in spans:
      f.write(json.dumps({"role": role, "start": start, "end": end}) + "\n")


def test_timeline_window_stays_within_the_recorded_spans(tmp_path):
  versions = [(v, float(v)) for v in range(1, 21)]
  # Only spans from t = 10 s on survived the cap: the window lies in versions 10..20.
  write_run(tmp_path / "a", versions, [("learner", 10.0 + i * 0.5, 10.2 + i * 0.5)
                                       for i in range(20)])
  run = report.load_run(str(tmp_path / "a"))
  start, end = report.timeline_window(run, 4)
  assert start >= 10 and end <= 20 and end - start == 4
  write_run(tmp_path / "b", versions)  # no spans
  assert report.timeline_window(report.load_run(str(tmp_path / "b")), 4) is None


def test_handoff_marks_sit_after_their_versions_boundary(tmp_path):
  # The publishes of versions 1 and 2 began at 0.5 and 1.9 (the last sync span before each).
  write_run(tmp_path, [(1, 1.0), (2, 2.0), (3, 3.0)], [("sync", 0.5, 0.6), ("sync", 1.9, 1.95),
                                                        ("sync", 2.5, 2.6)])
  run = report.load_run(str(tmp_path))
  # The record of version 3 carries version 2's hand-off; version 2 has none recorded.
  run.versions[2].update({"handoff/publish_to_work_s": 0.01, "handoff/publish_to_enqueue_s": 0.2,
                          "handoff/publish_to_take_s": 0.5})
  run.versions[1].update({"handoff/publish_to_work_s": 0.03})
  marks = report.handoff_marks(run, (1, 2))
  assert marks["publish_to_work_s"] == pytest.approx([0.53, 1.91])
  assert marks["publish_to_enqueue_s"] == pytest.approx([2.1])
  assert marks["publish_to_take_s"] == pytest.approx([2.4])
  assert report.handoff_marks(run, (0, 0)) == {name: [] for name, _, _ in report.HANDOFF_MARKS}


def test_names_and_errors(tmp_path, capsys):
  assert report.run_names(["x/sync", "y/async"]) == ["sync", "async"]
  assert report.run_names(["x/run", "y/run"]) == [os.path.join("x", "run"),
                                                  os.path.join("y", "run")]
  assert cli.main(["report", str(tmp_path / "nothing")]) == 2
  assert "no metrics.jsonl" in capsys.readouterr().err
  with pytest.raises(ValueError, match="timeline_versions"):
    report.write_report([str(tmp_path)], str(tmp_path / "out"), timeline_versions=0)


def test_report_of_a_run_without_spans_or_queue_still_draws(tmp_path):
  write_run(tmp_path / "run", [(1, 1.0), (2, 2.0)])
  assert cli.main(["report", str(tmp_path / "run")]) == 0
  for name in report.FIGURES:
    assert os.path.isfile(tmp_path / "run" / "report" / f"{name}.png")


def test_long_run_names_go_by_numbers_with_a_key(tmp_path):
  long_names = ["000-staleness_threshold=0.5,trigger_parameter_sync_step=1",
                "001-staleness_threshold=1.0,trigger_parameter_sync_step=2"]
  for name in long_names:
    write_run(tmp_path / name, [(1, 1.0), (2, 2.0)])
  paths = report.write_report([str(tmp_path / n) for n in long_names], str(tmp_path / "out"))
  with open(paths["html"], encoding="utf-8") as f:
    page = f.read()
  assert f"<th>1: {long_names[0]}</th>" in page and f"<th>2: {long_names[1]}</th>" in page
