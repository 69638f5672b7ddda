"""The VersionedBuffer served to other processes, and the client that reaches it.

`BufferService` runs in the learner's process beside the buffer. Each `RemoteBufferClient`
(one per rollout server, named by a client id) opens one connection per calling thread, so a
thread blocked on admission never holds back another thread's puts. One call moves one batch of
samples, never one token.

For the rollout servers the service also keeps, per client, the groups it started and has not
fully put yet (`starts` of `acquire_group_slots`, registered in the same call that admits them)
and the prompt iterator state after its last started group. When a server dies, `revoke` takes
them so that a replacement re-issues exactly those groups and continues the prompt shard where
the dead one stopped; a revoked client's later calls fail with `ClientRevoked`.

With several rollout servers the buffer's rollout version is the oldest version any live
server holds (servers that have not published yet do not count): a window opens only once every
server can generate with its weights, so no server admits a group for weights it does not hold.
"""

from __future__ import annotations

import abc
import itertools
import os
import threading
import time
from typing import Any

from jaxrl_async.backends.processes import wire
from jaxrl_async.buffer import BufferClosed, VersionedBuffer
from jaxrl_async.buffer.client import (
  BufferClient,
  LocalBufferClient,
  check_acquire_args,
)
from jaxrl_async.buffer.errors import is_int

# Seconds a client waits for a reply beyond the call's own timeout (transport, pickling).
RPC_MARGIN_S = 30.0
# How a RemoteBufferClient moves samples (see RemoteBufferClient).
TRANSPORTS = ("columnar", "pickle")


class ClientRevoked(RuntimeError):
  """This client was declared dead (its groups were handed to another server)."""


class _Client:
  """What the service knows of one client; `lock` guards it, `active` counts its calls."""

  def __init__(self, client_id: str):
    self.client_id = client_id
    self.cond = threading.Condition()
    self.active = 0
    self.revoked = False
    self.inflight: dict[int, dict[str, Any]] = {}  # group id -> {problem, missing}
    self.prompt_state: Any = None
    self.next_group_id: int | None = None
    self.held_version: int | None = None


class BufferService:
  """Serves `buffer` on 127.0.0.1 (or `host`; a random port, a random key) until `stop`."""

  def __init__(self, buffer: VersionedBuffer, *, host: str = wire.HOST):
    self.buffer = buffer
    self.local = LocalBufferClient(buffer)
    self.authkey = os.urandom(16)
    self._clients: dict[str, _Client] = {}
    self._lock = threading.Lock()
    # Every group a rollout server started through this service: group id -> prompt id; and
    # the group ids handed from a revoked client to its successor (for the run's ledger).
    self.started: dict[int, int] = {}
    self.reissued: list[int] = []
    self._server = wire.Server(self._open, self.authkey, name="buffer-service", host=host)
    self.address = self._server.address

  def start(self) -> BufferService:
    self._server.start()
    return self

  def started_groups(self) -> dict:
    """Every group a server started (group id -> prompt id) and the ones re-issued after a
    server was lost, as prompt_ledger.json records them. A started group that was not consumed
    ended as a drop, counted under its reason in the summary."""
    return {"started": {str(g): p for g, p in sorted(self.started.items())},
            "reissued": sorted(self.reissued)}

  def stop(self, timeout: float = 10.0) -> None:
    self._server.stop(timeout)

  # ---- the rollout servers' bookkeeping (called by the controller) ----------------------------
  def register(self, client_id: str, *, inflight: list[dict] | None = None,
               prompt_state: Any = None, next_group_id: int | None = None) -> None:
    """Declares a client before it connects: the groups it starts with that already hold
    admission, and where its prompt shard stands."""
    client = _Client(client_id)
    for entry in inflight or []:
      client.inflight[int(entry["group_id"])] = {"problem": entry["problem"],
                                                 "missing": set(entry["missing"])}
    client.prompt_state, client.next_group_id = prompt_state, next_group_id
    with self._lock:
      if client_id in self._clients and not self._clients[client_id].revoked:
        raise ValueError(f"buffer client {client_id!r} is already registered")
      self._clients[client_id] = client

  def revoke(self, client_id: str, timeout: float, *, reissue: bool = True) -> dict[str, Any]:
    """Declares a client dead: rejects its later calls, waits for its calls in progress (at
    most `timeout` s), and returns its unfinished groups and prompt position. `reissue`: its
    groups go to a successor (recorded in `reissued`); False where none follows (a stop)."""
    client = self._client(client_id)
    deadline = time.monotonic() + timeout
    with client.cond:
      client.revoked = True
      if not client.cond.wait_for(lambda: client.active == 0,
                                  max(0.0, deadline - time.monotonic())):
        raise TimeoutError(f"buffer client {client_id!r}: calls still running after {timeout} s")
      inflight = [{"problem": entry["problem"], "group_id": gid,
                   "missing": sorted(entry["missing"]), "admitted": True}
                  for gid, entry in sorted(client.inflight.items())]
      client.inflight.clear()
    if reissue:
      self.reissued.extend(entry["group_id"] for entry in inflight)
    self._publish_oldest()
    return {"inflight": inflight, "prompt_state": client.prompt_state,
            "next_group_id": client.next_group_id}

  def tracked(self, client_id: str) -> list[dict]:
    client = self._client(client_id)
    with client.cond:
      return [{"group_id": gid, "missing": sorted(entry["missing"])}
              for gid, entry in sorted(client.inflight.items())]

  def _client(self, client_id: str) -> _Client:
    with self._lock:
      if client_id not in self._clients:
        raise KeyError(f"unknown buffer client {client_id!r}")
      return self._clients[client_id]

  # ---- serving ------------------------------------------------------------------------------
  def _open(self, conn):
    """The first message names the client; unknown clients are registered on the fly."""
    if not conn.poll(wire.SERVE_POLL_S * 25):
      return None
    try:
      method, args, _ = conn.recv()
    except (EOFError, OSError):
      return None
    if method != "hello":
      return None
    client_id = str(args[0])
    with self._lock:
      if client_id not in self._clients:
        self._clients[client_id] = _Client(client_id)
      client = self._clients[client_id]
    conn.send(("ok", None))
    return lambda name, call_args, call_kwargs: self._dispatch(client, name, call_args,
                                                               call_kwargs)

  def _dispatch(self, client: _Client, method: str, args: tuple, kwargs: dict):
    handler = getattr(self, f"_rpc_{method}", None)
    if handler is None:
      raise AttributeError(f"the buffer service has no call {method!r}")
    with client.cond:
      if client.revoked:
        raise ClientRevoked(f"buffer client {client.client_id!r} was revoked")
      client.active += 1
    try:
      return handler(client, *args, **kwargs)
    finally:
      with client.cond:
        client.active -= 1
        client.cond.notify_all()

  def _rpc_put_many(self, client, samples, timeout):
    put = len(samples)
    try:
      self.buffer.put_many(samples, timeout, one_deadline=True)
    except Exception as error:
      put = getattr(error, "num_put", 0)
      raise
    finally:
      with client.cond:
        for sample in samples[:put]:
          entry = client.inflight.get(sample.group_id)
          if entry is not None:
            entry["missing"].discard(int(sample.meta["index_in_group"]))
            if not entry["missing"]:
              del client.inflight[sample.group_id]

  def _rpc_put_columns(self, client, blob, timeout):
    """`put_many` of a `wire.encode_samples` blob."""
    self._rpc_put_many(client, wire.decode_samples(blob), timeout)

  def _rpc_acquire_group_slots(self, client, max_count, timeout, starts=None,
                               holding_version=None):
    check_acquire_args(max_count, timeout)
    if starts is not None and len(starts) < max_count:
      raise ValueError(f"acquire_group_slots: {len(starts)} starts for max_count={max_count}")
    if holding_version is not None and holding_version > max(client.held_version or 0, 0):
      self._rpc_publish_version(client, holding_version)  # the window follows the oldest held
    count = self.local.acquire_group_slots(max_count, timeout, starts=starts)
    if starts:
      with client.cond:
        for entry in starts[:count]:
          client.inflight[int(entry["group_id"])] = {"problem": entry["problem"],
                                                     "missing": set(entry["missing"])}
          self.started.setdefault(int(entry["group_id"]), int(entry["problem"]["prompt_id"]))
          if entry.get("prompt_state") is not None:
            client.prompt_state = entry["prompt_state"]
            client.next_group_id = entry["next_group_id"]
    return count

  def _rpc_publish_version(self, client, version):
    if self.buffer.closed:
      raise BufferClosed("publish_version: the buffer is closed")
    if not is_int(version) or version < max(client.held_version or 0, 0):
      raise ValueError(f"publish_version: version={version!r} must be an int >= the current "
                       f"rollout version {client.held_version or 0}")
    with client.cond:
      client.held_version = int(version)
    self._publish_oldest()

  def _publish_oldest(self) -> None:
    with self._lock:
      held = [c.held_version for c in self._clients.values()
              if not c.revoked and c.held_version is not None]
      if held and min(held) > self.buffer.rollout_version and not self.buffer.closed:
        self.buffer.publish_version(min(held))

  def _rpc_get_groups(self, client, num_groups, learner_version, timeout):
    del client
    return self.buffer.get_groups(num_groups, learner_version, timeout)

  def _rpc_get_groups_columns(self, client, num_groups, learner_version, timeout):
    """`get_groups` as (group sizes, one `wire.encode_samples` blob of all their samples), or
    (None, the groups) when a sample is not `wire.columnar`."""
    groups = self._rpc_get_groups(client, num_groups, learner_version, timeout)
    blob = wire.try_encode_samples([sample for group in groups for sample in group])
    return (None, groups) if blob is None else ([len(group) for group in groups], blob)

  def _rpc_close(self, client):
    del client
    self.buffer.close()

  def _rpc_get_state(self, client):
    del client
    return self.buffer.get_state()

  def _rpc_set_state(self, client, state):
    del client
    self.buffer.set_state(state)

  def _rpc_metrics(self, client):
    del client
    return self.buffer.metrics()

  def _rpc_counts(self, client):
    del client
    return self.buffer.counts


class ForwardingBufferClient(BufferClient):
  """A `BufferClient` whose every call is forwarded to a `BufferService`'s calls (`_rpc_*`) by
  `_call(method, *args, timeout=..., **kwargs)`, `timeout` being the call's own wait (None for
  calls without one). `RemoteBufferClient` forwards over `wire`; the Ray backend's client to its
  buffer actor.

  `transport`: how samples travel, 'columnar' (one `wire.encode_samples` blob per batch each
  way; samples it cannot carry exactly go pickled) or 'pickle' (every sample pickled: several
  numpy arrays per sample, each a buffer of its own for the transport)."""

  transport = "columnar"

  @abc.abstractmethod
  def _call(self, method: str, *args, timeout: float | None = None, **kwargs):
    """Runs `method` on the service for this client and returns its value (or raises)."""

  def put_many(self, samples, timeout):
    if not samples:
      return
    blob = wire.try_encode_samples(samples) if self.transport == "columnar" else None
    if blob is None:
      self._call("put_many", list(samples), timeout, timeout=timeout)
    else:
      self._call("put_columns", blob, timeout, timeout=timeout)

  def acquire_group_slots(self, max_count, timeout, *, starts=None, holding_version=None):
    check_acquire_args(max_count, timeout)
    return self._call("acquire_group_slots", max_count, timeout, starts=starts,
                      holding_version=holding_version, timeout=timeout)

  def publish_version(self, version):
    self._call("publish_version", version)

  def get_groups(self, num_groups, learner_version, timeout):
    if self.transport != "columnar":
      return self._call("get_groups", num_groups, learner_version, timeout, timeout=timeout)
    sizes, blob = self._call("get_groups_columns", num_groups, learner_version, timeout,
                             timeout=timeout)
    if sizes is None:
      return blob  # the groups themselves, pickled
    samples, bounds = wire.decode_samples(blob), [0, *itertools.accumulate(sizes)]
    return [samples[bounds[i]:bounds[i + 1]] for i in range(len(sizes))]

  def close(self):
    self._call("close")

  def get_state(self):
    return self._call("get_state")

  def set_state(self, state):
    self._call("set_state", state)

  def metrics(self):
    return self._call("metrics")

  def counts(self):
    return self._call("counts")


class RemoteBufferClient(ForwardingBufferClient):
  """A `BufferClient` for a `BufferService` in another process; picklable (it carries only the
  address, the key and the client id), thread-safe (one connection per thread).

  `transport`: 'columnar' or 'pickle' (`ForwardingBufferClient`; 'pickle' is the older
  transport, kept to measure against)."""

  def __init__(self, address, authkey: bytes, client_id: str, *,
               margin_s: float = RPC_MARGIN_S, call_timeout_s: float = 60.0,
               transport: str = "columnar"):
    if transport not in TRANSPORTS:
      raise ValueError(f"transport={transport!r} must be one of {TRANSPORTS}")
    self.address = tuple(address)
    self.authkey = bytes(authkey)
    self.client_id = str(client_id)
    self.margin_s = margin_s
    self.call_timeout_s = call_timeout_s  # for calls without a timeout of their own
    self.transport = transport
    self._local = threading.local()
    self._connections: list = []
    self._connections_lock = threading.Lock()

  def __getstate__(self):
    return {"address": self.address, "authkey": self.authkey, "client_id": self.client_id,
            "margin_s": self.margin_s, "call_timeout_s": self.call_timeout_s,
            "transport": self.transport}

  def __setstate__(self, state):
    self.__init__(state["address"], state["authkey"], state["client_id"],
                  margin_s=state["margin_s"], call_timeout_s=state["call_timeout_s"],
                  transport=state.get("transport", "columnar"))

  def _conn(self):
    conn = getattr(self._local, "conn", None)
    if conn is None:
      try:
        conn = wire.connect(self.address, self.authkey, self.call_timeout_s)
        wire.call(conn, "hello", (self.client_id,), {}, self.call_timeout_s)
      except wire.ServiceGone as error:
        raise BufferClosed(f"the buffer service at {self.address} is gone: {error}") from error
      self._local.conn = conn
      with self._connections_lock:
        self._connections.append(conn)
    return conn

  def _call(self, method: str, *args, timeout: float | None = None, **kwargs):
    conn = self._conn()
    wait = (self.call_timeout_s if timeout is None else timeout) + self.margin_s
    try:
      return wire.call(conn, method, args, kwargs, wait)
    except wire.ServiceGone as error:
      self._drop_conn()
      raise BufferClosed(f"{method}: the buffer service at {self.address} is gone") from error
    except wire.ServiceTimeout:
      self._drop_conn()  # a late reply would answer the next call
      raise

  def _drop_conn(self) -> None:
    conn = getattr(self._local, "conn", None)
    self._local.conn = None
    if conn is not None:
      conn.close()

  def disconnect(self):
    with self._connections_lock:
      connections, self._connections = self._connections, []
    for conn in connections:
      conn.close()
    self._local = threading.local()
