"""The Ray backend's shared-memory weights: when they are chosen, and that a rollout actor's
process ending (SIGKILLed, as Ray restarts it) leaves the driver's segment for its successor."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.backends.ray import host_weights
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel

ABSTRACT = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}


def node(node_id, address, alive=True, **resources):
  return {"NodeID": node_id, "NodeManagerAddress": address, "Alive": alive,
          "Resources": {"CPU": 1.0, **resources}}


def test_shared_memory_only_when_every_rollout_node_is_on_the_drivers_host():
  one_host = [node("a", "127.0.0.1", learner=1.0), node("b", "127.0.0.1", rollout=1.0)]
  assert host_weights.rollout_on_driver_host(one_host, "a", "rollout")
  assert host_weights.rollout_on_driver_host(one_host, "a", None)
  two_hosts = [node("a", "10.0.0.1", learner=1.0), node("b", "10.0.0.2", rollout=1.0)]
  assert not host_weights.rollout_on_driver_host(two_hosts, "a", "rollout")
  assert not host_weights.rollout_on_driver_host(two_hosts, "a", None)
  # Only the nodes that may host a rollout actor count; a dead node counts for nothing.
  mixed = [*two_hosts, node("c", "10.0.0.1", rollout=1.0)]
  assert not host_weights.rollout_on_driver_host(mixed, "a", "rollout")
  mixed[1]["Alive"] = False
  assert host_weights.rollout_on_driver_host(mixed, "a", "rollout")
  assert not host_weights.rollout_on_driver_host(two_hosts, "a", "gpu_rollout")  # none offers it
  with pytest.raises(LookupError, match="no live Ray node 'z'"):
    host_weights.rollout_on_driver_host(one_host, "z", None)


ATTACH_THEN_DIE = """
import os, signal, sys
import jax.numpy as jnp
from jaxrl_async.backends.ray import host_weights
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
abstract = {"w": jnp.zeros((4, 3), jnp.float32), "b": jnp.zeros((3,), jnp.float32)}
if sys.argv[2] == "actor":
  channel = host_weights.attach(sys.argv[1], abstract)
else:
  channel = SharedMemoryWeightChannel.attach(sys.argv[1], abstract)
version, params = channel.fetch()
print(version, float(params["w"].sum()), flush=True)
os.kill(os.getpid(), signal.SIGKILL if sys.argv[3] == "kill" else signal.SIGTERM)
"""


def attach_in_process(name: str, how: str, end: str) -> str:
  done = subprocess.run([sys.executable, "-c", ATTACH_THEN_DIE, name, how, end],
                        capture_output=True, text=True, timeout=120, check=False)
  assert done.returncode in (-signal.SIGKILL, -signal.SIGTERM), done.stderr
  return done.stdout.strip()


def segment_exists(name: str, wait_s: float) -> bool:
  """Whether /dev/shm/<name> still exists after `wait_s` (a dead process's resource tracker
  unlinks what it tracked shortly after its owner ends)."""
  deadline = time.monotonic() + wait_s
  while time.monotonic() < deadline:
    if not os.path.exists(f"/dev/shm/{name}"):
      return False
    time.sleep(0.2)
  return os.path.exists(f"/dev/shm/{name}")


@pytest.mark.parametrize("end", ["kill", "term"])
def test_an_actor_ending_leaves_the_drivers_segment_for_its_successor(end):
  channel = SharedMemoryWeightChannel.create(ABSTRACT)
  try:
    channel.publish(3, {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)})
    assert attach_in_process(channel.name, "actor", end) == "3 12.0"
    assert segment_exists(channel.name, wait_s=3.0)
    assert attach_in_process(channel.name, "actor", end) == "3 12.0"  # the successor attaches
  finally:
    channel.close()
  assert not os.path.exists(f"/dev/shm/{channel.name}")  # the driver's close removes it


def test_a_plain_attach_would_lose_the_segment_with_its_process():
  """Why `attach` stops tracking: a process that attaches as Python does by default takes the
  segment with it when it ends."""
  channel = SharedMemoryWeightChannel.create(ABSTRACT)
  try:
    channel.publish(1, {"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)})
    assert attach_in_process(channel.name, "plain", "term") == "1 12.0"
    assert not segment_exists(channel.name, wait_s=10.0)
  finally:
    with contextlib.suppress(FileNotFoundError):  # the ended process's tracker unlinked it
      channel.close()


def test_an_actor_on_another_host_is_told_so():
  with pytest.raises(RuntimeError, match="not on this host"):
    host_weights.attach("jaxrl-no-such-segment", ABSTRACT)


def test_a_local_cluster_of_two_nodes_gets_shared_memory():
  """Both nodes of a local cluster are on 127.0.0.1, the driver's host: the weights go through
  shared memory; a resource that no node offers leaves nothing to share with."""
  os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
  pytest.importorskip("ray")
  from jaxrl_async.backends.ray import placement
  cluster = placement.start_local_cluster([{"num_cpus": 1, "resources": {"learner": 1}},
                                           {"num_cpus": 1, "resources": {"rollout": 1}}])
  try:
    assert host_weights.use_shared_memory("rollout")
    assert host_weights.use_shared_memory(None)
    assert not host_weights.use_shared_memory("no_such_resource")
  finally:
    placement.stop_local_cluster(cluster)
