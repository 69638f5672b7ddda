"""The sample ledger: where every generated sample went, across all the lives of a run.

`<run_dir>/ledger.jsonl` is an append-only log with one event per line:

    {"event": "consumed", "policy_version": v, "groups": [group_id, ...], "prompts": [...]}
        whole groups trained on in the update(s) that made version v, with their prompt ids
    {"event": "dropped", "reason": r, "samples": [[group_id, index_in_group], ...]}
        samples that will never reach the learner, under one of types.DROP_REASONS

A checkpoint records the log's length (`offset()`); a resumed run first cuts the log back to
that length (`truncate`), so events written after the checkpoint, which the resumed run will
produce again, are never counted twice. `audit` then checks the whole run: every sample of every
group the prompt pipeline produced (group ids 0 .. next_group_id - 1, `group_size` members each)
was consumed exactly once or dropped exactly once, never both.
"""

from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Iterable

from jaxrl_async.sinks import SPANS_FILE, read_spans, write_spans

LEDGER_FILE = "ledger.jsonl"


class SampleLedger:
  """Appends ledger events; thread-safe; every write is flushed to the OS."""

  def __init__(self, path: str | os.PathLike):
    self.path = os.fspath(path)
    os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
    self._file = open(self.path, "ab")  # noqa: SIM115 (closed by close())
    self._lock = threading.Lock()

  def consumed(self, policy_version: int, groups: Iterable[list]) -> None:
    """`groups`: the trained groups (lists of Samples)."""
    groups = list(groups)
    self._write({"event": "consumed", "policy_version": int(policy_version),
                 "groups": [int(g[0].group_id) for g in groups],
                 "prompts": [int(g[0].prompt_id) for g in groups]})

  def dropped(self, reason: str, samples: Iterable[tuple[int, int]]) -> None:
    samples = [[int(g), int(i)] for g, i in samples]
    if samples:
      self._write({"event": "dropped", "reason": reason, "samples": samples})

  def dropped_log(self, log: Iterable[tuple[str, list]]) -> None:
    for reason, samples in log:
      self.dropped(reason, samples)

  def _write(self, event: dict) -> None:
    line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
    with self._lock:
      self._file.write(line)
      self._file.flush()

  def offset(self) -> int:
    """The log's length in bytes: what a checkpoint taken now has seen."""
    with self._lock:
      self._file.flush()
      return os.fstat(self._file.fileno()).st_size

  def close(self) -> None:
    with self._lock:
      self._file.close()


def truncate(path: str | os.PathLike, offset: int) -> None:
  """Cuts an append-only log back to `offset` bytes (a checkpoint's view of it).

  A log shorter than the offset means it was lost or replaced after the checkpoint: that is an
  error, since the run's history could no longer be checked.
  """
  path = os.fspath(path)
  size = os.path.getsize(path) if os.path.exists(path) else 0
  if size < offset:
    raise ValueError(f"{path} holds {size} bytes, less than the {offset} bytes the checkpoint "
                     "recorded: the log was truncated or replaced after the checkpoint")
  if size > offset:
    with open(path, "r+b") as f:
      f.truncate(offset)


def read_events(path: str | os.PathLike) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def audit(events: Iterable[dict], *, group_size: int, next_group_id: int | None = None,
          groups: Iterable[int] | None = None) -> dict:
  """Where each produced sample went. The produced groups are ids 0 .. next_group_id - 1 (one
  prompt pipeline), or `groups` (several servers, each numbering its own, over every fleet
  shape of the run: `backends.fleet_shape.group_ids`). Returns counts and
  the problems found:

  - `missing`: produced samples neither consumed nor dropped (lost);
  - `duplicates`: samples consumed or dropped more than once, or both;
  - `unknown`: samples in the log that were never produced.
  """
  if (next_group_id is None) == (groups is None):
    raise ValueError("audit needs exactly one of next_group_id and groups")
  produced_groups = set(range(next_group_id) if groups is None else groups)
  seen: collections.Counter = collections.Counter()
  consumed_samples = 0
  dropped: collections.Counter = collections.Counter()
  for event in events:
    if event["event"] == "consumed":
      for group_id in event["groups"]:
        for index in range(group_size):
          seen[(group_id, index)] += 1
        consumed_samples += group_size
    elif event["event"] == "dropped":
      for group_id, index in event["samples"]:
        seen[(group_id, index)] += 1
      dropped[event["reason"]] += len(event["samples"])
    else:
      raise ValueError(f"unknown ledger event {event['event']!r}")
  produced = len(produced_groups) * group_size
  missing = [(g, i) for g in sorted(produced_groups) for i in range(group_size)
             if (g, i) not in seen]
  duplicates = sorted(uid for uid, count in seen.items() if count > 1)
  unknown = sorted(uid for uid in seen if not (uid[0] in produced_groups
                                               and 0 <= uid[1] < group_size))
  return {"produced": produced, "consumed": consumed_samples, "dropped": dict(dropped),
          "missing": missing, "duplicates": duplicates, "unknown": unknown}


def audit_metrics(result: dict) -> dict[str, int]:
  """The audit as summary figures (`ledger/...`)."""
  figures = {"ledger/produced": result["produced"], "ledger/consumed": result["consumed"],
             "ledger/missing": len(result["missing"]),
             "ledger/duplicates": len(result["duplicates"]),
             "ledger/unknown": len(result["unknown"])}
  figures.update({f"ledger/dropped/{r}": n for r, n in sorted(result["dropped"].items())})
  return figures


# ---- the run's logs at a checkpoint ----------------------------------------------------------
METRICS_FILE = "metrics.jsonl"


def log_offsets(run_dir: str | os.PathLike, ledger: SampleLedger) -> dict[str, int]:
  """What a checkpoint records of the run's append-only logs (both flushed on every write)."""
  metrics = os.path.join(os.fspath(run_dir), METRICS_FILE)
  return {"metrics_offset": os.path.getsize(metrics) if os.path.exists(metrics) else 0,
          "ledger_offset": ledger.offset()}


def rewind_logs(run_dir: str | os.PathLike, run_state: dict | None) -> None:
  """Before a run writes anything: cut both logs back to the checkpoint's view, so the versions
  and events it makes again replace the ones written after the checkpoint. A run that starts
  from scratch (`run_state` None: no checkpoint yet, e.g. a crash before the first one) starts
  them empty."""
  if run_state is None:
    run_state = {"metrics_offset": 0, "ledger_offset": 0, "wall_s": 0.0}
  run_dir = os.fspath(run_dir)
  for name, key in ((METRICS_FILE, "metrics_offset"), (LEDGER_FILE, "ledger_offset")):
    path = os.path.join(run_dir, name)
    if key in run_state and (run_state[key] or os.path.exists(path)):
      truncate(path, int(run_state[key]))
  if "wall_s" in run_state:
    cut_spans(os.path.join(run_dir, SPANS_FILE), float(run_state["wall_s"]))


def cut_spans(path: str, wall_s: float) -> None:
  """The stage timeline back to the checkpoint: the spans that ended by `wall_s` of the run's
  clock are kept (the resumed run's clock continues from there)."""
  if not os.path.exists(path):
    return
  write_spans(path, [span for span in read_spans(path) if span[2] <= wall_s])
