"""A verifier as a separate service: a process on 127.0.0.1 that scores digit-reverse answers
with a concurrency limit and a per-request latency, like a code sandbox or an LLM judge shared
by a whole run (the published figures behind the defaults: docs/workloads.md).

At most `concurrency` requests are verified at once, the others wait in FIFO order. Request
`id` takes `latency_s(settings, id)`: with probability `timeout_fraction` the sandbox limit
`latency_max_s` (a program that runs until it is killed), else a lognormal draw (median
`latency_median_s`, log-sd `latency_sigma`) clipped to [`latency_min_s`, `latency_max_s`];
times `time_scale`, a pure function of (`seed`, id). The answer is the exact check with the
request's queue wait and service time. Wire: a 4-byte big-endian length, then a UTF-8 JSON
object; operations `verify` {id, prompt, response}, `stats`, `stop`. The service exits on
`stop`, when its stdin reaches EOF (its starter died) or when its parent process is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import pathlib
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from jaxrl_async.tasks.rewards import reverse_reward
from jaxrl_async.tasks.tokenizer import DIGIT_IDS, EOS_ID

HOST = "127.0.0.1"  # loopback only: the service is never reachable from another machine
MAX_MESSAGE_BYTES = 1 << 20
_HEADER = struct.Struct(">I")
_POLL_S = 0.2  # how often blocked service threads look for a stop
_MESSAGE_TIMEOUT_S = 30.0  # a message that has begun must arrive whole within this


class VerifierError(RuntimeError):
  """The verifier could not be reached or gave a bad answer (a reward pool counts it failed)."""


class VerifierTimeout(VerifierError, TimeoutError):
  """The verifier gave no answer within the call's time limit (counted as a timeout)."""


@dataclasses.dataclass(frozen=True)
class VerifierSettings:
  """How the verifier service behaves and how it is called (all times in seconds).

  concurrency: requests verified at once, >= 1 (the rest wait in FIFO order).
  latency_median_s, latency_sigma: the lognormal of a request's time, in published seconds.
  latency_min_s, latency_max_s: its clip; latency_max_s is also a timed-out request's time.
  timeout_fraction: share of requests that run to latency_max_s, in [0, 1).
  time_scale: multiplies every latency (published seconds -> this run's seconds), > 0.
  seed: latencies are a pure function of (seed, request id).
  connect_timeout_s, call_timeout_s, start_timeout_s: the client's limits on connecting, on
    one call (queue wait included) and on the service's start.
  """

  concurrency: int = 6
  latency_median_s: float = 0.30
  latency_sigma: float = 0.70
  latency_min_s: float = 0.115
  latency_max_s: float = 30.0
  timeout_fraction: float = 0.05
  time_scale: float = 0.005
  seed: int = 0
  connect_timeout_s: float = 5.0
  call_timeout_s: float = 30.0
  start_timeout_s: float = 60.0

  def __post_init__(self):
    def bad(name: str, allowed: str):
      raise ValueError(f"VerifierSettings.{name} must be {allowed}, got {getattr(self, name)!r}")

    for name, low in (("concurrency", 1), ("seed", 0)):
      if not isinstance(getattr(self, name), (int, np.integer)) or getattr(self, name) < low:
        bad(name, f"an int >= {low}")
    for name in ("latency_median_s", "time_scale", "connect_timeout_s", "call_timeout_s",
                 "start_timeout_s", "latency_sigma", "latency_min_s"):
      positive = name not in ("latency_sigma", "latency_min_s")
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or not (value > 0 if positive else value >= 0):
        bad(name, "a number > 0" if positive else "a number >= 0 (no negative latency)")
    if not self.latency_min_s <= self.latency_median_s <= self.latency_max_s:
      bad("latency_max_s", f">= latency_median_s={self.latency_median_s} >= latency_min_s="
          f"{self.latency_min_s}")
    if not 0.0 <= self.timeout_fraction < 1.0:
      bad("timeout_fraction", "in [0, 1)")


def latency_s(settings: VerifierSettings, request_id: int) -> float:
  """Seconds request `request_id` (an int >= 0) takes in the service, `time_scale` applied."""
  rng = np.random.default_rng([settings.seed, int(request_id)])
  if rng.random() < settings.timeout_fraction:
    seconds = settings.latency_max_s
  else:
    seconds = settings.latency_median_s * float(np.exp(settings.latency_sigma
                                                       * rng.standard_normal()))
    seconds = min(max(seconds, settings.latency_min_s), settings.latency_max_s)
  return seconds * settings.time_scale


def digit_reverse_check(prompt_tokens, response_tokens) -> float:
  """1.0 iff the response is the prompt's digits reversed, then <eos> (DigitReverseTask's)."""
  target = [int(t) for t in prompt_tokens if int(t) in DIGIT_IDS][::-1]
  return reverse_reward(response_tokens, target, EOS_ID)


# ---- wire ----------------------------------------------------------------------------------
def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
  body = json.dumps(message).encode()
  sock.sendall(_HEADER.pack(len(body)) + body)


def recv_message(sock: socket.socket) -> dict[str, Any]:
  def exactly(size: int) -> bytes:
    data = b""
    while len(data) < size:
      chunk = sock.recv(min(size - len(data), 1 << 16))
      if not chunk:
        raise ConnectionError("connection closed by the other side")
      data += chunk
    return data

  (size,) = _HEADER.unpack(exactly(_HEADER.size))
  if size > MAX_MESSAGE_BYTES:
    raise ConnectionError(f"message of {size} bytes is over the limit {MAX_MESSAGE_BYTES}")
  message = json.loads(exactly(size))
  if not isinstance(message, dict):
    raise ConnectionError(f"message is not a JSON object: {message!r}")
  return message


# ---- the service (in its own process) ------------------------------------------------------
class VerifierServer:
  """On 127.0.0.1: one thread runs an event loop; each connection's requests are answered in
  turn, at most `concurrency` of all connections' requests are verified at once (an asyncio
  semaphore, FIFO beyond). One thread and no hand-offs between threads keep the service's own
  CPU per request small: the published latency is the service's cost, not its Python."""

  def __init__(self, settings: VerifierSettings, port: int = 0):
    self.settings = settings
    self.listener = socket.create_server((HOST, port))
    self.stopped = threading.Event()  # set by `stop`, or by the watchers of the parent
    self._counts = {"requests": 0, "completed": 0, "errors": 0, "active": 0, "max_active": 0,
                    "queued": 0, "queue_s": 0.0, "max_queue_s": 0.0, "service_s": 0.0}

  def serve(self) -> None:
    """Serves until `stopped` is set; requests still waiting then get no answer."""
    asyncio.run(self._serve())

  async def _serve(self) -> None:
    self._slots = asyncio.Semaphore(self.settings.concurrency)
    self.listener.setblocking(False)
    server = await asyncio.start_server(self._handle, sock=self.listener)
    async with server:
      while not self.stopped.is_set():
        await asyncio.sleep(_POLL_S)

  async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
      while not self.stopped.is_set():
        (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
        if size > MAX_MESSAGE_BYTES:
          return
        message = json.loads(await asyncio.wait_for(reader.readexactly(size),
                                                    _MESSAGE_TIMEOUT_S))
        if not isinstance(message, dict):
          return
        body = json.dumps(await self._answer(message)).encode()
        writer.write(_HEADER.pack(len(body)) + body)
        await writer.drain()
    except (asyncio.IncompleteReadError, TimeoutError, OSError, ValueError):
      return  # the client went away or sent garbage: drop its connection
    except asyncio.CancelledError:
      return  # the service stops: its connections end unanswered
    finally:
      writer.close()

  async def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
    op = request.get("op")
    if op == "verify":
      return await self._verify(request)
    if op == "stats":
      return {"ok": True, "concurrency": self.settings.concurrency, **self._counts}
    if op == "stop":
      self.stopped.set()
      return {"ok": True}
    return {"ok": False, "error": f"unknown op {op!r}; allowed: 'verify', 'stats', 'stop'"}

  async def _verify(self, request: dict[str, Any]) -> dict[str, Any]:
    counts, arrived = self._counts, time.monotonic()
    counts["requests"] += 1
    counts["queued"] += 1
    async with self._slots:
      started, started_at = time.monotonic(), time.time()
      counts["queued"] -= 1
      counts["active"] += 1
      counts["max_active"] = max(counts["max_active"], counts["active"])
      try:
        request_id = int(request["id"])
        if request_id < 0:
          raise ValueError(f"request id must be >= 0, got {request_id}")
        await asyncio.sleep(latency_s(self.settings, request_id))
        reply = {"ok": True, "id": request_id,
                 "reward": digit_reverse_check(request["prompt"], request["response"])}
      except Exception as error:  # a malformed request is answered, never fatal to the service
        reply = {"ok": False, "error": f"{type(error).__name__}: {error}"}
      finally:
        counts["active"] -= 1
    queue_s, service_s = started - arrived, time.monotonic() - started
    counts["completed" if reply["ok"] else "errors"] += 1
    counts["queue_s"] += queue_s
    counts["max_queue_s"] = max(counts["max_queue_s"], queue_s)
    counts["service_s"] += service_s
    return {**reply, "queue_s": queue_s, "service_s": service_s, "started_at": started_at,
            "finished_at": time.time()}


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


# ---- the caller's side ---------------------------------------------------------------------
# One verified answer and where its time went (`*_at`: the service's wall clock, time.time).
Verdict = collections.namedtuple("Verdict", "reward queue_s service_s started_at finished_at")


class VerifierClient:
  """Calls a verifier service; picklable (only the address and limits travel) and thread-safe
  (each thread keeps its own connection). A refused or broken connection or a bad answer raises
  VerifierError, no answer within `call_timeout_s` raises VerifierTimeout; after an error that
  thread's connection is closed and its next call connects again."""

  def __init__(self, address: tuple[str, int], *, connect_timeout_s: float = 5.0,
               call_timeout_s: float = 30.0):
    self.address = (str(address[0]), int(address[1]))
    self.connect_timeout_s, self.call_timeout_s = float(connect_timeout_s), float(call_timeout_s)
    self.where = f"{self.address[0]}:{self.address[1]}"
    self._local = threading.local()

  def __getstate__(self) -> dict[str, Any]:
    return {k: v for k, v in self.__dict__.items() if k != "_local"}

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state, _local=threading.local())

  def __repr__(self) -> str:
    return f"VerifierClient({self.where})"

  def verify(self, request_id: int, prompt_tokens, response_tokens) -> Verdict:
    reply = self._call({"op": "verify", "id": int(request_id),
                        "prompt": np.asarray(prompt_tokens).reshape(-1).tolist(),
                        "response": np.asarray(response_tokens).reshape(-1).tolist()})
    try:
      if reply["id"] != int(request_id):
        raise ValueError(f"an answer to request {reply['id']!r}, not {request_id}")
      return Verdict(*(float(reply[key]) for key in Verdict._fields))
    except (KeyError, TypeError, ValueError) as error:
      raise VerifierError(f"verifier at {self.where} gave a bad answer {reply!r}: "
                          f"{error}") from None

  def stats(self) -> dict[str, float]:
    return {k: v for k, v in self._call({"op": "stats"}).items() if k != "ok"}

  def stop(self) -> None:
    self._call({"op": "stop"})
    self.close()

  def close(self) -> None:  # this thread's connection; the others close with their threads
    sock, self._local.sock = getattr(self._local, "sock", None), None
    if sock is not None:
      sock.close()

  def _call(self, message: dict[str, Any]) -> dict[str, Any]:
    try:
      if getattr(self._local, "sock", None) is None:
        self._local.sock = socket.create_connection(self.address,
                                                    timeout=self.connect_timeout_s)
      self._local.sock.settimeout(self.call_timeout_s)
      send_message(self._local.sock, message)
      reply = recv_message(self._local.sock)
    except TimeoutError:
      self.close()
      raise VerifierTimeout(f"verifier at {self.where} gave no answer to {message['op']!r} "
                            f"within call_timeout_s={self.call_timeout_s} (or connect_timeout_s="
                            f"{self.connect_timeout_s}): hung or overloaded") from None
    except (OSError, ValueError) as error:
      self.close()
      raise VerifierError(f"verifier at {self.where} is unreachable or broke the connection "
                          f"({type(error).__name__}: {error}); is it running?") from None
    if reply.get("ok") is not True:
      raise VerifierError(f"verifier at {self.where} refused {message['op']!r}: "
                          f"{reply.get('error', reply)!r}")
    return reply


class VerifierProcess:
  """A verifier service in a child process: `start(settings)`, `client()`, `stop()`. The child
  is in a session of its own (a Ctrl-C to the terminal reaches the run, which then stops the
  service) and ends with this process."""

  def __init__(self, process: subprocess.Popen, address: tuple[str, int],
               settings: VerifierSettings):
    self.process, self.address, self.settings = process, address, settings

  @classmethod
  def start(cls, settings: VerifierSettings) -> VerifierProcess:
    """Starts the service; waits at most `start_timeout_s` for its address."""
    root = str(pathlib.Path(__file__).resolve().parents[2])  # the package, wherever it runs
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    process = subprocess.Popen(
        [sys.executable, "-m", "jaxrl_async.tasks.verifier_service", "--parent_pid",
         str(os.getpid()), "--settings", json.dumps(dataclasses.asdict(settings))],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)}, start_new_session=True)
    try:
      if not select.select([process.stdout], [], [], settings.start_timeout_s)[0]:
        raise VerifierError(f"the verifier service gave no address within start_timeout_s="
                            f"{settings.start_timeout_s}")
      hello = json.loads(process.stdout.readline() or "null")
      if hello is None:
        raise VerifierError(f"the verifier service exited with code "
                            f"{process.wait(timeout=10)} while starting (see its stderr)")
      return cls(process, (str(hello["host"]), int(hello["port"])), settings)
    except BaseException:
      process.kill()
      process.wait(timeout=10)
      raise
    finally:
      process.stdout.close()

  def client(self) -> VerifierClient:
    return VerifierClient(self.address, connect_timeout_s=self.settings.connect_timeout_s,
                          call_timeout_s=self.settings.call_timeout_s)

  def stop(self, timeout_s: float = 10.0) -> int:
    """Asks the service to stop, kills it if it has not exited; returns its exit code."""
    if self.process.poll() is None:
      with contextlib.suppress(VerifierError):
        VerifierClient(self.address, connect_timeout_s=1.0, call_timeout_s=2.0).stop()
      with contextlib.suppress(OSError):
        self.process.stdin.close()
      try:
        self.process.wait(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        self.process.kill()
        self.process.wait(timeout=timeout_s)
    return self.process.returncode


if __name__ == "__main__":
  sys.exit(main())
