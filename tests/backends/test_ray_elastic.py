"""An elastic 'ray' fleet: a run on a local 2-node cluster goes from 2 rollout actors to 3 and
back to 2 through `<run_dir>/fleet_control`, each change restarting the actors on the new
shape's work; the run ends with a clean sample ledger, no group id and no prompt drawn twice,
every consumed sample scored and the re-issues counted (as the 'processes' fleet's test). The
run keeps the buffer in the driver; the claim book's release and new shares are also checked
through a buffer actor (`ray_buffer = 'actor'`)."""

import os

import pytest

# The local cluster stays on the loopback interface only when Ray reads this at import.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray")

from jaxrl_async.backends.fleet_shape import new_shape  # noqa: E402
from jaxrl_async.backends.ray import buffer as ray_buffer  # noqa: E402
from jaxrl_async.backends.ray.links import ActorLink  # noqa: E402
from jaxrl_async.run.build import buffer_kwargs  # noqa: E402
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
  config = small_config(240, num_rollout_servers=2, backend="ray",
                        ray_learner_resource="learner", ray_rollout_resource="rollout",
                        ray_rollout_cpus=0.5)
  run = BackgroundRun(config, tmp_path)
  grow_then_retire(run)
  summary = run.finish()
  check_grown_and_shrunk(tmp_path, summary, config)
  assert summary["rollout_server_restarts"] == 0  # a change of shape is not a fault


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("cluster")
def test_a_buffer_actor_releases_the_old_actors_and_hands_out_the_new_shares():
  config = small_config(4, num_rollout_servers=2)
  actor = ray_buffer.start_buffer_actor(buffer_kwargs(config), node_resource="learner")
  try:
    link = ActorLink(actor)
    link.set_restores([None, None])
    first = [link.claim(index, None, False, 120.0)["client_id"] for index in range(2)]
    released = [link.release(index) for index in range(2)]
    assert [r["rollout"]["next_group_id"] for r in released] == [0, 1]  # nothing drawn yet
    shape = new_shape(released, [0], [], [0, 1], 3)
    link.reshape(shape.restores)
    claims = [link.claim(index, link.restore_for(index, 10.0)[1], False, 120.0)
              for index in range(3)]
    assert not {c["client_id"] for c in claims} & set(first)
    assert [c["restore"]["rollout"]["next_group_id"] for c in claims] == [0, 1, 2]
    # a Ray restart of a new actor claims from its first incarnation, as before the reshape
    again = link.claim(2, None, True, 120.0)
    assert again["restore"]["rollout"]["next_group_id"] == 2 and link.restarts() == 1
  finally:
    ray.kill(actor, no_restart=True)
