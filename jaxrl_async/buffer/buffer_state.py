"""The VersionedBuffer's checkpoint state as plain JSON data, and its restoration.

Layout (format 1):
  config         the buffer's constructor knobs; a restore must match them
  rollout_version
  ledger         AdmissionLedger counts (admission.py), with `in_flight` = groups admitted whose
                 first sample was not put yet
  accounting     sample / group counters and admission wait (accounting.py)
  latency        running sum, count and the recent window
  partial        [{group_id, admitted, samples: [Sample dict, ...]}, ...] in arrival order of
                 the groups, members in index order
  ready          [{admitted, samples: [...]}, ...] in queue (FIFO) order

These functions run with the buffer's lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jaxrl_async.buffer import accounting
from jaxrl_async.buffer.groups import (
  PartialGroup,
  ReadyGroup,
  decode_sample,
  encode_sample,
  index_in_group,
  sample_drop_rank,
  sample_min_version,
)

if TYPE_CHECKING:
  from jaxrl_async.buffer.versioned_buffer import VersionedBuffer

STATE_FORMAT = 1


def capture(buffer: VersionedBuffer) -> dict[str, Any]:
  return {
      "format": STATE_FORMAT,
      "config": dict(buffer.config),
      "rollout_version": int(buffer._rollout_version),
      "ledger": buffer._ledger.to_state(),
      "accounting": buffer._acc.to_state(),
      "latency": buffer._latency.to_state(),
      "lengths": buffer._lengths.to_state(),
      "partial": [{"group_id": int(group.group_id), "admitted": bool(group.admitted),
                   "samples": [encode_sample(sample) for sample in group.members()]}
                  for group in buffer._partial.values()],
      "ready": [{"admitted": bool(group.admitted),
                 "samples": [encode_sample(sample) for sample in group.samples]}
                for group in buffer._ready],
  }


def restore(buffer: VersionedBuffer, state: dict[str, Any]) -> None:
  if state.get("format") != STATE_FORMAT:
    raise ValueError(f"set_state: state format={state.get('format')!r}, expected "
                     f"{STATE_FORMAT}")
  mismatched = {key: (value, state["config"].get(key))
                for key, value in buffer.config.items() if state["config"].get(key) != value}
  if mismatched:
    raise ValueError("set_state: the state was saved by a buffer with another config; "
                     + ", ".join(f"{key}: this buffer {mine!r}, state {theirs!r}"
                                 for key, (mine, theirs) in mismatched.items()))
  if buffer._acc.put or buffer._ledger.total_admitted:
    raise ValueError(f"set_state needs a fresh buffer; this one already had "
                     f"{buffer._acc.put} samples put and {buffer._ledger.total_admitted} "
                     "groups admitted")
  group_size = buffer._group_size
  partial = {}
  for record in state["partial"]:
    group = PartialGroup(int(record["group_id"]), group_size, bool(record["admitted"]))
    for data in record["samples"]:
      sample = decode_sample(data)
      group.add(index_in_group(sample, group_size), sample,
                sample_drop_rank(sample, buffer._drop_truncated), sample_min_version(sample))
    partial[group.group_id] = group
  ready = []
  for record in state["ready"]:
    samples = [decode_sample(data) for data in record["samples"]]
    min_versions = [v for v in map(sample_min_version, samples) if v is not None]
    ready.append(ReadyGroup(samples, bool(record["admitted"]),
                            min(min_versions) if min_versions else None))
  buffer._rollout_version = int(state["rollout_version"])
  buffer._ledger.load_state(state["ledger"])
  buffer._ledger.void_in_flight()  # (a fresh buffer's AgeBoundWait holds no admissions either)
  buffer._acc.load_state(state["accounting"])
  buffer._latency.load_state(state["latency"])
  buffer._lengths.load_state(state.get("lengths"))
  buffer._partial = partial
  buffer._ready = ready


def discard_queued(buffer: VersionedBuffer, reason: str) -> int:
  """Drops every queued sample (partial and ready groups) under `reason`; returns how many."""
  accounting.check_drop_reason(reason)
  discarded = buffer._acc.queued
  for group in list(buffer._partial.values()):
    buffer._drop_locked(group.members(), group.admitted, reason)
  for group in buffer._ready:
    buffer._drop_locked(group.samples, group.admitted, reason)
  buffer._partial.clear()
  buffer._ready.clear()
  return discarded
