"""What a report reads from run directories, and the figures' data as pure functions of it:
the window of versions the timeline shows, where each version's hand-off instants fall, the
version-gap shares, the idle ratios. `report.py` draws them."""

from __future__ import annotations

import dataclasses
import json
import os

from jaxrl_async.metrics import read_jsonl
from jaxrl_async.sinks import SPANS_FILE, read_spans

TABLE = (("mode", "mode"), ("eval/accuracy", "final accuracy"),
         ("system/samples_per_s", "samples/s"), ("system/wall_s", "wall-clock s"),
         ("consumed_samples", "samples"), ("policy_version", "versions"),
         ("stale_ratio", "stale ratio"), ("version_gap_max", "max version gap"))


@dataclasses.dataclass
class Run:
  """What the report needs from one run directory."""

  name: str
  path: str
  evals: list  # records with eval/accuracy
  versions: list  # records written after a policy version
  summary: dict
  spans: list
  label: str = ""  # in legends and under bars: the name, or its number when names are long

  @property
  def boundaries(self) -> dict[int, float]:
    """policy_version -> the run-clock second it was published (version 0 at 0)."""
    out = {0: 0.0}
    out.update({int(r["policy_version"]): float(r["time_s"]) for r in self.versions})
    return out

  def table_row(self) -> dict:
    row = {key: self.summary.get(key) for key, _ in TABLE}
    if row["eval/accuracy"] is None and self.evals:
      row["eval/accuracy"] = self.evals[-1]["eval/accuracy"]
    if self.versions:
      row["stale_ratio"] = mean([r.get("algo/stale_ratio") for r in self.versions])
      row["version_gap_max"] = max(r.get("algo/version_gap_max") or 0 for r in self.versions)
      for key in ("system/samples_per_s", "policy_version"):
        row[key] = row[key] if row[key] is not None else self.versions[-1].get(key)
    return row


def mean(values):
  values = [v for v in values if v is not None]
  return sum(values) / len(values) if values else None


def load_run(path: str, name: str | None = None) -> Run:
  metrics_path = os.path.join(path, "metrics.jsonl")
  if not os.path.isfile(metrics_path):
    raise FileNotFoundError(f"{path} is not a run directory: it has no metrics.jsonl")
  records = read_jsonl(metrics_path)
  summary = {}
  if os.path.isfile(os.path.join(path, "summary.json")):
    with open(os.path.join(path, "summary.json"), encoding="utf-8") as f:
      summary = json.load(f)
  spans_path = os.path.join(path, SPANS_FILE)
  name = name or os.path.basename(os.path.normpath(path))
  return Run(name=name, label=name, path=path,
             evals=[r for r in records if r.get("eval/accuracy") is not None],
             versions=[r for r in records if "algo/version_gap_max" in r], summary=summary,
             spans=read_spans(spans_path) if os.path.isfile(spans_path) else [])


def run_names(paths) -> list[str]:
  """Base names, or parent/base where base names repeat."""
  names = [os.path.basename(os.path.normpath(p)) for p in paths]
  if len(set(names)) < len(names):
    names = [os.path.join(*os.path.normpath(p).split(os.sep)[-2:]) for p in paths]
  return names


def timeline_window(run: Run, width: int) -> tuple[int, int] | None:
  """`width` versions in the middle of the part of the run that has recorded spans."""
  if not run.spans:
    return None
  first, last = min(s[1] for s in run.spans), max(s[2] for s in run.spans)
  covered = [v for v, t in sorted(run.boundaries.items()) if first - 1e-6 <= t <= last + 1e-6]
  if len(covered) < 2:
    return None
  middle = len(covered) // 2
  start = max(0, min(middle - width // 2, len(covered) - 1 - width))
  return covered[start], covered[min(start + width, len(covered) - 1)]


HANDOFF_MARKS = (("publish_to_work_s", "first work", "v"),
                 ("publish_to_enqueue_s", "first in buffer", "o"),
                 ("publish_to_take_s", "first taken", "s"))


def handoff_marks(run: Run, window: tuple[int, int]) -> dict[str, list[float]]:
  """For each hand-off instant, its run-clock times for the versions in `window`: when the
  version's publish began (the start of the last `sync` span at or before its boundary; the
  boundary itself without one) plus its interval. A record carries the intervals of the version
  before its own."""
  boundaries = run.boundaries
  publish_starts = sorted(start for role, start, _ in run.spans if role == "sync")
  marks: dict[str, list[float]] = {name: [] for name, _, _ in HANDOFF_MARKS}
  for record in run.versions:
    version = int(record["policy_version"]) - 1
    if not window[0] <= version <= window[1] or version not in boundaries:
      continue
    began = max((t for t in publish_starts if t <= boundaries[version] + 1e-9),
                default=boundaries[version])
    for name, _, _ in HANDOFF_MARKS:
      interval = record.get(f"handoff/{name}")
      if interval is not None:
        marks[name].append(began + float(interval))
  return marks


def gap_shares(run: Run) -> list[float]:
  totals: list[int] = []
  for record in run.versions:
    for gap, count in enumerate(record.get("algo/version_gap_counts") or []):
      totals.extend([0] * (gap + 1 - len(totals)))
      totals[gap] += count
  tokens = sum(totals)
  return [count / tokens for count in totals] if tokens else []


def idle_ratio(run: Run, role: str) -> float:
  source = run.summary if f"{role}/idle_ratio" in run.summary else (
      run.versions[-1] if run.versions else {})
  value = source.get(f"{role}/idle_ratio")
  return float("nan") if value is None else value


def has_staleness(run: Run) -> bool:
  return any(r.get("staleness/threshold") is not None for r in run.versions)
