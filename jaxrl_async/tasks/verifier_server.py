"""The verifier service's own process: `python -m jaxrl_async.tasks.verifier_server`.

What it does, its wire and its latency model: `verifier_service` (started by
`verifier_service.VerifierProcess`). How: one thread runs an asyncio event loop with one
protocol object per connection and no task per request. A request that arrives whole is parsed
at once; a verify request either takes one of the `concurrency` slots or waits in one FIFO
shared by every connection; its latency is a timer on the loop (`call_later`), at whose end the
answer is checked and written and the next waiting request takes the slot. A connection's
requests are answered in turn: the next is read once the previous one is answered. So the
service's own CPU per request is a parse, a timer and a write, a small fraction of the
published latency it stands for (`benchmarks/verifier_service.py` measures it).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxrl_async.tasks.verifier_service import (
  HEADER,
  HOST,
  MAX_MESSAGE_BYTES,
  VerifierSettings,
  digit_reverse_check,
  latency_s,
)

_POLL_S = 0.2  # how often the loop and the watcher threads look for a stop
MESSAGE_TIMEOUT_S = 30.0  # a message that has begun must arrive whole within this

Reply = Callable[[dict[str, Any]], None]


class VerifierServer:
  """Serves on 127.0.0.1 until `stopped` is set (by the `stop` operation or by a watcher)."""

  def __init__(self, settings: VerifierSettings, port: int = 0,
               message_timeout_s: float = MESSAGE_TIMEOUT_S):
    self.settings = settings
    self.message_timeout_s = message_timeout_s
    self.listener = socket.create_server((HOST, port))
    self.stopped = threading.Event()
    self._counts = {"requests": 0, "completed": 0, "errors": 0, "active": 0, "max_active": 0,
                    "queued": 0, "queue_s": 0.0, "max_queue_s": 0.0, "service_s": 0.0}
    self._waiting: collections.deque = collections.deque()  # (request, reply, arrived)
    self._connections: set[_Connection] = set()
    self._loop: asyncio.AbstractEventLoop | None = None

  def serve(self) -> None:
    """Serves until `stopped` is set; requests still waiting then get no answer."""
    asyncio.run(self._serve())

  async def _serve(self) -> None:
    self._loop = asyncio.get_running_loop()
    self.listener.setblocking(False)
    server = await self._loop.create_server(lambda: _Connection(self), sock=self.listener)
    async with server:
      while not self.stopped.is_set():
        await asyncio.sleep(_POLL_S)
      for connection in list(self._connections):
        connection.close()

  # ---- requests ------------------------------------------------------------------------------
  def answer(self, request: dict[str, Any], reply: Reply) -> None:
    op = request.get("op")
    if op == "verify":
      counts = self._counts
      counts["requests"] += 1
      counts["queued"] += 1
      self._waiting.append((request, reply, time.monotonic()))
      self._start_waiting()
    elif op == "stats":
      reply({"ok": True, "concurrency": self.settings.concurrency, **self._counts})
    elif op == "stop":
      self.stopped.set()
      reply({"ok": True})
    else:
      reply({"ok": False, "error": f"unknown op {op!r}; allowed: 'verify', 'stats', 'stop'"})

  def _start_waiting(self) -> None:
    """Gives free slots to the requests waiting longest (FIFO over every connection)."""
    counts = self._counts
    while self._waiting and counts["active"] < self.settings.concurrency:
      request, reply, arrived = self._waiting.popleft()
      started, started_at = time.monotonic(), time.time()
      counts["queued"] -= 1
      counts["active"] += 1
      counts["max_active"] = max(counts["max_active"], counts["active"])
      try:
        request_id = int(request["id"])
        if request_id < 0:
          raise ValueError(f"request id must be >= 0, got {request_id}")
        delay = latency_s(self.settings, request_id)
      except Exception as error:  # a malformed request is answered, never fatal to the service
        self._conclude(request, reply, arrived, started, started_at, error)
        continue
      self._loop.call_later(delay, self._finish, request, reply, arrived, started, started_at)

  def _finish(self, request, reply: Reply, arrived: float, started: float,
              started_at: float) -> None:
    """A request's latency has passed: its answer, then its slot to the next waiting one."""
    self._conclude(request, reply, arrived, started, started_at, None)
    self._start_waiting()

  def _conclude(self, request, reply: Reply, arrived: float, started: float, started_at: float,
              error: Exception | None) -> None:
    """Checks the answer (unless `error` already says why not), frees the slot, counts, replies."""
    counts = self._counts
    if error is None:
      try:
        answer = {"ok": True, "id": int(request["id"]),
                  "reward": digit_reverse_check(request["prompt"], request["response"])}
      except Exception as failed:  # e.g. no 'prompt': answered as an error
        error = failed
    if error is not None:
      answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
    counts["active"] -= 1
    queue_s, service_s = started - arrived, time.monotonic() - started
    counts["completed" if answer["ok"] else "errors"] += 1
    counts["queue_s"] += queue_s
    counts["max_queue_s"] = max(counts["max_queue_s"], queue_s)
    counts["service_s"] += service_s
    reply({**answer, "queue_s": queue_s, "service_s": service_s, "started_at": started_at,
           "finished_at": time.time()})


class _Connection(asyncio.Protocol):
  """One client's connection: whole messages in, one answer out per message, in turn. A
  message over MAX_MESSAGE_BYTES, one that is not a JSON object, or one begun and not whole
  within the server's `message_timeout_s` closes the connection unanswered."""

  def __init__(self, server: VerifierServer):
    self.server = server
    self.transport: asyncio.Transport | None = None
    self.buffer = bytearray()
    self.answering = False
    self.deadline: asyncio.TimerHandle | None = None

  def connection_made(self, transport) -> None:
    self.transport = transport
    self.server._connections.add(self)

  def connection_lost(self, exc) -> None:
    self.server._connections.discard(self)
    self._disarm()

  def close(self) -> None:
    self._disarm()
    if self.transport is not None and not self.transport.is_closing():
      self.transport.close()

  def data_received(self, data: bytes) -> None:
    self.buffer += data
    self._next()

  def _next(self) -> None:
    """Takes the next whole message, if no answer is pending."""
    if self.answering or self.transport.is_closing():
      return
    if len(self.buffer) >= HEADER.size:
      (size,) = HEADER.unpack_from(self.buffer)
      if size > MAX_MESSAGE_BYTES:
        return self.close()
      end = HEADER.size + size
      if len(self.buffer) >= end:
        self._disarm()
        body, self.buffer = bytes(self.buffer[HEADER.size:end]), self.buffer[end:]
        try:
          message = json.loads(body)
        except ValueError:
          return self.close()
        if not isinstance(message, dict):
          return self.close()
        self.answering = True
        return self.server.answer(message, self._reply)
    if self.buffer and self.deadline is None:  # a message has begun: it must end in time
      self.deadline = self.server._loop.call_later(self.server.message_timeout_s, self.close)

  def _reply(self, answer: dict[str, Any]) -> None:
    if self.transport.is_closing():
      return  # the client went away while its request was in service
    body = json.dumps(answer).encode()
    self.transport.write(HEADER.pack(len(body)) + body)
    self.answering = False
    self._next()

  def _disarm(self) -> None:
    if self.deadline is not None:
      self.deadline.cancel()
      self.deadline = None


def _watch_parent(server: VerifierServer, parent_pid: int) -> None:
  """Stops the server at EOF on stdin (the starter closed it or died) or on re-parenting."""
  def stdin_closed() -> None:
    with contextlib.suppress(OSError, ValueError):
      while sys.stdin.buffer.read(1 << 12):
        pass
    server.stopped.set()

  def parent_gone() -> None:
    while not server.stopped.wait(_POLL_S):
      if os.getppid() != parent_pid:
        server.stopped.set()

  for watch in (stdin_closed, parent_gone):
    threading.Thread(target=watch, name=f"verifier-{watch.__name__}", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description="A verifier service on 127.0.0.1.")
  parser.add_argument("--settings", required=True, help="VerifierSettings as a JSON object")
  parser.add_argument("--parent_pid", type=int, required=True)
  args = parser.parse_args(argv)
  server = VerifierServer(VerifierSettings(**json.loads(args.settings)))  # on a free port
  _watch_parent(server, args.parent_pid)
  host, port = server.listener.getsockname()[:2]
  print(json.dumps({"host": host, "port": port, "pid": os.getpid()}), flush=True)  # the address
  server.serve()
  return 0


if __name__ == "__main__":
  sys.exit(main())
