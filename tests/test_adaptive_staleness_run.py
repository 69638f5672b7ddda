"""A whole adaptive-staleness run on the threads backend: the records carry the s in force
and its changes, the buffer's admission takes each new s at its window, and a resume goes on
with the checkpoint's s."""

from __future__ import annotations

import os

import pytest

from jaxrl_async.buffer import admission_budget
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from tests.backends.test_backend_contract import (
  checkpoint_run_state,
  quiet,
  run_mode,
  tiny_config,
)

# The learner is never busy for a whole version (idle_target 0) and no budget can be broken
# (stale_ratio <= 1, KL far below 100): s rises by a step every version until staleness_max.
RISING = dict(mode="async_stale", staleness_threshold=0.5, staleness_controller="adaptive",
              staleness_window_versions=1, staleness_step=0.5, staleness_min=0.0,
              staleness_max=1.5, idle_target=0.0, stale_ratio_budget=1.0, kl_budget=100.0,
              staleness_hysteresis=0.0, eval_every_versions=4, checkpoint_every_versions=2)


def window_threshold(records, window: int, initial: float) -> float:
  """The s of admission window `window`: record r's `staleness/threshold` is window r's."""
  return records[window - 1]["staleness/threshold"] if window >= 1 else initial


def check_adaptive_run(backend: str, run_dir) -> None:
  """Four versions rising from 0.5 to 1.5, checkpoints at 2 and 4 whose buffer budgets are
  those of the controller's s, then a resume to 6 versions that keeps s = 1.5."""
  config = tiny_config(backend, 4, **RISING)
  summary, records = run_mode(config, run_dir)
  assert [r["staleness/threshold"] for r in records] == [0.5, 1.0, 1.5, 1.5]
  assert [r["staleness/change"] for r in records] == [0.5, 0.5, 0.0, 0.0]
  # The KL to the behaviour policy is measured on every update (>= 0: the k3 estimate).
  assert all(0.0 <= r["staleness/window_kl"] < 100.0 for r in records), records
  assert all("idle_ratio" in r["staleness/reason"] for r in records[:2])
  assert "at staleness_max 1.5" in records[2]["staleness/reason"]
  assert summary["staleness/threshold"] == 1.5
  n = config.groups_per_version
  for step in (2, 4):
    run_state = checkpoint_run_state(run_dir, step)
    assert run_state["staleness"]["threshold"] == records[step - 1]["staleness/threshold"] + (
        records[step - 1]["staleness/change"])
    ledger = run_state["buffer"]["ledger"]
    window = run_state["buffer"]["rollout_version"]
    # The window open at the checkpoint admits by its own s; a later s waits for its version.
    assert ledger["budget"] == admission_budget(window_threshold(records, window, 0.5), n), (
        step, window, ledger, [r["staleness/threshold"] for r in records])
    assert ledger["used"] <= max(ledger["budget"], ledger["carried"])
    # Budgets decided for later windows wait, each for its version; the last is the
    # controller's s.
    assert all(version > window for version, _ in ledger["scheduled"])
    if ledger["scheduled"]:
      assert ledger["scheduled"][-1][1] == admission_budget(
          run_state["staleness"]["threshold"], n)
  # Resume: versions 5 and 6 start from the checkpoint's s, not staleness_threshold.
  longer = tiny_config(backend, 6, **RISING)
  summary = api.run(longer, str(run_dir), resume=True, progress=False, log=quiet)
  resumed = [r for r in read_jsonl(os.path.join(str(run_dir), "metrics.jsonl"))
             if "algo/version_gap_max" in r]
  assert [r["staleness/threshold"] for r in resumed] == [0.5, 1.0, 1.5, 1.5, 1.5, 1.5]
  assert summary["staleness/threshold"] == 1.5
  assert checkpoint_run_state(run_dir, 6)["staleness"]["threshold"] == 1.5


@pytest.mark.slow
def test_an_adaptive_run_moves_s_its_buffer_follows_and_a_resume_keeps_it(tmp_path):
  check_adaptive_run("threads", tmp_path / "run")
