"""Reward functions (verifiers) and a fault-injecting wrapper to exercise failure accounting.

A reward function has the signature `reward(prompt_tokens, response_tokens, meta) -> float`:
pure Python on host data, safe to call from several threads at once.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

RewardFn = Callable[[np.ndarray, np.ndarray, dict[str, Any]], float]


def reverse_reward(response_tokens: Sequence[int] | np.ndarray, target_tokens: Sequence[int],
                   eos_id: int) -> float:
  """1.0 if the response is exactly `target_tokens` followed by <eos>, else 0.0.

  The response is read up to its first <eos>; tokens after that <eos> are ignored (an engine
  may leave a tail after the end token, and the policy is not trained on it). A response with no
  <eos> (cut at the length limit) scores 0 whatever its prefix; so does an empty response.
  """
  response = np.asarray(response_tokens).reshape(-1).tolist()
  try:
    end = response.index(eos_id)
  except ValueError:
    return 0.0
  return 1.0 if response[:end] == [int(t) for t in target_tokens] else 0.0


def accuracy(rewards: Iterable[float]) -> float:
  """Fraction of rewards equal to 1.0, i.e. the mean reward for a 0/1 verifier.

  A NaN (a reward that failed or timed out) counts as not correct, so a failing verifier lowers
  accuracy instead of vanishing from it. Empty input gives NaN.
  """
  values = [float(r) for r in rewards]
  if not values:
    return float("nan")
  return sum(1.0 for r in values if r == 1.0) / len(values)


def _unit_interval(*parts: Any) -> float:
  """A deterministic number in [0, 1) from the parts (independent of PYTHONHASHSEED)."""
  digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
  return int.from_bytes(digest, "little") / 2.0**64


class FlakyReward:
  """Wraps a reward function and injects failures, NaNs and slow answers, deterministically.

  Two ways of choosing the calls that misbehave:

  * by call index: calls are numbered 1, 2, 3, ... in the order they enter `__call__` (under a
    lock). Call k raises RuntimeError if `fail_every` divides k, returns NaN if `nan_every`
    divides k, and sleeps `delay_s` first if `slow_every` divides k. Which sample gets call k
    depends on thread timing, how many calls misbehave does not; a retry is a new call.
  * by sample: a sample's key is (seed, prompt token ids, meta['index_in_group'] or 0).
    With `fail_prob` p, the samples whose key hashes to u < p fail; with `slow_prob`, those
    whose key hashes (for the slow draw) below it are slow. A failing sample raises on its
    first `fail_attempts` calls and then answers normally, so a retry policy with at least
    `fail_attempts` retries recovers it; `fail_attempts=None` makes it fail on every call (a
    permanent failure). `sample_fails` / `sample_is_slow` predict the choice.

  A slow call waits `delay_s` (meant to exceed the caller's reward timeout) and then answers
  (or raises, when it also fails); `close()` ends every wait at once, for clean shutdown.
  Thread-safe: counters and per-sample attempt counts are kept under a lock.
  """

  def __init__(self, inner: RewardFn, *, fail_every: int | None = None,
               nan_every: int | None = None, slow_every: int | None = None,
               fail_prob: float = 0.0, slow_prob: float = 0.0, fail_attempts: int | None = None,
               delay_s: float = 1.0, seed: int = 0):
    for name, value in (("fail_every", fail_every), ("nan_every", nan_every),
                        ("slow_every", slow_every)):
      if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an int >= 1, got {value!r}")
    for name, value in (("fail_prob", fail_prob), ("slow_prob", slow_prob)):
      if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    if fail_attempts is not None and (not isinstance(fail_attempts, int) or fail_attempts < 1):
      raise ValueError(f"fail_attempts must be None or an int >= 1, got {fail_attempts!r}")
    if not delay_s >= 0.0:
      raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
    self.inner = inner
    self.fail_every, self.nan_every, self.slow_every = fail_every, nan_every, slow_every
    self.fail_prob, self.slow_prob = float(fail_prob), float(slow_prob)
    self.fail_attempts = fail_attempts
    self.delay_s = float(delay_s)
    self.seed = int(seed)
    self._lock = threading.Lock()
    self._closed = threading.Event()
    self._attempts: dict[tuple[Any, ...], int] = {}
    self.calls = 0
    self.failures = 0
    self.nans = 0
    self.slow_calls = 0

  # ---- the deterministic choice -------------------------------------------------------------
  def sample_key(self, prompt_tokens: np.ndarray, meta: dict[str, Any]) -> tuple[Any, ...]:
    return (self.seed, tuple(np.asarray(prompt_tokens).reshape(-1).tolist()),
            int(meta.get("index_in_group", 0)))

  def sample_fails(self, prompt_tokens: np.ndarray, meta: dict[str, Any]) -> bool:
    """Whether this sample is chosen to fail by `fail_prob` (on its first attempts)."""
    return _unit_interval("fail", self.sample_key(prompt_tokens, meta)) < self.fail_prob

  def sample_is_slow(self, prompt_tokens: np.ndarray, meta: dict[str, Any]) -> bool:
    return _unit_interval("slow", self.sample_key(prompt_tokens, meta)) < self.slow_prob

  # ---- the call -----------------------------------------------------------------------------
  def __call__(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray,
               meta: dict[str, Any]) -> float:
    key = self.sample_key(prompt_tokens, meta)
    chosen_to_fail = self.sample_fails(prompt_tokens, meta)
    with self._lock:
      self.calls += 1
      call_index = self.calls
      attempt = self._attempts.get(key, 0) + 1
      self._attempts[key] = attempt
      fail = bool(self.fail_every and call_index % self.fail_every == 0)
      if chosen_to_fail and (self.fail_attempts is None or attempt <= self.fail_attempts):
        fail = True
      slow = bool(self.slow_every and call_index % self.slow_every == 0)
      slow = slow or self.sample_is_slow(prompt_tokens, meta)
      nan = bool(self.nan_every and call_index % self.nan_every == 0) and not fail
      self.failures += fail
      self.nans += nan
      self.slow_calls += slow
    if slow:
      self._closed.wait(self.delay_s)
    if fail:
      raise RuntimeError(
          f"injected reward failure (call {call_index}, attempt {attempt} of this sample)")
    if nan:
      return math.nan
    return self.inner(prompt_tokens, response_tokens, meta)

  def close(self) -> None:
    """Ends all pending and future waits of slow calls."""
    self._closed.set()

  def __repr__(self) -> str:
    return (f"FlakyReward({self.inner!r}, fail_every={self.fail_every}, "
            f"nan_every={self.nan_every}, slow_every={self.slow_every}, "
            f"fail_prob={self.fail_prob}, slow_prob={self.slow_prob}, "
            f"fail_attempts={self.fail_attempts}, delay_s={self.delay_s}, seed={self.seed})")
