"""The 'ray' backend's weights through shared memory, when the rollout actors share the driver's
host.

Through Ray's object store a version costs the learner a `ray.put` and a call to the weight
store actor, and each rollout actor a long-polling call to learn of it, a call for its reference
and the object's fetch: about 16 ms per version on a loaded 2-core machine, against about 2 ms
through the processes backend's shared-memory channel (docs/backends.md, "Hand-off latency").
Where every node that may host a rollout actor has the driver's node address (one machine: a
local cluster, or `ray start` of several nodes on one host), the driver creates that same
channel (`sync/shm_channel.py`) and the actors attach to it by name; elsewhere the object store
stays (`RayWeightChannel`).
"""

from __future__ import annotations

from multiprocessing import resource_tracker

from jaxrl_async.backends.processes.rollout_process import open_rollout_channel
from jaxrl_async.backends.ray.placement import require_ray
from jaxrl_async.backends.ray.weights import RayWeightChannel
from jaxrl_async.run.build import model_spec
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel


def node_address(nodes: list[dict], node_id: str) -> str:
  """The address of the live node `node_id` among `ray.nodes()`."""
  for node in nodes:
    if node["NodeID"] == node_id and node["Alive"]:
      return node["NodeManagerAddress"]
  raise LookupError(f"no live Ray node {node_id!r} among {len(nodes)} nodes")


def rollout_on_driver_host(nodes: list[dict], driver_node: str,
                           rollout_resource: str | None) -> bool:
  """Whether every live node that may host a rollout actor (one offering `rollout_resource`;
  None: any node) has the address of the driver's node, i.e. is on the driver's host. Decided
  from the nodes alive at the run's start: a node that joins later on another host would not
  reach the weights (its actors fail at their start, saying so)."""
  address = node_address(nodes, driver_node)
  candidates = [node for node in nodes if node["Alive"] and (
      rollout_resource is None or node["Resources"].get(rollout_resource, 0) > 0)]
  return bool(candidates) and all(node["NodeManagerAddress"] == address for node in candidates)


def use_shared_memory(rollout_resource: str | None) -> bool:
  """`rollout_on_driver_host` for the Ray cluster this process (the driver) is attached to."""
  ray = require_ray()
  return rollout_on_driver_host(ray.nodes(), ray.get_runtime_context().get_node_id(),
                                rollout_resource)


def attach(location: str, abstract_params) -> SharedMemoryWeightChannel:
  """The rollout actor's end of the driver's shared-memory channel. The segment stays the
  driver's: Python's resource tracker would unlink it when this actor's process ends (a Ray
  restart after a SIGKILL included), and the actor's successor could no longer attach, so this
  process does not track it."""
  try:
    channel = SharedMemoryWeightChannel.attach(location, abstract_params)
  except FileNotFoundError as error:
    raise RuntimeError(f"the weights' shared memory {location!r} is not on this host: a rollout "
                       "actor on another host than the driver's cannot attach to it") from error
  resource_tracker.unregister(f"/{channel.name}", "shared_memory")
  return channel


def open_actor_channel(spec: dict, config):
  """A rollout actor's end of the run's weight channel, by `spec['kind']`: 'ray' (the object
  store, through the weight store actor `spec['store']`), 'shm' (the driver's shared memory on
  this host, `attach`) or 'store' (the weight store directory)."""
  if spec["kind"] == "ray":
    return RayWeightChannel(spec["store"])
  if spec["kind"] == "shm":
    return attach(spec["location"], model_spec(config).abstract_params)
  return open_rollout_channel(spec, config)
