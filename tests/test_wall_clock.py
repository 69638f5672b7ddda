"""A run's wall-clock (`system/wall_s`, the denominator of samples/s) ends with its last version:
the rollout servers' stop is not training time, as their start is not, and the sync mode, which
has no servers, pays for neither. Here the stop is made 3 s long by a fault delay."""

from __future__ import annotations

import json

import pytest

from jaxrl_async.metrics import read_jsonl
from tests import run_lives

STOP_DELAY_S = 3.0


@pytest.mark.slow
def test_the_servers_stop_is_not_in_the_runs_wall_clock(tmp_path):
  run_dir = tmp_path / "run"
  bindings = run_lives.TINY_BINDINGS + ("RunConfig.backend = 'threads'",
                                        "RunConfig.total_samples = 64")
  process = run_lives.start(run_dir, "gin/modes/async_partial.gin", bindings,
                            faults_plan=f"rollout.stop=delay:{STOP_DELAY_S}")
  code, out, err, _ = run_lives.finish(process, 600)
  assert code == 0, f"{out[-2000:]}\n{err[-4000:]}"
  assert "delay at fault point rollout.stop" in err, err[-4000:]
  summary = json.loads((run_dir / "summary.json").read_text())
  last_record = max(record["time_s"] for record in read_jsonl(run_dir / "metrics.jsonl")
                    if "system/samples_per_s" in record)  # the versions' records
  # What comes after the last record and is not excluded: joining the learner thread, the
  # buffer's and the ledger's closing counts (milliseconds), well under the delay.
  assert 0.0 <= summary["system/wall_s"] - last_record < STOP_DELAY_S / 3, (
      summary["system/wall_s"], last_record)
