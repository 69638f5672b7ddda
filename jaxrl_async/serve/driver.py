"""The decode driver: one named thread owns the engine's `ContinuousBatcher` and streams tokens.

Requests arrive from any number of gRPC handler threads (`submit`); the driver admits them into
free slots between engine steps (continuous batching) and, after every step, hands each request
the tokens its samples drew in that step. A request's tokens depend only on its own keys
(`sample_keys(seed, prompt_key(prompt), member)`), never on what ran beside it, so a served
response equals the engine's own output for the same prompt.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import zlib

import numpy as np

from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_keys
from jaxrl_async.types import Sample

DONE = object()  # the last item of a stream's queue after all its samples finished
CANCELLED = object()  # put by `Stream.cancel`: wakes the handler waiting on the queue


class DriverStopped(RuntimeError):
  """The driver is not running (stopped, or failed: the cause is chained)."""


def prompt_key(prompt_tokens: np.ndarray) -> int:
  """A request's group id for its sampling keys: a hash of its prompt (same prompt, same keys)."""
  return zlib.crc32(np.asarray(prompt_tokens, np.int32).tobytes()) & 0x7FFFFFFF


class StreamingBatcher(ContinuousBatcher):
  """A ContinuousBatcher that also shows the response tokens drawn so far by each slot."""

  def in_flight(self) -> list[tuple[GenerationRequest, list[int]]]:
    return [(slot.request, slot.tokens) for slot in self._slots if slot is not None]


@dataclasses.dataclass
class Stream:
  """One request's output: `chunks` receives lists (one token list per sample), then DONE, or
  an exception if the driver failed."""

  num_samples: int
  max_tokens: int
  chunks: queue.Queue = dataclasses.field(default_factory=queue.Queue)
  sent: list = dataclasses.field(default_factory=list)  # tokens sent so far, per sample
  done: list = dataclasses.field(default_factory=list)  # per sample: finished or at max_tokens
  cancelled: bool = False

  def __post_init__(self):
    self.sent = [0] * self.num_samples
    self.done = [False] * self.num_samples

  def cancel(self) -> None:
    """The driver drops the stream's output from now on (its slots finish on their own), and
    the handler waiting on `chunks` wakes up and ends (else it would wait out its timeout)."""
    if not self.cancelled:
      self.cancelled = True
      self.chunks.put(CANCELLED)


class DecodeDriver:
  """Owns `batcher` (and its engine) on the thread 'serve-driver'."""

  def __init__(self, batcher: StreamingBatcher, params, *, seed: int = 0, version: int = 0,
               idle_wait_s: float = 0.05):
    self.batcher = batcher
    self.seed = seed
    self.idle_wait_s = idle_wait_s
    batcher.set_params(params, version)
    self._incoming: queue.Queue = queue.Queue()
    self._stop = threading.Event()
    self._error: BaseException | None = None
    self._thread = threading.Thread(target=self._run, name="serve-driver", daemon=True)
    self.tokens_streamed = 0

  @property
  def max_response_len(self) -> int:
    return self.batcher.max_response_len

  @property
  def error(self) -> BaseException | None:
    """What stopped the driver, if it failed."""
    return self._error

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and not self._stop.is_set()

  def start(self) -> DecodeDriver:
    self._thread.start()
    return self

  def stop(self, timeout_s: float = 30.0) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=timeout_s)
      if self._thread.is_alive():
        raise TimeoutError(f"serve-driver did not stop within {timeout_s}s")

  def submit(self, prompt_tokens: np.ndarray, *, num_samples: int = 1,
             max_tokens: int | None = None) -> Stream:
    """Queue one request (checked by the caller); returns its stream."""
    if not self.alive:
      raise DriverStopped("the decode driver is not running") from self._error
    max_tokens = self.max_response_len if not max_tokens else min(max_tokens,
                                                                  self.max_response_len)
    stream = Stream(num_samples=num_samples, max_tokens=max_tokens)
    prompt = np.asarray(prompt_tokens, np.int32)
    group_id = prompt_key(prompt)
    keys = sample_keys(self.seed, group_id, list(range(num_samples)))
    requests = []
    for member, key in enumerate(keys):
      sample = Sample(prompt_id=group_id, group_id=group_id, group_size=num_samples,
                      prompt_tokens=prompt, meta={"index_in_group": member, "stream": stream})
      requests.append(GenerationRequest(sample, key))
    self._incoming.put(requests)
    if self._stop.is_set():  # stopped while this was queued: the queue may be drained already
      stream.chunks.put(DriverStopped("the decode driver stopped"))
    return stream

  # ---- the thread -------------------------------------------------------------------------
  def _run(self) -> None:
    try:
      while not self._stop.is_set():
        self._admit(block=self.batcher.idle)
        if self.batcher.idle:
          continue
        finished = self.batcher.step()
        self._emit(finished)
    except BaseException as error:  # every stream learns of it; the server reports not live
      self._error = error
      self._stop.set()
      self._fail_all(error)
      return
    self._fail_all(DriverStopped("the server is shutting down"))

  def _admit(self, block: bool) -> None:
    try:
      batch = self._incoming.get(timeout=self.idle_wait_s) if block else self._incoming.get_nowait()
    except queue.Empty:
      return
    while True:
      self.batcher.submit(batch)
      try:
        batch = self._incoming.get_nowait()
      except queue.Empty:
        return

  def _emit(self, finished: list[Sample]) -> None:
    """Send every request the tokens its samples drew in this step (one chunk a request)."""
    chunks: dict[int, tuple[Stream, list]] = {}

    def add(sample: Sample, tokens, sample_finished: bool) -> None:
      stream, member = sample.meta["stream"], sample.meta["index_in_group"]
      if stream.done[member]:  # reached max_tokens earlier; its slot ran on to its end
        return
      new = list(tokens[stream.sent[member]:stream.max_tokens])
      stream.sent[member] += len(new)
      stream.done[member] = sample_finished or stream.sent[member] >= stream.max_tokens
      chunk = chunks.setdefault(id(stream), (stream, [[] for _ in range(stream.num_samples)]))[1]
      chunk[member] = new

    for request, tokens in self.batcher.in_flight():
      add(request.sample, tokens, False)
    for sample in finished:
      add(sample, sample.response_tokens.tolist(), True)
    for stream, chunk in chunks.values():
      if stream.cancelled:
        continue
      if any(chunk):
        self.tokens_streamed += sum(len(tokens) for tokens in chunk)
        stream.chunks.put(chunk)
      if all(stream.done):
        stream.chunks.put(DONE)

  def _fail_all(self, error: BaseException) -> None:
    pending = self.batcher.take_pending() + [r for r, _ in self.batcher.in_flight()]
    while True:
      try:
        pending += self._incoming.get_nowait()
      except queue.Empty:
        break
    streams = {id(r.sample.meta["stream"]): r.sample.meta["stream"] for r in pending}
    for stream in streams.values():
      stream.chunks.put(error)
