"""The report's staleness figure: drawn when a run's version records carry the adaptive
controller's `staleness/threshold`, absent otherwise."""

from __future__ import annotations

import json
import os
import re

import pytest

from jaxrl_async import report

pytest.importorskip("matplotlib")


def write_run(path, thresholds):
  """Version records; `thresholds` None leaves `staleness/threshold` out (a 'fixed' run)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for version in range(1, 7):
      record = {"policy_version": version, "learner_step": version, "samples": 8 * version,
                "time_s": float(version), "algo/version_gap_max": 1,
                "result/reward_mean": 0.5}
      if thresholds is not None:
        record["staleness/threshold"] = thresholds[version - 1]
      f.write(json.dumps(record) + "\n")


def test_staleness_is_drawn_only_for_runs_that_record_it(tmp_path):
  write_run(tmp_path / "adaptive", [0.5, 0.5, 0.75, 0.75, 1.0, 1.0])
  write_run(tmp_path / "fixed", None)
  paths = report.write_report([str(tmp_path / "fixed")], str(tmp_path / "out_fixed"))
  assert set(paths) == {*report.FIGURES, "html"}
  assert not os.path.exists(tmp_path / "out_fixed" / "staleness.png")
  run = report.load_run(str(tmp_path / "adaptive"))
  assert report.has_staleness(run) and not report.has_staleness(
      report.load_run(str(tmp_path / "fixed")))
  paths = report.write_report([str(tmp_path / "adaptive"), str(tmp_path / "fixed")],
                              str(tmp_path / "out"))
  with open(paths["staleness"], "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  assert os.path.getsize(paths["staleness"]) > 10_000  # a drawn figure
  with open(paths["html"], encoding="utf-8") as f:
    assert "staleness.png" in re.findall(r'<img src="([^"]+)"', f.read())
