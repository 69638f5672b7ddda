"""The `processes` backend: rollout servers in spawned child processes on one host, the buffer
served to them over a socket (`buffer_service`, `wire`), weights over shared memory or the
weight store (sync/store_channel.py)."""
