"""VersionedBuffer: the bounded, versioned queue of sample groups between Rollouter and Learner.

Producer (Rollouter):  slot_version = acquire_group_slot(timeout)   # admission, may block
                       put(sample, timeout) for each of the group's samples, good or failed
                       publish_version(v) when the rollout side holds weights v
Consumer (Learner):    get_groups(num_groups, learner_version, timeout) -> whole groups

Semantics: docs/architecture.md ("Admission", "Age bound, group assembly and drops", "The
buffer's mechanics"); admission.py keeps the ledger, groups.py the drop reasons. Thread-safe:
one lock, three conditions, timed waits; `group_filter` runs under the lock (never calls it).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_async import faults
from jaxrl_async.buffer import accounting, buffer_state, observe, staleness_budget
from jaxrl_async.buffer.admission import AdmissionLedger
from jaxrl_async.buffer.errors import (
  BufferClosed,
  BufferTimeout,
  check_buffer_config,
  check_timeout,
  check_version_gap_policy,
  is_int,
)
from jaxrl_async.buffer.groups import (
  GROUP_DROP_PRIORITY,
  NO_DROP,
  AgeBoundWait,
  GroupFilter,
  PartialGroup,
  ReadyGroup,
  index_in_group,
  sample_drop_rank,
  sample_min_version,
  split_stale,
  take_oldest,
)
from jaxrl_async.types import Sample

# After waking a consumer the producer yields its CPU slice, so the consumer takes the GIL now,
# not after the switch interval: about 5x less queue latency (benchmarks/buffer_throughput.py).
_yield_to_consumer = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))


class VersionedBuffer(staleness_budget.StalenessBudget):
  """Bounded, versioned queue of sample groups with admission control and an age bound."""

  def __init__(self, *, group_size: int, groups_per_version: int, staleness_threshold: float,
               max_version_gap: int | None, capacity: int,
               group_filter: GroupFilter | None = None, drop_truncated: bool = False,
               clock: Callable[[], float] = time.time, record_drops: bool = False,
               version_gap_policy: str = "drop"):
    budget = check_buffer_config(group_size, groups_per_version, staleness_threshold,
                                 max_version_gap, capacity)
    check_version_gap_policy(version_gap_policy, max_version_gap)
    self._age_wait = AgeBoundWait(max_version_gap, groups_per_version) if (
        version_gap_policy == "wait") else None  # not in `config`: no state depends on it
    group_size, capacity = int(group_size), int(capacity)
    max_version_gap = None if max_version_gap is None else int(max_version_gap)
    self.config = {"group_size": group_size, "groups_per_version": int(groups_per_version),
                   "staleness_threshold": float(staleness_threshold),
                   "max_version_gap": max_version_gap, "capacity": capacity,
                   "drop_truncated": bool(drop_truncated)}
    self._group_size = group_size
    self._max_version_gap = max_version_gap
    self._capacity = capacity
    self._group_filter = group_filter
    self._drop_truncated = bool(drop_truncated)
    self._clock = clock

    self._lock = threading.Lock()
    self._admission_cv = threading.Condition(self._lock)
    self._space_cv = threading.Condition(self._lock)
    self._ready_cv = threading.Condition(self._lock)
    self._waiting = {"admission": 0, "space": 0}
    self._consumers_wanting: list[int] = []  # num_groups of each waiting get_groups call

    self._closed, self._rollout_version = False, 0
    self._ledger = AdmissionLedger(budget)
    self._acc = accounting.SampleAccounting()
    self._latency = accounting.LatencyStats()
    self._lengths = accounting.LengthStats()
    self._partial: dict[int, PartialGroup] = {}
    self._ready: list[ReadyGroup] = []  # FIFO; popped from the front in batches
    self._drop_log: list | None = [] if record_drops else None  # (reason, uids): the ledger's

  # ---- producer side ------------------------------------------------------------------------
  def acquire_group_slot(self, timeout: float, group_id: int | None = None) -> int:
    """Admits one group; blocks while the window's budget is used up.

    Returns the rollout version of the window the group was admitted in: the Rollouter must
    generate it with weights of at least that version. `group_id`, when the caller knows which
    group it admits, lets version_gap_policy 'wait' follow that group exactly (`AgeBoundWait`).
    """
    deadline = check_timeout("acquire_group_slot", timeout)
    if group_id is not None and not is_int(group_id):
      raise ValueError(f"acquire_group_slot: group_id={group_id!r} must be an int or None")
    with self._lock:
      if not self._ledger.can_admit():
        started = time.monotonic()
        try:
          self._wait(self._admission_cv, "admission", self._ledger.can_admit, deadline,
                     "acquire_group_slot", timeout)
        finally:
          self._acc.admission_wait_s += time.monotonic() - started
      if self._closed:
        raise BufferClosed("acquire_group_slot: the buffer is closed")
      self._ledger.admit()
      if self._age_wait:
        self._age_wait.admitted(self._rollout_version, group_id)
      return self._rollout_version

  def put(self, sample: Sample, timeout: float) -> None:
    """Adds one sample (good or failed); blocks while the buffer holds `capacity` samples."""
    self.put_many((sample,), timeout)

  def put_many(self, samples: Sequence[Sample], timeout: float, *,
               one_deadline: bool = False) -> None:
    """`put` of each sample in order, under one acquisition of the lock.

    The same as `for s in samples: put(s, timeout)`: each sample may wait up to `timeout`
    for space, and the first one that raises (a bad field, a duplicate, a filter error, a
    timeout) leaves the samples before it put and the ones after it untouched. That error
    carries `num_put`, the number of samples that did go in. `one_deadline=True`: `timeout`
    bounds the waits of the whole call instead of each sample's.
    """
    deadline = check_timeout("put", timeout)
    group_size, drop_truncated = self._group_size, self._drop_truncated
    partial, acc, clock = self._partial, self._acc, self._clock
    handoff = False
    put = 0
    try:
      with self._lock:
        for sample in samples:
          if sample.group_size != group_size:
            raise ValueError(f"Sample.group_size={sample.group_size} of group {sample.group_id} "
                             f"must equal the buffer's group_size={group_size}")
          index = index_in_group(sample, group_size)
          drop_rank = sample_drop_rank(sample, drop_truncated)
          min_version = sample_min_version(sample)
          group_id = sample.group_id
          if self._closed or acc.queued >= self._capacity:
            self._wait(self._space_cv, "space", self._has_space,
                       deadline if one_deadline else time.monotonic() + timeout,
                       "put", timeout)
          group = partial.get(group_id)
          if group is not None and group.slots[index] is not None:
            raise ValueError(f"duplicate sample: group {group_id} already holds "
                             f"index_in_group={index}")
          arrived = (group.count if group is not None else 0) + 1
          rank = min(drop_rank, group.drop_rank) if group is not None else drop_rank
          members = None
          if arrived == group_size:
            members = list(group.slots) if group is not None else [None] * group_size
            members[index] = sample
            # The filter may raise: nothing has been changed yet, so this put did not happen.
            if (rank == NO_DROP and self._group_filter is not None
                and not self._group_filter(members)):
              rank = -1
          if group is None:
            admitted = self._ledger.start_group()
            if not admitted:
              acc.unadmitted_groups += 1
            elif self._age_wait:
              self._age_wait.started(group_id, min_version)
            group = PartialGroup(group_id, group_size, admitted)
            if members is None:
              partial[group_id] = group
          elif members is not None:
            del partial[group_id]
          sample.timestamps["enqueued"] = clock()
          group.add(index, sample, drop_rank, min_version)
          acc.record_put()
          self._lengths.put[int(sample.num_response_tokens)] += 1
          put += 1
          if members is not None:
            if rank == NO_DROP:
              self._ready.append(ReadyGroup(members, group.admitted, group.min_version))
              if self._consumers_wanting and len(self._ready) >= min(self._consumers_wanting):
                self._ready_cv.notify_all()
                handoff = True
            else:
              reason = "filtered_group" if rank < 0 else GROUP_DROP_PRIORITY[rank]
              self._drop_locked(members, group.admitted, reason)
    except Exception as error:
      error.num_put = put
      raise
    if handoff:
      _yield_to_consumer()

  def publish_version(self, version: int) -> None:
    """The rollout side now holds weights `version`: opens its admission window.

    The new window starts charged with every outstanding group. Publishing the current version
    again changes nothing; an older one is an error.
    """
    with self._lock:
      if self._closed:
        raise BufferClosed("publish_version: the buffer is closed")
      if not is_int(version) or version < self._rollout_version:
        raise ValueError(f"publish_version: version={version!r} must be an int >= the current "
                         f"rollout version {self._rollout_version}")
      if version == self._rollout_version:
        return
      self._rollout_version = int(version)
      self._ledger.open_window(self._rollout_version)
      if self._waiting["admission"]:
        self._admission_cv.notify_all()

  # ---- consumer side ------------------------------------------------------------------------
  def get_groups(self, num_groups: int, learner_version: int,
                 timeout: float) -> list[list[Sample]]:
    """Returns `num_groups` whole groups, oldest tokens first (`take_oldest`); blocks until ready.

    Groups too old for `learner_version` are dropped as `stale` meanwhile. On timeout nothing
    is taken from the queue. Returned samples are stamped 'consumed'.
    """
    deadline = check_timeout("get_groups", timeout)
    max_groups = self._capacity // self._group_size
    if not is_int(num_groups) or not 1 <= num_groups <= max_groups:
      raise ValueError(f"get_groups: num_groups={num_groups!r} must be an int in [1, "
                       f"capacity // group_size = {max_groups}]")
    if not is_int(learner_version):
      raise ValueError(f"get_groups: learner_version={learner_version!r} must be an int")
    with self._lock:
      self._consumers_wanting.append(num_groups)
      faulted = False
      try:
        while True:
          if self._closed:
            raise BufferClosed("get_groups: the buffer is closed")
          self._drop_stale_locked(learner_version)
          if len(self._ready) >= num_groups and not (self._age_wait and self._age_wait.holds(
              self._partial.values(), learner_version, num_groups)):
            if faulted or not faults.planned("buffer.get_groups"):
              break
            # The fault point is passed by calls that find their groups ready (so a hit
            # counts takes, not polls), outside the lock; readiness is checked again after it.
            faulted = True
            self._lock.release()
            try:
              faults.point("buffer.get_groups")
            finally:
              self._lock.acquire()
            continue
          now = time.monotonic()
          remaining = deadline - now
          if remaining <= 0:
            raise BufferTimeout(
                f"get_groups(num_groups={num_groups}) timed out after {timeout:.3g} s: "
                f"{observe.describe(self)}")
          reason = "groups" if len(self._ready) < num_groups else "age_bound"
          self._ready_cv.wait(remaining)
          self._acc.take_wait_s[reason] += time.monotonic() - now
      finally:
        self._consumers_wanting.remove(num_groups)
      groups, self._ready = take_oldest(self._ready, num_groups)
      if self._age_wait:
        self._age_wait.took(learner_version, num_groups)
      latencies = accounting.stamp_consumed(groups, self._clock())
      for group in groups:
        self._ledger.finish_group(group.admitted, dropped=False)
      self._acc.record_consumed(len(latencies), len(groups))
      self._lengths.add("consumed", [sample for group in groups for sample in group.samples])
      self._latency.extend(latencies)
      if self._waiting["space"]:
        self._space_cv.notify_all()
    return [group.samples for group in groups]

  # ---- lifecycle ----------------------------------------------------------------------------
  def close(self) -> None:
    """Wakes every blocked call with BufferClosed; queued samples stay (for a checkpoint)."""
    with self._lock:
      self._closed = True
      self._admission_cv.notify_all()
      self._space_cv.notify_all()
      self._ready_cv.notify_all()

  def discard_queued(self, reason: str = "shutdown") -> int:
    """Drops every queued sample (partial and ready groups) under `reason`; returns how many."""
    with self._lock:
      return buffer_state.discard_queued(self, reason)

  def take_drop_log(self) -> list[tuple[str, list[tuple[int, int]]]]:
    """The drops since the last call, as (reason, sample uids); needs `record_drops=True`."""
    if self._drop_log is None:
      raise RuntimeError("take_drop_log needs a buffer built with record_drops=True")
    with self._lock:
      log, self._drop_log = self._drop_log, []
    return log

  # ---- observability ------------------------------------------------------------------------
  @property
  def closed(self) -> bool:
    return self._closed

  @property
  def rollout_version(self) -> int:
    return self._rollout_version

  @property
  def budget(self) -> int:
    """Groups admitted per version window: floor((1 + s) * N)."""
    return self._ledger.budget

  @property
  def available_slots(self) -> int:
    """Admissions possible now without blocking."""
    with self._lock:
      return self._ledger.available

  @property
  def counts(self) -> dict[str, Any]:
    """put / consumed / queued / dropped-by-reason samples, and group counts."""
    with self._lock:
      return observe.counts(self)

  def metrics(self) -> dict[str, float]:
    """The queue metrics (docs/metrics.md) (latency NaN before the first consumed sample)."""
    with self._lock:
      metrics = observe.queue_metrics(self)
      latency, lengths = self._latency.snapshot(), self._lengths.snapshot()
    return observe.with_distributions(metrics, latency, lengths)

  def check_invariants(self) -> None:
    """Raises AssertionError, with the numbers, if the accounting or the ledger is broken."""
    with self._lock:
      problems = observe.invariant_problems(self)
    if problems:
      raise AssertionError("VersionedBuffer invariants violated: " + "; ".join(problems))

  # ---- checkpointing (buffer_state.py) ------------------------------------------------------
  def get_state(self) -> dict[str, Any]:
    """Plain JSON data: queued samples (partial and ready, in order), counters, the admission
    ledger (including groups admitted but not yet put), latency stats. See `set_state`."""
    with self._lock:
      return buffer_state.capture(self)

  def set_state(self, state: dict[str, Any]) -> None:
    """Continues the stream saved by `get_state`, on a fresh buffer of the same config.

    Groups that were admitted but had no sample put at save time (in flight) are voided: their
    slots are refunded, so they count as never started and the producer re-issues those
    prompts (acquiring again). Partially arrived groups stay partial, keep their admission and
    expect their remaining members. `group_filter` and `clock` are not state: pass the same
    ones to the new buffer.
    """
    with self._lock:
      buffer_state.restore(self, state)
      self._admission_cv.notify_all()
      self._space_cv.notify_all()
      self._ready_cv.notify_all()

  # ---- internals (lock held) ----------------------------------------------------------------
  def _has_space(self) -> bool:
    return self._acc.queued < self._capacity

  def _wait(self, condition: threading.Condition, waiting: str, ready: Callable[[], bool],
            deadline: float, call: str, timeout: float) -> None:
    while True:
      if self._closed:
        raise BufferClosed(f"{call}: the buffer is closed")
      if ready():
        return
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        raise BufferTimeout(f"{call} timed out after {timeout:.3g} s: {observe.describe(self)}")
      self._waiting[waiting] += 1
      try:
        condition.wait(remaining)
      finally:
        self._waiting[waiting] -= 1

  def _drop_locked(self, samples: list[Sample], admitted: bool, reason: str) -> None:
    self._acc.record_drop(reason, len(samples), 1)
    self._lengths.add("dropped", samples)
    if self._drop_log is not None:
      self._drop_log.append((reason, [sample.uid for sample in samples]))
    if self._ledger.finish_group(admitted, dropped=True) and self._waiting["admission"]:
      self._admission_cv.notify_all()
    if self._waiting["space"]:
      self._space_cv.notify_all()
    if self._consumers_wanting and self._age_wait:  # it may wait for this group
      self._ready_cv.notify_all()

  def _drop_stale_locked(self, learner_version: int) -> None:
    if self._max_version_gap is None:
      return
    self._ready, stale = split_stale(self._ready, learner_version, self._max_version_gap)
    for group in stale:
      self._drop_locked(group.samples, group.admitted, "stale")
