"""What a `VersionedBuffer` reports of itself: its queue metrics, its invariants and a one-line
description for timeout errors. Functions of the buffer's fields, called with its lock held (as
`buffer_state.capture` is)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxrl_async.buffer.accounting import LatencyStats, LengthStats
from jaxrl_async.types import DROP_REASONS

if TYPE_CHECKING:
  from jaxrl_async.buffer.versioned_buffer import VersionedBuffer


def queue_metrics(buffer: VersionedBuffer) -> dict[str, float]:
  """The queue/ counters (the latency figures are added by the caller, outside the lock)."""
  acc = buffer._acc
  metrics = {
      "queue/depth": float(acc.queued),
      "queue/ready_groups": float(len(buffer._ready)),
      "queue/admission_wait_s": float(acc.admission_wait_s),
      "queue/put": float(acc.put),
      "queue/consumed": float(acc.consumed),
      "queue/outstanding_groups": float(buffer._ledger.outstanding),
      "queue/rollout_version": float(buffer._rollout_version),
  }
  for reason in DROP_REASONS:
    metrics[f"queue/dropped/{reason}"] = float(acc.dropped[reason])
  for reason, seconds in acc.take_wait_s.items():
    metrics[f"queue/take_wait_s/{reason}"] = float(seconds)
  return metrics


def counts(buffer: VersionedBuffer) -> dict:
  """The sample accounting's counts and the ledger's group counts."""
  found = buffer._acc.counts()
  found["outstanding_groups"] = buffer._ledger.outstanding
  found["in_flight_groups"] = buffer._ledger.in_flight
  found["admitted_groups"] = buffer._ledger.total_admitted
  return found


def with_distributions(metrics: dict[str, float], latency, lengths) -> dict[str, float]:
  """`metrics` with the latency and response-length figures of the buffer's snapshots
  (computed outside its lock)."""
  for name, value in LatencyStats.summarise(*latency).items():
    metrics[f"queue/latency_s_{name}"] = value
  metrics.update(LengthStats.summarise(*lengths))
  return metrics


def invariant_problems(buffer: VersionedBuffer) -> list[str]:
  """Each broken invariant of the accounting and the admission ledger, with its numbers."""
  held = sum(group.count for group in buffer._partial.values())
  held += sum(len(group.samples) for group in buffer._ready)
  problems = buffer._acc.problems(held)
  problems += buffer._ledger.problems(
      sum(group.admitted for group in buffer._partial.values()),
      sum(group.admitted for group in buffer._ready))
  if buffer._acc.queued > buffer._capacity:
    problems.append(f"queued={buffer._acc.queued} > capacity={buffer._capacity}")
  if any(group.count >= buffer._group_size for group in buffer._partial.values()):
    problems.append("a complete group is still in the partial set")
  return problems


def describe(buffer: VersionedBuffer) -> str:
  """The admission window and what is held, for a timeout's message."""
  ledger = buffer._ledger
  return (f"rollout_version={buffer._rollout_version}, window used {ledger.used}/"
          f"{ledger.budget} groups, outstanding_groups={ledger.outstanding} (in flight "
          f"{ledger.in_flight}, partial {len(buffer._partial)}, ready {len(buffer._ready)}), "
          f"queued {buffer._acc.queued}/{buffer._capacity} samples"
          + (" (version_gap_policy 'wait': a version's last take also waits for the groups "
             "that would pass the version-gap bound)" if buffer._age_wait else ""))
