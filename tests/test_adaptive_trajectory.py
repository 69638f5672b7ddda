"""benchmarks/adaptive_trajectory.py's comparison of a measured and a predicted s path."""

from __future__ import annotations

import pytest

from benchmarks import adaptive_trajectory as at


def _records(path, changes=None):
  changes = changes or {}
  records = []
  for index, s in enumerate(path):
    record = {"staleness/threshold": s}
    if index in changes:
      record.update({"staleness/change": changes[index][0], "staleness/reason": changes[index][1]})
    records.append(record)
  return records


def test_paths_are_compared_version_by_version_over_the_shorter_one():
  measured = [0.5, 0.5, 0.75, 0.75, 1.0]
  predicted = [0.5, 0.75, 0.75, 1.0]  # one version shorter
  result = at.compare_paths(measured, predicted)
  assert result["versions"] == 4
  assert result["mean_threshold_measured"] == pytest.approx(2.5 / 4)
  assert result["mean_threshold_predicted"] == pytest.approx(3.0 / 4)
  # |gaps| 0, 0.25, 0, 0.25 -> 0.125 a version, over the measured mean 0.625
  assert result["trajectory_error"] == pytest.approx(0.125 / 0.625)
  assert result["final_threshold_measured"] == 0.75
  assert at.compare_paths(measured, measured)["trajectory_error"] == 0.0
  with pytest.raises(ValueError, match="no versions"):
    at.compare_paths([], predicted)


def test_changes_name_the_version_the_new_s_and_the_reason():
  records = _records([0.5, 0.5, 0.75, 0.75], {1: (0.25, "idle_ratio 0.3 > idle_target 0.1"),
                                               3: (-0.25, "kl 0.01 > kl_budget 0.004")})
  assert at.changes_of(records) == [(2, 0.75, "idle_ratio 0.3 > idle_target 0.1"),
                                    (4, 0.5, "kl 0.01 > kl_budget 0.004")]
  assert at.path_of(records) == [0.5, 0.5, 0.75, 0.75]
