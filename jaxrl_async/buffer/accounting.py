"""Sample accounting and queue latency (nothing disappears uncounted).

Every sample that entered `put` is, at every moment, in exactly one of: consumed, dropped under
one reason of `jaxrl_async.types.DROP_REASONS`, or queued. `problems()` checks

    put == consumed + sum(dropped) + queued.

Latency is enqueue -> consume per sample, in seconds of the buffer's clock. The mean covers the
whole run; p50 / p99 cover the most recent `LATENCY_WINDOW` samples (a bounded window keeps
memory and checkpoints small and follows the current regime of the run).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from jaxrl_async.types import DROP_REASONS

LATENCY_WINDOW = 4096
# What holds a take (`get_groups`) that waits: fewer whole groups ready than it asks for
# ('groups'), or enough of them while version_gap_policy 'wait' holds the version's last take
# for a group about to pass the age bound ('age_bound').
TAKE_WAIT_REASONS = ("groups", "age_bound")


def check_drop_reason(reason: str) -> str:
  if reason not in DROP_REASONS:
    raise ValueError(f"reason={reason!r} is not a drop reason; allowed: {list(DROP_REASONS)}")
  return reason


class SampleAccounting:
  """Counters of samples and groups; not thread-safe (the buffer's lock guards it)."""

  __slots__ = (
    "admission_wait_s",
    "consumed",
    "consumed_groups",
    "dropped",
    "dropped_groups",
    "put",
    "queued",
    "take_wait_s",
    "unadmitted_groups",
  )

  def __init__(self):
    self.put = 0
    self.consumed = 0
    self.queued = 0
    self.dropped = dict.fromkeys(DROP_REASONS, 0)
    self.consumed_groups = 0
    self.dropped_groups = dict.fromkeys(DROP_REASONS, 0)
    self.unadmitted_groups = 0  # groups put without acquire_group_slot
    self.admission_wait_s = 0.0
    # Seconds takes spent waiting, by what held them (TAKE_WAIT_REASONS).
    self.take_wait_s = dict.fromkeys(TAKE_WAIT_REASONS, 0.0)

  def record_put(self) -> None:
    self.put += 1
    self.queued += 1

  def record_drop(self, reason: str, num_samples: int, num_groups: int) -> None:
    self.dropped[reason] += num_samples
    self.dropped_groups[reason] += num_groups
    self.queued -= num_samples

  def record_consumed(self, num_samples: int, num_groups: int) -> None:
    self.consumed += num_samples
    self.consumed_groups += num_groups
    self.queued -= num_samples

  def problems(self, held_samples: int) -> list[str]:
    found = []
    dropped = sum(self.dropped.values())
    if self.put != self.consumed + dropped + self.queued:
      found.append(f"put={self.put} != consumed={self.consumed} + dropped={dropped} "
                   f"({self.dropped}) + queued={self.queued}")
    if self.queued != held_samples:
      found.append(f"queued={self.queued} != samples held in groups={held_samples}")
    return found

  def counts(self) -> dict[str, Any]:
    return {
        "put": self.put,
        "consumed": self.consumed,
        "queued": self.queued,
        "dropped": dict(self.dropped),
        "consumed_groups": self.consumed_groups,
        "dropped_groups": dict(self.dropped_groups),
        "unadmitted_groups": self.unadmitted_groups,
    }

  def to_state(self) -> dict[str, Any]:
    state = self.counts()
    state["admission_wait_s"] = float(self.admission_wait_s)
    state["take_wait_s"] = dict(self.take_wait_s)
    return state

  def load_state(self, state: dict[str, Any]) -> None:
    for name in ("put", "consumed", "queued", "consumed_groups", "unadmitted_groups"):
      setattr(self, name, int(state[name]))
    self.dropped = {reason: int(state["dropped"][reason]) for reason in DROP_REASONS}
    self.dropped_groups = {reason: int(state["dropped_groups"][reason])
                           for reason in DROP_REASONS}
    self.admission_wait_s = float(state["admission_wait_s"])
    # Absent from the states of runs saved before takes' waits were counted: those start at 0.
    waited = state.get("take_wait_s", {})
    self.take_wait_s = {reason: float(waited.get(reason, 0.0)) for reason in TAKE_WAIT_REASONS}


class LatencyStats:
  """Enqueue -> consume latency: running sum and count, and a window of recent values."""

  __slots__ = ("count", "recent", "total_s")

  def __init__(self):
    self.total_s = 0.0
    self.count = 0
    self.recent: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)

  def extend(self, latencies_s: list[float]) -> None:
    self.total_s += math.fsum(latencies_s)
    self.count += len(latencies_s)
    self.recent.extend(latencies_s)

  def snapshot(self) -> tuple[float, int, list[float]]:
    return self.total_s, self.count, list(self.recent)

  @staticmethod
  def summarise(total_s: float, count: int, recent: Iterable[float]) -> dict[str, float]:
    """p50, p99 (recent window) and mean (whole run); NaN before the first consumed sample."""
    window = np.fromiter(recent, np.float64)
    if count == 0 or window.size == 0:
      return {"p50": math.nan, "p99": math.nan, "mean": math.nan}
    p50, p99 = np.percentile(window, [50.0, 99.0])
    return {"p50": float(p50), "p99": float(p99), "mean": total_s / count}

  def to_state(self) -> dict[str, Any]:
    return {"total_s": float(self.total_s), "count": int(self.count),
            "recent": [float(x) for x in self.recent]}

  def load_state(self, state: dict[str, Any]) -> None:
    self.total_s = float(state["total_s"])
    self.count = int(state["count"])
    self.recent = collections.deque((float(x) for x in state["recent"]), maxlen=LATENCY_WINDOW)


def _quantile(counts: dict[int, int], q: float) -> float:
  """The q-quantile of a distribution given as value -> count, as numpy's method 'lower' (a
  value that occurred); NaN when empty."""
  total = sum(counts.values())
  if total == 0:
    return math.nan
  rank, seen = q * (total - 1), 0
  for value in sorted(counts):
    seen += counts[value]
    if seen > rank:
      return float(value)
  return float(max(counts))


def _mean(counts: dict[int, int]) -> float:
  total = sum(counts.values())
  return sum(v * n for v, n in counts.items()) / total if total else math.nan


def length_bucket(length: int) -> int:
  """The upper end of a response length's bucket: 1, 3, 7, 15, ... (powers of two, minus 1)."""
  return (1 << max(int(length), 0).bit_length()) - 1


class LengthStats:
  """Response lengths (tokens) of the samples put, consumed and dropped, as exact counts per
  length: whether what the learner trains on is what the rollout generated. A bound enforced
  by dropping can starve the long (often harder) samples; these figures show it."""

  __slots__ = ("consumed", "dropped", "put")
  KINDS = ("put", "consumed", "dropped")

  def __init__(self):
    self.put: collections.Counter[int] = collections.Counter()
    self.consumed: collections.Counter[int] = collections.Counter()
    self.dropped: collections.Counter[int] = collections.Counter()

  def add(self, kind: str, samples) -> None:
    counter = getattr(self, kind)
    for sample in samples:
      counter[int(sample.num_response_tokens)] += 1

  def snapshot(self) -> tuple[dict[int, int], ...]:
    return tuple(dict(getattr(self, kind)) for kind in self.KINDS)

  @staticmethod
  def summarise(put: dict[int, int], consumed: dict[int, int],
                dropped: dict[int, int]) -> dict[str, float]:
    """Mean and p90 of generated (put) and consumed lengths, their ratio of means, and the
    dropped samples per length bucket (`lengths/dropped_le_<n>`: lengths up to n)."""
    out = {"lengths/generated_mean": _mean(put), "lengths/generated_p90": _quantile(put, 0.9),
           "lengths/consumed_mean": _mean(consumed),
           "lengths/consumed_p90": _quantile(consumed, 0.9)}
    out["lengths/consumed_over_generated_mean"] = (
        out["lengths/consumed_mean"] / out["lengths/generated_mean"]
        if put and consumed and out["lengths/generated_mean"] > 0 else math.nan)
    buckets: collections.Counter[int] = collections.Counter()
    for length, count in dropped.items():
      buckets[length_bucket(length)] += count
    out.update({f"lengths/dropped_le_{hi}": float(n) for hi, n in sorted(buckets.items())})
    return out

  def to_state(self) -> dict[str, Any]:
    return {kind: {str(k): int(v) for k, v in getattr(self, kind).items()}
            for kind in self.KINDS}

  def load_state(self, state: dict[str, Any] | None) -> None:
    """`state` None: a checkpoint written before lengths were kept (they start empty)."""
    for kind in self.KINDS:
      setattr(self, kind, collections.Counter(
          {int(k): int(v) for k, v in ((state or {}).get(kind) or {}).items()}))


def stamp_consumed(groups, now: float) -> list[float]:
  """Stamps every sample of the taken `groups` 'consumed' at `now`; returns each one's time
  from 'enqueued' to 'consumed'."""
  latencies = []
  for group in groups:
    for sample in group.samples:
      stamps = sample.timestamps
      stamps["consumed"] = now
      latencies.append(now - stamps["enqueued"])
  return latencies
