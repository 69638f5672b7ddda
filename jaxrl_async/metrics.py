"""The one metric vocabulary, role timers and sinks.

Names (docs/metrics.md): system/samples_per_s, system/tokens_per_s, system/steps_per_hour,
<role>/busy_s, <role>/idle_ratio (over the whole run); queue/...; sync/latency_s, sync/bytes,
sync/interval_steps; algo/version_gap_mean|max, algo/stale_ratio, algo/partial_ratio,
algo/max_partial_span, algo/kl, algo/behaviour_kl, algo/clipfrac, algo/entropy, algo/is_weight_mean|max,
algo/masked_fraction, algo/old_logprob_source; result/reward_mean, result/accuracy.
`learner_step` (updates) and `policy_version` (syncs) are separate axes on every record.

Token-level values travel as (sum, count) pairs and are divided only here, when logged.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import itertools
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping

import numpy as np

ROLES = ("rollout", "reward", "learner", "sync")
MAX_SPANS = 20_000  # busy spans kept (the latest), so long runs stay small


class RoleTimer:
  """Busy time per role over the whole run; idle ratio = 1 - busy / wall-clock since start.

  Intervals of one role may come from several threads (a reward worker pool); they are merged
  per role so that overlapping intervals count once. The merged intervals are also kept as
  (role, start, end) spans on the run's clock (seconds of `wall_s`, excluded time removed), the
  latest `max_spans` of them, for the report's stage timeline.
  """

  def __init__(self, roles: Iterable[str] = ROLES, clock=time.perf_counter,
               max_spans: int = MAX_SPANS):
    self._clock = clock
    self._lock = threading.Lock()
    self._busy = dict.fromkeys(roles, 0.0)
    self._open: dict[str, list[float]] = {role: [] for role in roles}
    self._active_since: dict[str, float] = {}
    self._span_begin: dict[str, float] = {}
    self._spans: collections.deque = collections.deque(maxlen=max_spans)
    self._closed = 0  # spans closed so far (the deque keeps the latest)
    self._excluded = 0.0
    # (begin, end, seconds excluded before begin) of each excluded interval, in clock order
    self._exclusions: list[tuple[float, float, float]] = []
    self.start = clock()

  @contextlib.contextmanager
  def busy(self, role: str):
    self._enter(role)
    try:
      yield
    finally:
      self._exit(role)

  def _enter(self, role: str) -> None:
    with self._lock:
      if role not in self._busy:
        raise KeyError(f"unknown role {role!r}; roles are {sorted(self._busy)}")
      if not self._open[role]:
        now = self._clock()
        self._active_since[role] = now
        self._span_begin[role] = now - self.start - self._excluded
      self._open[role].append(1)

  def _exit(self, role: str) -> None:
    with self._lock:
      self._open[role].pop()
      if not self._open[role]:
        now = self._clock()
        self._busy[role] += now - self._active_since.pop(role)
        self._spans.append((role, self._span_begin.pop(role), now - self.start - self._excluded))
        self._closed += 1

  def spans(self) -> list[tuple[str, float, float]]:
    """The latest closed busy spans, (role, start_s, end_s) on the `wall_s` clock, oldest first."""
    with self._lock:
      return list(self._spans)

  def spans_since(self, closed: int) -> tuple[int, list[tuple[str, float, float]]]:
    """(spans closed so far, the ones closed after the first `closed` of them that are still
    kept) with their times on the clock itself (`clock()` values), for another process's
    timer to merge with `add_spans`. Needs a timer that excludes nothing (a rollout server's)."""
    with self._lock:
      if self._exclusions:
        raise RuntimeError("spans_since needs a timer without excluded time")
      new = max(0, min(self._closed - closed, len(self._spans)))
      spans = list(itertools.islice(reversed(self._spans), new))[::-1]
      return self._closed, [(role, self.start + a, self.start + b) for role, a, b in spans]

  def add_spans(self, spans) -> None:
    """Spans recorded elsewhere (`spans_since` of a rollout server on this host: the same
    monotonic clock), as (role, start, end) `clock()` values, put on this timer's `wall_s`
    clock (excluded time removed). Only the span record: busy totals are not changed."""
    with self._lock:
      for role, begin, end in spans:
        if role not in self._busy:
          raise KeyError(f"unknown role {role!r}; roles are {sorted(self._busy)}")
        self._spans.append((role, self._on_wall(begin), self._on_wall(end)))
        self._closed += 1

  def _on_wall(self, t: float) -> float:
    """A `clock()` value as seconds of `wall_s` (a time inside an excluded interval maps to
    the interval's start). Lock held."""
    i = bisect.bisect_left(self._exclusions, t, key=lambda e: e[0]) - 1  # last begun before t
    if i < 0:
      return t - self.start
    begin, end, before = self._exclusions[i]
    return t - self.start - before - (min(end, t) - begin)

  @contextlib.contextmanager
  def excluded(self):
    """Time spent here (evaluation, checkpoints) is removed from the run's wall-clock."""
    begin = self._clock()
    try:
      yield
    finally:
      with self._lock:
        end = self._clock()
        while self._exclusions and self._exclusions[-1][0] >= begin:  # nested in this one
          self._exclusions.pop()
        self._exclusions.append((begin, end, self._excluded))
        self._excluded += end - begin

  def wall_s(self) -> float:
    return self._clock() - self.start - self._excluded

  def busy_s(self, role: str) -> float:
    with self._lock:
      extra = self._clock() - self._active_since[role] if role in self._active_since else 0.0
      return self._busy[role] + extra

  def summary(self) -> dict[str, float]:
    wall = max(self.wall_s(), 1e-9)
    out = {"system/wall_s": wall}
    for role in self._busy:
      busy = self.busy_s(role)
      out[f"{role}/busy_s"] = busy
      out[f"{role}/idle_ratio"] = max(0.0, 1.0 - busy / wall)
    return out


def reduce_metrics(metrics: Mapping, prefix: str = "") -> dict[str, float]:
  """(sum, count) pairs -> sum / count; arrays -> float; everything under `prefix`."""
  out = {}
  for name, value in metrics.items():
    if isinstance(value, tuple) and len(value) == 2:
      total, count = float(np.asarray(value[0])), float(np.asarray(value[1]))
      out[prefix + name] = total / count if count > 0 else float("nan")
    elif isinstance(value, str):
      out[prefix + name] = value
    else:
      out[prefix + name] = float(np.asarray(value))
  return out


def sum_pairs(accumulated: dict, metrics: Mapping) -> dict:
  """Accumulate (sum, count) pairs across mini-batches; other values keep the latest."""
  for name, value in metrics.items():
    if isinstance(value, tuple) and name in accumulated:
      accumulated[name] = (accumulated[name][0] + value[0], accumulated[name][1] + value[1])
    else:
      accumulated[name] = value
  return accumulated


def group_lengths(groups) -> dict[str, list[list[int]]]:
  """`lengths/groups`: each consumed group's response lengths (the simulator's fit draws whole
  groups of them: members of one prompt finish together or not)."""
  return {"lengths/groups": [[int(s.num_response_tokens) for s in g] for g in groups]}


def staleness_metrics(groups, learner_version: int) -> dict[str, float]:
  """algo/version_gap_*, stale_ratio, partial_ratio, max_partial_span, version_gap_counts for
  consumed groups."""
  return staleness_and_gaps(groups, learner_version)[0]


def staleness_and_gaps(groups, learner_version: int) -> tuple[dict[str, float], np.ndarray]:
  """`staleness_metrics` and every consumed token's version gap (concatenated). A few array
  operations over the joined tokens, not a few per sample: this runs on the learner's path."""
  token_versions = [sample.token_versions for group in groups for sample in group]
  gaps = _version_gaps(token_versions, learner_version)
  lengths = np.fromiter(map(len, token_versions), np.int64, len(token_versions))
  filled = lengths[lengths > 0]
  if filled.size:  # a sample's span is max - min of its tokens' gaps, as of their versions
    starts = np.cumsum(filled) - filled
    spans = np.maximum.reduceat(gaps, starts) - np.minimum.reduceat(gaps, starts)
  else:
    spans = np.zeros((0,), np.int64)
  counts = np.bincount(np.maximum(gaps, 0).astype(np.int64)) if gaps.size else []
  return {
      "algo/version_gap_mean": float(gaps.mean()) if gaps.size else 0.0,
      "algo/version_gap_max": float(gaps.max()) if gaps.size else 0.0,
      "algo/stale_ratio": float(np.mean(gaps >= 1)) if gaps.size else 0.0,
      "algo/partial_ratio": int(np.count_nonzero(spans)) / max(len(token_versions), 1),
      "algo/max_partial_span": float(spans.max()) if spans.size else 0.0,
      # Consumed tokens per version gap (index = gap): the version-gap histogram.
      "algo/version_gap_counts": [int(c) for c in counts],
  }, gaps


def _version_gaps(token_versions: list, learner_version: int) -> np.ndarray:
  """learner_version - token version of every token, concatenated: one subtraction over the
  joined arrays when they share a dtype (the same values as one per array)."""
  if not token_versions:
    return np.zeros((0,), np.int32)
  dtype = token_versions[0].dtype
  if all(versions.dtype == dtype for versions in token_versions):
    return learner_version - np.concatenate(token_versions)
  return np.concatenate([learner_version - versions for versions in token_versions])


class JsonlWriter:
  """Appends one JSON object per line; NaN / inf are written as null."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
    self._lock = threading.Lock()

  def write(self, record: Mapping) -> None:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in record.items()}
    with self._lock:
      self._file.write(json.dumps(clean, sort_keys=True) + "\n")
      self._file.flush()

  def close(self) -> None:
    with self._lock:
      self._file.close()


def read_jsonl(path: str | os.PathLike) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
