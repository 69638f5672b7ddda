"""A processes-backend rollout server that dies when the run stops it (`rollout.stop=kill`), or
hangs there (`rollout.stop=hang`: killed when its stop times out), gives no last answer; the
fleet accounts for it from the buffer's record of its client, so the run's ledger still knows
every group it started (before, the groups it drew after its last heartbeat were unknown to the
audit), and the run ends normally."""

from __future__ import annotations

import json

import pytest

from jaxrl_async.backends.processes.fleet import LOST_REASON, lost_answer
from tests import run_lives


def test_a_lost_server_answer_takes_the_buffers_group_ids_and_drops_its_unfinished_samples():
  health = {"next_group_id": 6, "counts": {"generated": 9},
            "drops": [("reward_failed", [(4, 1)])]}
  orphan = {"next_group_id": 10, "prompt_state": None,
            "inflight": [{"group_id": 4, "missing": [1, 3]}, {"group_id": 8, "missing": [0]}]}
  answer = lost_answer(health, orphan)
  assert answer["next_group_id"] == 10 and answer["counts"] == {"generated": 9}
  # (4, 1) was dropped already: not twice
  assert answer["drops"] == [("reward_failed", [(4, 1)]), (LOST_REASON, [(4, 3), (8, 0)])]
  assert health["drops"] == [("reward_failed", [(4, 1)])]  # not changed in place
  nothing = lost_answer({}, {"next_group_id": None, "inflight": []})
  assert nothing == {"drops": []}


@pytest.mark.slow
# A hung server's stop times out (60 s) before it is killed: one server there.
@pytest.mark.parametrize("action,servers", [("kill", 2), ("hang", 1)])
def test_servers_lost_at_the_stop_leave_a_clean_audit(tmp_path, action, servers):
  run_dir = tmp_path / "run"
  bindings = run_lives.TINY_BINDINGS + ("RunConfig.backend = 'processes'",
                                        f"RunConfig.num_rollout_servers = {servers}",
                                        "RunConfig.total_samples = 64")
  process = run_lives.start(run_dir, "gin/modes/async_partial.gin", bindings,
                            faults_plan=f"rollout.stop={action}")
  code, out, err, _ = run_lives.finish(process, 600)
  assert code == 0, f"{out[-2000:]}\n{err[-4000:]}"
  assert err.count(f"{action} at fault point rollout.stop") == servers, err[-4000:]
  if action == "hang":  # the stop timed out, then the server was killed
    assert "did not stop cleanly" in out + err, (out + err)[-4000:]
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["ledger/consumed"] == 64
  assert (summary["ledger/missing"], summary["ledger/duplicates"],
          summary["ledger/unknown"]) == (0, 0, 0), summary
  assert summary["ledger/produced"] == summary["ledger/consumed"] + sum(
      value for key, value in summary.items() if key.startswith("ledger/dropped/"))


@pytest.mark.slow
def test_a_clean_stop_accounts_for_no_server_as_lost(tmp_path):
  """The run stops its servers, then the backend's own exit stops the fleet again: that second
  stop does nothing (before, it found every server gone and accounted it as lost)."""
  run_dir = tmp_path / "run"
  bindings = run_lives.TINY_BINDINGS + ("RunConfig.backend = 'processes'",
                                        "RunConfig.total_samples = 64")
  process = run_lives.start(run_dir, "gin/modes/async_partial.gin", bindings)
  code, out, err, _ = run_lives.finish(process, 600)
  assert code == 0, f"{out[-2000:]}\n{err[-4000:]}"
  assert "gone at the stop" not in out + err, (out + err)[-4000:]
  assert LOST_REASON not in out + err, (out + err)[-4000:]
  summary = json.loads((run_dir / "summary.json").read_text())
  assert summary["ledger/consumed"] == 64
  assert summary.get(f"ledger/dropped/{LOST_REASON}", 0) == 0, summary
