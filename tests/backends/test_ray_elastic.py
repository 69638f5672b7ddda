"""An elastic 'ray' fleet: a run on a local 2-node cluster goes from 2 rollout actors to 3 and
back to 2 through `<run_dir>/fleet_control`, each change restarting the actors on the new
shape's work; the run ends with a clean sample ledger, no group id and no prompt drawn twice,
every consumed sample scored and the re-issues counted (as the 'processes' fleet's test)."""

import os

import pytest

# The local cluster stays on the loopback interface only when Ray reads this at import.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from tests.backends.elastic import (  # noqa: E402
  BackgroundRun,
  check_grown_and_shrunk,
  grow_then_retire,
)
from tests.backends.test_processes_backend import small_config  # noqa: E402
from tests.backends.test_ray_resize import cluster  # noqa: E402, F401 (the fixture)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("cluster")
def test_a_ray_actor_added_and_one_retired_mid_run_leave_a_clean_ledger(tmp_path):
  # a command is read at the driver's next heartbeat (1 s), and each change of shape restarts
  # the actors (seconds): enough versions that both commands land mid-run
  config = small_config(120, num_rollout_servers=2, backend="ray",
                        ray_learner_resource="learner", ray_rollout_resource="rollout",
                        ray_rollout_cpus=0.5)
  run = BackgroundRun(config, tmp_path)
  grow_then_retire(run)
  summary = run.finish()
  check_grown_and_shrunk(tmp_path, summary, config)
  assert summary["rollout_server_restarts"] == 0  # a change of shape is not a fault
