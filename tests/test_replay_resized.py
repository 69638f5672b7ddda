"""A recorded 'processes' run checkpointed with 2 rollout servers and resumed with 1 still
replays: the resumed life's groups are numbered above the first life's (group ids stay unique,
so their sampling keys do) and the full replay draws the recorded tokens bit for bit."""

from __future__ import annotations

import pytest

from jaxrl_async.run.schedule_read import read_schedule
from tests import run_lives
from tests.test_replay_lives import replay_cli

BINDINGS = run_lives.TINY_BINDINGS + (
    "RunConfig.staleness_threshold = 1.0",
    "RunConfig.checkpoint_every_versions = 2",
    "RunConfig.eval_every_versions = 2",
    "RunConfig.heartbeat_timeout_s = 10.0",
    "RunConfig.backend = 'processes'",
)


def life(run_dir, versions: int, servers: int, *, resume: bool):
  bindings = BINDINGS + (f"RunConfig.total_samples = {versions * 8}",
                         f"RunConfig.num_rollout_servers = {servers}")
  proc = run_lives.start(run_dir, "gin/modes/async_partial.gin", bindings, resume=resume)
  code, out, err, _ = run_lives.finish(proc, 600)
  assert code == 0, f"{out[-2000:]}\n{err[-4000:]}"
  return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_resumed_with_fewer_servers_replays_bit_for_bit(tmp_path):
  life(tmp_path, 4, 2, resume=False)
  out = life(tmp_path, 6, 1, resume=True)
  assert "re-dealt to 1" in out and "at policy_version 4" in out
  intervals = read_schedule(tmp_path)
  assert [(i.start_version, i.end_version) for i in intervals] == [(0, 2), (2, 4), (4, 6)]
  report = replay_cli(tmp_path, "--level", "full")
  assert [c["version"] for c in report["checkpoints"]] == [2, 4, 6]
  assert report["bitwise_equal"], report["checkpoints"]
  assert report["tokens"]["identical_tokens"] == report["tokens"]["samples"] == 6 * 8
