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
The service itself runs in its own process: `verifier_server`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import pathlib
import select
import socket
import statistics
import struct
import subprocess
import sys
import threading
from typing import Any

import numpy as np

from jaxrl_async.tasks.rewards import reverse_reward
from jaxrl_async.tasks.tokenizer import DIGIT_IDS, EOS_ID

HOST = "127.0.0.1"  # loopback only: the service is never reachable from another machine
MAX_MESSAGE_BYTES = 1 << 20
HEADER = struct.Struct(">I")


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


_MASK64 = (1 << 64) - 1
_STANDARD_NORMAL = statistics.NormalDist()


def _mix64(x: int) -> int:
  """SplitMix64's finaliser: a bijection of 64-bit ints whose outputs pass as uniform."""
  x = (x + 0x9E3779B97F4A7C15) & _MASK64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
  return x ^ (x >> 31)


def _uniform(seed: int, request_id: int, draw: int) -> float:
  """Draw `draw` of request `request_id` under `seed`: uniform on the open interval (0, 1)."""
  bits = _mix64(_mix64(seed) ^ ((2 * request_id + draw) & _MASK64)) >> 11
  return (bits + 0.5) / (1 << 53)


def latency_s(settings: VerifierSettings, request_id: int) -> float:
  """Seconds request `request_id` (an int >= 0) takes in the service, `time_scale` applied.
  Pure Python on two hashed uniforms (a few microseconds: the service's own CPU is not the
  latency it stands for)."""
  request_id = int(request_id)
  if _uniform(settings.seed, request_id, 0) < settings.timeout_fraction:
    seconds = settings.latency_max_s
  else:
    normal = _STANDARD_NORMAL.inv_cdf(_uniform(settings.seed, request_id, 1))
    seconds = settings.latency_median_s * math.exp(settings.latency_sigma * normal)
    seconds = min(max(seconds, settings.latency_min_s), settings.latency_max_s)
  return seconds * settings.time_scale


_DIGITS = frozenset(DIGIT_IDS)


def digit_reverse_check(prompt_tokens, response_tokens) -> float:
  """1.0 iff the response is the prompt's digits reversed, then <eos> (DigitReverseTask's)."""
  target = [t for t in map(int, prompt_tokens) if t in _DIGITS][::-1]
  return reverse_reward(response_tokens, target, EOS_ID)


# ---- wire ----------------------------------------------------------------------------------
def send_message(sock: socket.socket, message: dict[str, Any]) -> None:
  body = json.dumps(message).encode()
  sock.sendall(HEADER.pack(len(body)) + body)


def recv_message(sock: socket.socket) -> dict[str, Any]:
  """One whole message (usually one `recv`). The other side sends only answers, one per
  request, so a byte after the message is a broken connection."""
  data, size = b"", None
  while size is None or len(data) < HEADER.size + size:
    chunk = sock.recv(1 << 16 if size is None else HEADER.size + size - len(data))
    if not chunk:
      raise ConnectionError("connection closed by the other side")
    data += chunk
    if size is None and len(data) >= HEADER.size:
      (size,) = HEADER.unpack_from(data)
      if size > MAX_MESSAGE_BYTES:
        raise ConnectionError(f"message of {size} bytes is over the limit {MAX_MESSAGE_BYTES}")
  if len(data) > HEADER.size + size:
    raise ConnectionError(f"{len(data) - HEADER.size - size} bytes after a message: the "
                          "other side does not speak this protocol")
  message = json.loads(data[HEADER.size:])
  if not isinstance(message, dict):
    raise ConnectionError(f"message is not a JSON object: {message!r}")
  return message


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
        [sys.executable, "-m", "jaxrl_async.tasks.verifier_server", "--parent_pid",
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
