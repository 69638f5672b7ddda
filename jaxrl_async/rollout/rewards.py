"""A pool of reward workers: every sample is scored with a timeout and bounded retries.

The outcome is written on the sample (`reward`, `reward_status`, `retries`, the 'rewarded'
timestamp); nothing is dropped here. A failed or timed-out sample keeps reward NaN and its status
says why, so the buffer counts it under `reward_failed` / `reward_timeout`.

Samples are scored in batches (`submit_many`, `submit_spread`, `score_all`): a driver thread hands a
batch to one call thread, which runs the reward function on each sample in turn, while the driver
waits for each result with the timeout. Two thread hand-offs per batch rather than per sample keep
the pool cheap when rewards are fast. A batch is one worker's: many samples finished at once (one
decode step's) are cut into at most `num_workers` batches (`spread`), or a slow verifier would score
them one after another while the other workers sit idle; they come back together (`submit_spread`),
so the caller still hands them on in one piece. A timed-out call cannot be killed (it is a Python
thread): it is abandoned with its call thread until it returns, and the rest of the batch continues
on another call thread, so the call pool is larger than the driver pool. `close()` returns without
waiting for abandoned calls. A reward function that enforces its own limit and raises TimeoutError
(tasks/subprocess_reward.py kills its verifier's process) counts as a timeout.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import queue
import threading
import time
from collections.abc import Callable

from jaxrl_async import faults
from jaxrl_async.types import RewardStatus, Sample

RewardFn = Callable[..., float]  # (prompt_tokens, response_tokens, meta) -> float


class RewardPool:

  def __init__(self, reward_fn: RewardFn, *, num_workers: int = 2, timeout_s: float = 10.0,
               max_retries: int = 1, clock=time.time):
    if num_workers < 1:
      raise ValueError(f"reward num_workers must be >= 1, got {num_workers}")
    if not timeout_s > 0:
      raise ValueError(f"reward timeout_s must be > 0, got {timeout_s}")
    if max_retries < 0:
      raise ValueError(f"reward max_retries must be >= 0, got {max_retries}")
    self.reward_fn = reward_fn
    self.timeout_s = timeout_s
    self.max_retries = max_retries
    self.clock = clock
    self.num_workers = num_workers
    self._calls = _CallThreads(2 * num_workers)
    self._drivers = cf.ThreadPoolExecutor(num_workers, thread_name_prefix="reward-driver")
    self._lock = threading.Lock()
    self.counts = {"ok": 0, "failed": 0, "timeout": 0, "retries": 0}
    self.timer = None  # a metrics.RoleTimer: scoring counts as the 'reward' role's busy time

  def _busy(self):
    return self.timer.busy("reward") if self.timer is not None else contextlib.nullcontext()

  def _run_calls(self, samples: list[Sample], results: queue.SimpleQueue,
                 abandoned: threading.Event) -> None:
    """In a call thread: the reward of each sample in turn, as (ok, value or error)."""
    for sample in samples:
      if abandoned.is_set():
        return
      try:
        faults.point("reward.call")
        results.put((True, self.reward_fn(sample.prompt_tokens, sample.response_tokens,
                                          sample.meta)))
      except Exception as error:  # a verifier's error is data here: counted, retried
        results.put((False, error))
      except BaseException as error:  # KeyboardInterrupt, SystemExit: the caller's to raise
        results.put((None, error))
        return

  def score(self, sample: Sample) -> Sample:
    """Score one sample in the calling thread (blocking, bounded by the retries' timeouts)."""
    return self.score_many([sample])[0]

  def score_many(self, samples: list[Sample]) -> list[Sample]:
    """Score samples in the calling thread; each call is bounded by `timeout_s`, and a failed,
    non-finite or timed-out call is retried up to `max_retries` times."""
    with self._busy():
      todo = list(range(len(samples)))
      while todo:
        batch, todo = todo, []
        results: queue.SimpleQueue = queue.SimpleQueue()
        abandoned = threading.Event()
        self._calls.submit(self._run_calls, [samples[i] for i in batch], results, abandoned)
        for position, i in enumerate(batch):
          try:
            ok, value = results.get(timeout=self.timeout_s)
          except queue.Empty:  # this call hangs: abandon it, go on with the rest elsewhere
            abandoned.set()
            self._calls.replace_one()
            self._retry_or_finish(samples[i], RewardStatus.TIMEOUT, todo, i)
            todo.extend(batch[position + 1:])
            break
          if ok is None:
            raise value
          reward = _finite_float(value) if ok else None
          if reward is None:  # a verifier that timed out itself (TimeoutError) is a timeout
            status = (RewardStatus.TIMEOUT if not ok and isinstance(value, TimeoutError)
                      else RewardStatus.FAILED)
            self._retry_or_finish(samples[i], status, todo, i)
          else:
            samples[i].reward = reward
            self._finish(samples[i], RewardStatus.OK)
      return samples

  def _retry_or_finish(self, sample: Sample, status: RewardStatus, todo: list, index: int):
    if sample.retries < self.max_retries:
      sample.retries += 1
      todo.append(index)
    else:
      self._finish(sample, status)

  def _finish(self, sample: Sample, status: RewardStatus) -> None:
    sample.reward_status = status.value
    sample.stamp("rewarded", self.clock())
    with self._lock:
      self.counts[status.value] += 1
      self.counts["retries"] += sample.retries

  def submit(self, sample: Sample) -> cf.Future:
    """Score in the pool; the future resolves to the sample (never raises for reward errors)."""
    return self._drivers.submit(self.score, sample)

  def submit_many(self, samples: list[Sample]) -> cf.Future:
    """Score a batch in the pool; the future resolves to the same list, scored."""
    return self._drivers.submit(self.score_many, list(samples))

  def submit_spread(self, samples: list[Sample]) -> cf.Future:
    """Score samples in at most `num_workers` batches at once (`spread`); the future resolves
    to the same list, scored, when every batch is (one hand-off downstream per call, as
    `submit_many`'s), or to the first batch's error."""
    samples = list(samples)
    whole: cf.Future = cf.Future()
    batches = [self.submit_many(batch) for batch in spread(samples, self.num_workers)]
    if not batches:
      whole.set_result(samples)
      return whole
    remaining = [len(batches)]
    lock = threading.Lock()

    def one_done(_) -> None:
      with lock:
        remaining[0] -= 1
        if remaining[0]:
          return
      error = next((e for e in (f.exception() for f in batches) if e is not None), None)
      if error is not None:
        whole.set_exception(error)
      else:
        whole.set_result(samples)

    for future in batches:
      future.add_done_callback(one_done)
    return whole

  def score_all(self, samples: list[Sample]) -> list[Sample]:
    """Score samples in `num_workers` batches at once; returns them in order."""
    chunk = max(1, math.ceil(len(samples) / self.num_workers))
    deadline = chunk * (self.max_retries + 1) * self.timeout_s + 5.0
    return self.submit_spread(samples).result(timeout=deadline)

  def close(self) -> None:
    self._drivers.shutdown(wait=False, cancel_futures=True)
    self._calls.shutdown()


class _CallThreads:
  """Daemon threads running submitted calls from one queue. A thread stuck in a call that
  never returns is written off with `replace_one()`, which starts another in its place."""

  def __init__(self, num_threads: int):
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._closed = threading.Event()
    self._started = 0
    for _ in range(num_threads):
      self.replace_one()

  def replace_one(self) -> None:
    self._started += 1
    threading.Thread(target=self._work, name=f"reward-call-{self._started}",
                     daemon=True).start()

  def submit(self, fn, *args) -> None:
    if self._closed.is_set():
      raise RuntimeError("the reward pool is closed")
    self._queue.put((fn, args))

  def _work(self) -> None:
    while not self._closed.is_set():
      try:
        fn, args = self._queue.get(timeout=0.5)
      except queue.Empty:
        continue
      fn(*args)

  def shutdown(self) -> None:
    self._closed.set()


def spread(items: list, parts: int) -> list[list]:
  """`items` cut in order into min(parts, len(items)) runs whose lengths differ by at most
  one (no empty run)."""
  if parts < 1:
    raise ValueError(f"parts must be >= 1, got {parts}")
  items = list(items)
  count = min(parts, len(items))
  size, extra = divmod(len(items), count) if count else (0, 0)
  runs, start = [], 0
  for k in range(count):
    end = start + size + (1 if k < extra else 0)
    runs.append(items[start:end])
    start = end
  return runs


def _finite_float(value) -> float | None:
  """The reward as a finite float, or None for NaN, inf or a value that is not a number."""
  try:
    value = float(value)
  except (TypeError, ValueError):
    return None
  return value if math.isfinite(value) else None
