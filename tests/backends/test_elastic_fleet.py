"""An elastic 'processes' fleet: a run checkpointed with 2 rollout servers resumes with 3, then
with 1; a run adds a server and retires one through `<run_dir>/fleet_control`. Each ends with a
clean sample ledger, no group id and no prompt drawn twice."""

import pytest

from jaxrl_async.run import api
from tests.backends.elastic import (
  BackgroundRun,
  check_books,
  check_grown_and_shrunk,
  fleet_sizes,
  grow_then_retire,
)
from tests.backends.test_processes_backend import (
  no_orphans,  # noqa: F401 (the autouse fixture: no child process outlives a test)
  small_config,
)


@pytest.mark.slow
def test_a_run_of_two_servers_resumes_with_three_then_with_one(tmp_path):
  lives = [(4, 2), (6, 3), (8, 1)]  # (versions, servers)
  drawn = []
  for life, (versions, servers) in enumerate(lives):
    config = small_config(versions, num_rollout_servers=servers, checkpoint_every_versions=2)
    logs = []
    summary = api.run(config, str(tmp_path), resume=life > 0, progress=False, log=logs.append)
    assert summary["policy_version"] == versions and summary["num_rollout_servers"] == servers
    if life:
      assert any(f"re-dealt to {servers}" in str(line) for line in logs), logs
    drawn = check_books(tmp_path, summary, config)
  sizes = fleet_sizes(tmp_path)
  assert sizes[:4] == [2] * 4 and sizes[4:6] == [3] * 2 and sizes[6:] == [1] * 2
  # the later lives' new groups are numbered above every id of the lives before them
  assert max(drawn) >= 4 * 2


@pytest.mark.slow
def test_a_server_added_and_one_retired_mid_run_leave_a_clean_ledger(tmp_path):
  # a tiny version takes tens of ms once the servers run, a command is read at the next
  # heartbeat (1 s) and an added server warms its engine up before it starts (a few seconds
  # on a loaded machine): enough versions that both commands land mid-run
  config = small_config(240, num_rollout_servers=2)
  run = BackgroundRun(config, tmp_path)
  grow_then_retire(run)
  check_grown_and_shrunk(tmp_path, run.finish(), config)
