"""A pool of reward workers: every sample is scored with a timeout and bounded retries.

The outcome is written on the sample (`reward`, `reward_status`, `retries`, the 'rewarded'
timestamp); nothing is dropped here. A failed or timed-out sample keeps reward NaN and its status
says why, so the buffer counts it under `reward_failed` / `reward_timeout`.

A timed-out call cannot be killed (it is a Python thread): it is abandoned and keeps its worker
until it returns, so the call pool is larger than the driver pool. `close()` returns without
waiting for abandoned calls.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import math
import threading
import time
from collections.abc import Callable

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
    self._calls = cf.ThreadPoolExecutor(4 * num_workers, thread_name_prefix="reward-call")
    self._drivers = cf.ThreadPoolExecutor(num_workers, thread_name_prefix="reward-driver")
    self._lock = threading.Lock()
    self.counts = {"ok": 0, "failed": 0, "timeout": 0, "retries": 0}
    self.timer = None  # a metrics.RoleTimer: scoring counts as the 'reward' role's busy time

  def _busy(self):
    return self.timer.busy("reward") if self.timer is not None else contextlib.nullcontext()

  def _call_once(self, sample: Sample) -> float:
    future = self._calls.submit(self.reward_fn, sample.prompt_tokens, sample.response_tokens,
                                sample.meta)
    return future.result(timeout=self.timeout_s)

  def score(self, sample: Sample) -> Sample:
    """Score one sample in the calling thread (blocking, bounded by the retries' timeouts)."""
    with self._busy():
      return self._score(sample)

  def _score(self, sample: Sample) -> Sample:
    status = RewardStatus.FAILED
    for attempt in range(self.max_retries + 1):
      if attempt:
        sample.retries += 1
      try:
        value = float(self._call_once(sample))
      except cf.TimeoutError:
        status = RewardStatus.TIMEOUT
        continue
      except Exception:  # a verifier's error is data here: counted, retried, never fatal
        status = RewardStatus.FAILED
        continue
      if not math.isfinite(value):
        status = RewardStatus.FAILED
        continue
      sample.reward, status = value, RewardStatus.OK
      break
    sample.reward_status = status.value
    sample.stamp("rewarded", self.clock())
    with self._lock:
      self.counts[status.value] += 1
      self.counts["retries"] += sample.retries
    return sample

  def submit(self, sample: Sample) -> cf.Future:
    """Score in the pool; the future resolves to the sample (never raises for reward errors)."""
    return self._drivers.submit(self.score, sample)

  def score_all(self, samples: list[Sample]) -> list[Sample]:
    futures = [self.submit(s) for s in samples]
    waves = math.ceil(len(samples) / self.num_workers)
    deadline = time.monotonic() + waves * (self.max_retries + 1) * self.timeout_s + 5.0
    return [f.result(timeout=max(deadline - time.monotonic(), 0.1)) for f in futures]

  def close(self) -> None:
    self._drivers.shutdown(wait=False, cancel_futures=True)
    self._calls.shutdown(wait=False, cancel_futures=True)
