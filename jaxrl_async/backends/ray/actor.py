"""The rollout actor: a `RolloutServer` inside a Ray actor (the driver's side is `RayFleet`, in
backend.py). Its first incarnation starts before the driver has restored its checkpoint and
waits for its restore; a restarted one takes over its predecessor's unfinished groups."""

from __future__ import annotations

from jaxrl_async.backends.ray.host_weights import open_actor_channel
from jaxrl_async.backends.ray.links import as_link
from jaxrl_async.backends.ray.placement import require_ray
from jaxrl_async.backends.rollout_server import RolloutServer

RESTART_WAIT_S = 300.0  # how long the driver waits for Ray to bring a killed actor back
RESTORE_POLL_S = 0.2  # a launched actor's longest wait in one call for its restore


class RolloutActorImpl:
  """A `RolloutServer` in a Ray actor. Its first incarnation is created before the driver knows
  where it starts (`RayFleet.launch`) and waits for its restore from the buffer's claim book.
  On a restart (Ray re-runs this constructor) it claims its predecessor's unfinished work there
  and starts at once. `buffer`: a `links` link (the buffer in the driver or in an actor), or the
  buffer actor's handle."""

  def __init__(self, config, index: int, num_servers: int, buffer, channel_spec: dict):
    ray = require_ray()
    link = as_link(buffer)
    restarted = ray.get_runtime_context().was_current_actor_reconstructed
    restore = wait_for_restore(link, index)
    claim = link.claim(index, restore, restarted, RESTART_WAIT_S)
    channel = open_actor_channel(channel_spec, config)
    self.server = RolloutServer(config, server_index=index, num_servers=num_servers,
                                buffer=link.client(claim["client_id"]),
                                channel=channel, restore=claim["restore"])
    self.client_id = claim["client_id"]
    if restarted:
      self.server.start()
    link.ready(index)

  def call(self, method: str, timeout: float):
    if method not in ("start", "pause", "resume", "snapshot", "evaluate", "health", "stop"):
      raise AttributeError(f"a rollout server has no call {method!r}")
    result = getattr(self.server, method)(timeout)
    if method in ("health", "stop"):  # both answer with the server's health
      result = {**result, "client_id": self.client_id,
                "node_id": require_ray().get_runtime_context().get_node_id()}
    return result


def wait_for_restore(buffer, index: int):
  """What rollout server `index` starts from (a checkpoint's snapshot, or None), once the
  driver's `RayFleet.start` has handed it to the claim book (`buffer`: a link, or the buffer
  actor's handle). Asked in short calls, so that waiting actors never hold all of the buffer
  actor's call threads. No deadline: the driver may evaluate for long before it starts the
  fleet, and its actors end with it (Ray ends the actors of a dead owner; a stop before the
  start kills them)."""
  link = as_link(buffer)
  while True:
    given, restore = link.restore_for(index, RESTORE_POLL_S)
    if given:
      return restore
