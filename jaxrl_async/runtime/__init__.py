"""Assembly and backends: role interfaces, the buffer service, cross-process weight channels,
rollout servers as processes."""

from jaxrl_async.runtime.interfaces import (
  BufferClient,
  LocalBufferClient,
  RolloutControl,
  as_buffer_client,
)

__all__ = ["BufferClient", "LocalBufferClient", "RolloutControl", "as_buffer_client"]
