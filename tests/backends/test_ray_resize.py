"""A 'ray' run checkpointed with 2 rollout actors resumes with 1 and then with 3: each actor
starts from its re-dealt share of the prompts, its unfinished groups and its first group id,
all in its restore (the Ray backend itself is the same), and every life ends with a clean
sample ledger, no group id and no prompt consumed twice."""

import os

import pytest

# The local cluster stays on the loopback interface only when Ray reads this at import.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from jaxrl_async.backends.ray import placement  # noqa: E402
from jaxrl_async.run import api  # noqa: E402
from tests.backends.elastic import check_books, fleet_sizes  # noqa: E402
from tests.backends.test_processes_backend import small_config  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
  started = placement.start_local_cluster([
      {"num_cpus": 1, "resources": {"learner": 1}},
      {"num_cpus": 2, "resources": {"rollout": 3}},
  ])
  yield started
  placement.stop_local_cluster(started)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_ray_run_of_two_actors_resumes_with_one_then_with_three(cluster, tmp_path):
  del cluster
  for life, (versions, servers) in enumerate([(4, 2), (6, 1), (8, 3)]):
    config = small_config(versions, num_rollout_servers=servers, checkpoint_every_versions=2,
                          backend="ray", ray_learner_resource="learner",
                          ray_rollout_resource="rollout", ray_rollout_cpus=0.5)
    logs = []
    summary = api.run(config, str(tmp_path), resume=life > 0, progress=False, log=logs.append)
    assert summary["policy_version"] == versions and summary["num_rollout_servers"] == servers
    if life:
      assert any(f"re-dealt to {servers}" in str(line) for line in logs), logs
    check_books(tmp_path, summary, config)
  assert fleet_sizes(tmp_path) == [2] * 4 + [1] * 2 + [3] * 2
