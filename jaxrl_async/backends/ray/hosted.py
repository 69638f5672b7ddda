"""The 'ray' backend's buffer in the driver's process, served to the rollout actors.

With `RunConfig.ray_buffer = 'driver'` the run's `VersionedBuffer` lives in the driver beside
the learner, as in the processes backend: the learner takes its batches with no call to another
process, and the rollout actors put theirs over the buffer service's socket transport (one call
per batch, samples as one columnar blob), on the address of the driver's Ray node. The restarts'
bookkeeping (`ClaimBook`: `claim` of a dead incarnation's groups and prompt shard, re-issue
counts) sits beside the service; the rollout actors reach it through the same service
(`links.ServiceLink`), the driver's fleet calls it in-process.
"""

from __future__ import annotations

from typing import Any

from jaxrl_async.backends.processes.buffer_service import BufferService
from jaxrl_async.backends.ray.claims import ClaimBook
from jaxrl_async.backends.ray.links import ServiceLink
from jaxrl_async.buffer import VersionedBuffer


class ClaimingBufferService(BufferService):
  """The buffer service with the `ClaimBook`'s calls of a starting rollout actor."""

  book: ClaimBook

  def _rpc_claim(self, client, index, restore, restarted):
    del client
    return self.book.claim(index, restore, restarted)

  def _rpc_restore_for(self, client, index, wait_s):
    del client
    return self.book.restore_for(index, wait_s)

  def _rpc_ready(self, client, index):
    del client
    self.book.ready(index)


class HostedBuffer(ClaimBook):
  """The run's buffer, its service on `host` (the driver node's address) and the claims."""

  def __init__(self, buffer_kwargs: dict[str, Any], host: str):
    self.buffer = VersionedBuffer(**buffer_kwargs, record_drops=True)
    service = ClaimingBufferService(self.buffer, host=host)
    service.book = self
    super().__init__(service, int(buffer_kwargs["group_size"]))
    service.start()

  def link(self) -> ServiceLink:
    """What the rollout actors reach the service by (address and key)."""
    return ServiceLink(self.service.address, self.service.authkey)

  def stop(self) -> None:
    self.buffer.close()
    self.service.stop()
