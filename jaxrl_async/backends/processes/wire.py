"""Calls between processes: `multiprocessing.connection` on 127.0.0.1 (or a Pipe), pickled.

A request is `(method, args, kwargs)`, a reply `('ok', value)` or `('error', exception)`; one
request is in flight per connection at a time. A caller waits for its reply with a timeout
(`ServiceTimeout`); a connection whose other end died raises `ServiceGone`. A connection that
timed out is closed (a late reply would answer the next call), so callers open a new one.

Why this transport: it is in the standard library, authenticates with a per-run key, and moves a
batch of samples in one message. Samples travel as one columnar blob (`encode_samples`): every
sample's arrays concatenated into one int32 and one float32 block behind a small pickled header
of the per-sample scalars, so that neither side builds or parses a pickle per numpy array (that
cost about 20 us a sample each way). `benchmarks/buffer_throughput.py --cross_process` measures
both encodings side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import pickle
import select
import socket
import struct
import threading
from collections.abc import Callable, Sequence
from multiprocessing import connection as mp_connection
from typing import Any

import numpy as np

from jaxrl_async.types import Sample

HOST = "127.0.0.1"
# How often a serving thread looks at its stop flag while its connection is quiet.
SERVE_POLL_S = 0.2
# Connections a Server's listener holds while its accept thread makes another (socket.listen's
# backlog; the kernel caps it at net.core.somaxconn).
LISTEN_BACKLOG = 128


# A sample batch: MAGIC, the header's length (u32), the pickled header, then the int32 block
# (all prompt tokens, all response tokens, all token versions) and the float32 block (all
# behaviour logprobs), little-endian.
MAGIC = b"JXS1"
_PREFIX = struct.Struct("<4sI")
_INT32, _FLOAT32 = np.dtype("<i4"), np.dtype("<f4")
_ARRAYS = (("prompt_tokens", _INT32), ("response_tokens", _INT32),
           ("behaviour_logprobs", _FLOAT32), ("token_versions", _INT32))
_SCALARS = ("prompt_id", "group_id", "group_size", "finish_reason", "reward", "reward_status",
            "retries", "interruptions", "timestamps", "meta")
_FIELDS = tuple(field.name for field in dataclasses.fields(Sample))  # Sample's argument order
_FIELD_SET = frozenset(_FIELDS)
if set(_SCALARS) | {name for name, _ in _ARRAYS} != _FIELD_SET:
  raise ImportError(f"wire: the columnar encoding does not cover Sample's fields {_FIELDS}")


class ServiceTimeout(TimeoutError):
  """No reply within the call's timeout."""


class ServiceGone(ConnectionError):
  """The other end closed the connection or its process died."""


class RemoteError(RuntimeError):
  """The other side raised an exception that could not be sent as it was."""


def columnar(sample) -> bool:
  """Whether `encode_samples` can carry `sample` exactly: a plain Sample whose arrays are 1-D
  numpy arrays of their declared dtypes (what `Sample.__post_init__` makes)."""
  if type(sample) is not Sample or vars(sample).keys() != _FIELD_SET:
    return False
  for name, dtype in _ARRAYS:
    array = getattr(sample, name)
    if type(array) is not np.ndarray or array.dtype != dtype or array.ndim != 1:
      return False
  return True


def encode_samples(samples: Sequence[Sample]) -> bytes:
  """One blob for a batch of samples (`decode_samples` rebuilds them exactly). Raises
  ValueError for a sample `columnar` refuses (send those pickled)."""
  blob = try_encode_samples(samples)
  if blob is None:
    index = next(i for i, sample in enumerate(samples) if not columnar(sample))
    raise ValueError(f"encode_samples: sample {index} is not a plain Sample with 1-D int32 / "
                     "float32 arrays")
  return blob


def try_encode_samples(samples: Sequence[Sample]) -> bytes | None:
  """`encode_samples`, or None when a sample is not `columnar`."""
  if not all(map(columnar, samples)):
    return None
  prompt = [len(s.prompt_tokens) for s in samples]
  response = [len(s.response_tokens) for s in samples]
  header = pickle.dumps(
      (prompt, response, [[getattr(s, name) for s in samples] for name in _SCALARS]),
      protocol=pickle.HIGHEST_PROTOCOL)
  parts = [_PREFIX.pack(MAGIC, len(header)), header]
  for name, dtype in _ARRAYS:
    if samples:
      parts.append(np.concatenate([getattr(s, name) for s in samples]).astype(dtype, copy=False)
                   .tobytes())
  return b"".join(parts)


def decode_samples(blob) -> list[Sample]:
  """The samples of an `encode_samples` blob; their arrays are writable views of one copy of the
  blob's array blocks. Raises ValueError for anything else."""
  view = memoryview(blob).cast("B")
  if len(view) < _PREFIX.size:
    raise ValueError(f"decode_samples: {len(view)} bytes is not a sample batch")
  magic, header_len = _PREFIX.unpack_from(view)
  start = _PREFIX.size + header_len
  if magic != MAGIC or start > len(view):
    raise ValueError("decode_samples: not a sample batch (bad magic or header length)")
  try:
    prompt, response, scalars = pickle.loads(view[_PREFIX.size:start])
  except Exception as error:
    raise ValueError(f"decode_samples: the header does not unpickle ({error!r})") from error
  count = len(prompt)
  if len(response) != count or len(scalars) != len(_SCALARS) or any(
      len(column) != count for column in scalars):
    raise ValueError("decode_samples: the header's columns disagree in length")
  lengths = {"prompt_tokens": prompt, "response_tokens": response,
             "behaviour_logprobs": response, "token_versions": response}
  expected = sum(4 * sum(lengths[name]) for name, _ in _ARRAYS)
  if len(view) - start != expected:
    raise ValueError(f"decode_samples: {len(view) - start} bytes of arrays, the header "
                     f"describes {expected}")
  data = bytearray(view[start:])  # one writable copy for the whole batch
  columns, offset = dict(zip(_SCALARS, scalars, strict=True)), 0
  for name, dtype in _ARRAYS:
    block = np.frombuffer(data, dtype, count=sum(lengths[name]), offset=offset)
    offset += block.nbytes
    bounds = [0, *itertools.accumulate(lengths[name])]
    columns[name] = [block[bounds[i]:bounds[i + 1]] for i in range(count)]
  # The arrays have their declared dtypes and lengths by construction: Sample.__post_init__'s
  # conversions and checks would only cost time (about 4 us a sample).
  made = []
  for row in zip(*(columns[name] for name in _FIELDS), strict=True):
    sample = object.__new__(Sample)
    sample.__dict__.update(zip(_FIELDS, row))
    made.append(sample)
  return made


def readable(conn, timeout: float) -> bool:
  """`conn.poll(timeout)` without its per-call selector (about 10 us a call): a `select.poll`
  kept on the connection. A hang-up or error counts as readable (the read then raises)."""
  if conn.closed or not hasattr(select, "poll"):
    return conn.poll(timeout)  # raises OSError for a closed connection
  poller = getattr(conn, "_wire_poller", None)
  if poller is None:
    poller = select.poll()
    poller.register(conn.fileno(), select.POLLIN)
    conn._wire_poller = poller
  return bool(poller.poll(max(0.0, timeout) * 1e3))


def call(conn, method: str, args: tuple, kwargs: dict, timeout: float) -> Any:
  """Sends one request and waits at most `timeout` seconds for its reply."""
  try:
    conn.send((method, args, kwargs))
    answered = readable(conn, timeout)
    if answered:
      status, value = conn.recv()
  except (EOFError, OSError) as error:
    raise ServiceGone(f"{method}: the connection is closed ({error!r})") from error
  if not answered:  # (ServiceTimeout is an OSError: raised outside the handler above)
    raise ServiceTimeout(f"{method}: no reply within {timeout:.3g} s")
  if status == "ok":
    return value
  raise value


def answer(conn, handler: Callable[[str, tuple, dict], Any], request) -> None:
  """Runs one request and sends its reply (an exception is sent back to the caller)."""
  method, args, kwargs = request
  try:
    reply = ("ok", handler(method, args, kwargs))
  except Exception as error:  # the caller's to handle
    reply = ("error", error)
  try:
    conn.send(reply)
  except (EOFError, OSError):
    raise
  except Exception as error:  # the exception or value did not pickle
    conn.send(("error", RemoteError(f"{method}: {reply[1]!r} ({error!r})")))


def serve_connection(conn, handler, stop: threading.Event) -> None:
  """Answers requests on `conn` until the peer hangs up or `stop` is set."""
  try:
    while not stop.is_set():
      if not readable(conn, SERVE_POLL_S):
        continue
      try:
        request = conn.recv()
      except (EOFError, OSError):
        return
      try:
        answer(conn, handler, request)
      except (EOFError, OSError):
        return
  finally:
    conn.close()


class Server:
  """Accepts authenticated connections on `host` (127.0.0.1 unless another interface is named:
  a Ray driver serves actors of other hosts on its node's address) and serves each in its own
  named thread.

  `open_handler(conn)` makes the handler of a new connection: a callable
  `(method, args, kwargs) -> value`, or None to refuse the connection.
  """

  def __init__(self, open_handler: Callable[[Any], Callable | None], authkey: bytes, *,
               name: str = "service", host: str = HOST):
    self.name = name
    self.authkey = authkey
    self._open_handler = open_handler
    # The accept thread makes one connection at a time (handshake, then the handler's
    # opening); the ones behind it wait in the kernel's backlog. Listener's default backlog of
    # 1 drops those past it while the client believes it connected, and its connect then
    # waits for a handshake that never comes.
    self._listener = mp_connection.Listener((host, 0), authkey=authkey, backlog=LISTEN_BACKLOG)
    self.address = self._listener.address
    self._stop = threading.Event()
    self._threads: list[threading.Thread] = []
    self._lock = threading.Lock()
    self._accept_thread = threading.Thread(target=self._accept, name=f"{name}-accept",
                                           daemon=True)

  def start(self) -> None:
    self._accept_thread.start()

  def _accept(self) -> None:
    while not self._stop.is_set():
      try:
        conn = self._listener.accept()
        no_delay(conn)
      except (OSError, EOFError, mp_connection.AuthenticationError):
        if self._stop.is_set():
          return
        continue
      if self._stop.is_set():
        conn.close()
        return
      handler = self._open_handler(conn)
      if handler is None:
        conn.close()
        continue
      thread = threading.Thread(target=serve_connection, args=(conn, handler, self._stop),
                                name=f"{self.name}-conn-{len(self._threads)}", daemon=True)
      with self._lock:
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
      thread.start()

  def stop(self, timeout: float = 10.0) -> None:
    """Stops accepting and serving; joins every thread (each at most `timeout` seconds)."""
    if self._stop.is_set():
      return
    self._stop.set()
    # accept() does not wake when the listener is closed from another thread: connect once,
    # without the handshake (an authenticated connect waits for the server's challenge, for
    # good when the accept thread has already left its loop); accept() fails its handshake.
    with contextlib.suppress(OSError):
      socket.create_connection(self.address, timeout=timeout).close()
    self._accept_thread.join(timeout)
    self._listener.close()
    with self._lock:
      threads = list(self._threads)
    for thread in threads:
      thread.join(timeout)
    alive = [t.name for t in threads if t.is_alive()] + (
        [self._accept_thread.name] if self._accept_thread.is_alive() else [])
    if alive:
      raise TimeoutError(f"{self.name}: threads {alive} did not stop within {timeout} s")


def no_delay(conn):
  """Turns off Nagle's algorithm on a TCP connection (a reply is never held back waiting for
  an ACK); returns `conn`."""
  with socket.socket(fileno=os.dup(conn.fileno())) as sock:
    if sock.family in (socket.AF_INET, socket.AF_INET6):
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  return conn


def connect(address, authkey: bytes, timeout: float):
  """An authenticated client connection to a `Server`, made within `timeout` seconds: a
  server that accepts the TCP connection but never answers the handshake (stopped, or its
  accept thread gone) raises ServiceTimeout instead of blocking for good."""
  try:
    sock = socket.create_connection(address, timeout=timeout)
  except TimeoutError as error:
    raise ServiceTimeout(f"cannot connect to {address} within {timeout:.3g} s") from error
  except OSError as error:
    raise ServiceGone(f"cannot connect to {address}: {error!r}") from error
  sock.settimeout(None)  # a blocking descriptor for Connection; the handshake's reads bounded:
  _receive_timeout(sock, timeout)
  conn = mp_connection.Connection(sock.detach())
  try:
    mp_connection.answer_challenge(conn, authkey)  # what Client(address, authkey) does
    mp_connection.deliver_challenge(conn, authkey)
    with socket.socket(fileno=os.dup(conn.fileno())) as dup:
      _receive_timeout(dup, 0.0)  # calls bound their own waits (`call`)
  except BaseException as error:
    conn.close()
    if isinstance(error, BlockingIOError):  # SO_RCVTIMEO ran out
      raise ServiceTimeout(f"{address}: no handshake within {timeout:.3g} s") from error
    if isinstance(error, (OSError, EOFError)):
      raise ServiceGone(f"cannot connect to {address}: {error!r}") from error
    raise
  return no_delay(conn)


def _receive_timeout(sock, seconds: float) -> None:
  """SO_RCVTIMEO: a blocking read fails with EAGAIN after `seconds` (0: never)."""
  whole = int(seconds)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                  struct.pack("ll", whole, int((seconds - whole) * 1e6)))
