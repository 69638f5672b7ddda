"""How a rollout actor and the driver's fleet reach the run's buffer and its `ClaimBook`.

Two places for the buffer (`RunConfig.ray_buffer`): 'driver' serves it from the driver's
process over the buffer service's socket transport (`hosted.py`), 'actor' keeps it in a buffer
actor reached by Ray calls (`buffer.py`). A link is what the rollout actors get in their
constructor's arguments (picklable): `restore_for`, `claim` and `ready` of the restarts'
bookkeeping, and `client(client_id)`, the `BufferClient` a rollout server puts through.
`ActorLink` also answers the fleet's calls (`set_restores`, `release`, `reshape`, ...); with the
buffer in the driver the fleet calls the `ClaimBook` itself.
"""

from __future__ import annotations

from typing import Any

from jaxrl_async.backends.processes.buffer_service import RemoteBufferClient
from jaxrl_async.backends.ray.buffer import RayBufferClient
from jaxrl_async.backends.ray.claims import REVOKE_TIMEOUT_S
from jaxrl_async.backends.ray.placement import RPC_MARGIN_S, require_ray

CALL_S = 60.0  # a bookkeeping call's own bound (beyond its wait)
CONTROL_CLIENT = "ray-claims"  # the client id the rollout actors' bookkeeping calls go under


class ActorLink:
  """The buffer actor (`BufferActorImpl`): every call a Ray call to it."""

  def __init__(self, actor, *, margin_s: float = RPC_MARGIN_S):
    self.actor = actor
    self.margin_s = margin_s

  def _call(self, method: str, *args, wait_s: float = 0.0) -> Any:
    ray = require_ray()
    return ray.get(getattr(self.actor, method).remote(*args), timeout=wait_s + CALL_S)

  def client(self, client_id: str) -> RayBufferClient:
    return RayBufferClient(self.actor, client_id, margin_s=self.margin_s)

  def restore_for(self, index: int, wait_s: float):
    return self._call("restore_for", index, wait_s, wait_s=wait_s)

  def claim(self, index: int, restore, restarted: bool, wait_s: float) -> dict:
    return self._call("claim", index, restore, restarted, wait_s=wait_s)

  def ready(self, index: int) -> None:
    self._call("ready", index)

  def set_restores(self, restores: list) -> None:
    self._call("set_restores", list(restores))

  def release(self, index: int) -> dict:
    return self._call("release", index, wait_s=REVOKE_TIMEOUT_S)

  def reshape(self, restores: list) -> None:
    self._call("reshape", list(restores))

  def constructing(self, index: int) -> bool:
    return self._call("constructing", index)

  def note_unresponsive(self, index: int) -> None:
    self._call("note_unresponsive", index)

  def restarts(self) -> int:
    return int(self._call("restarts"))

  def reissue_counts(self) -> dict[str, int]:
    return self._call("reissue_counts")


class ServiceLink:
  """The buffer service in the driver's process (`hosted.HostedBuffer`), over its socket
  transport: one connection per calling thread, the bookkeeping calls under `CONTROL_CLIENT`."""

  def __init__(self, address, authkey: bytes, *, margin_s: float = RPC_MARGIN_S):
    self.address = tuple(address)
    self.authkey = bytes(authkey)
    self.margin_s = margin_s
    self._control: RemoteBufferClient | None = None

  def __getstate__(self):
    return {"address": self.address, "authkey": self.authkey, "margin_s": self.margin_s}

  def __setstate__(self, state):
    self.__init__(state["address"], state["authkey"], margin_s=state["margin_s"])

  def client(self, client_id: str) -> RemoteBufferClient:
    return RemoteBufferClient(self.address, self.authkey, client_id, margin_s=self.margin_s,
                              call_timeout_s=CALL_S)

  def _call(self, method: str, *args, wait_s: float = 0.0):
    if self._control is None:
      self._control = self.client(CONTROL_CLIENT)
    return self._control._call(method, *args, timeout=wait_s + CALL_S)

  def restore_for(self, index: int, wait_s: float):
    return tuple(self._call("restore_for", index, wait_s, wait_s=wait_s))

  def claim(self, index: int, restore, restarted: bool, wait_s: float) -> dict:
    return self._call("claim", index, restore, restarted, wait_s=wait_s)

  def ready(self, index: int) -> None:
    self._call("ready", index)


def as_link(buffer) -> ActorLink | ServiceLink:
  """A link as given, or the `ActorLink` of a buffer actor's handle."""
  return buffer if isinstance(buffer, (ActorLink, ServiceLink)) else ActorLink(buffer)
