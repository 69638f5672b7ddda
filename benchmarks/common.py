"""What every benchmark shares: one JSON line on stdout, optionally also written to a file;
the results of measurement children."""

import glob
import json
import os
import pickle

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def emit_json_line(record: dict, out: str | None = None) -> str:
  line = json.dumps(record)
  print(line)
  if out:
    with open(out, "w", encoding="utf-8") as f:
      f.write(line + "\n")
  return line


def emit_result(record: dict, out_stem: str | None = None) -> int:
  """Prints `record` as one JSON line and, with `out_stem`, writes it (indented) to
  <out_stem>.json; numpy scalars become floats. Returns 0, a benchmark's exit code."""
  if out_stem:
    os.makedirs(os.path.dirname(out_stem) or ".", exist_ok=True)
    with open(out_stem + ".json", "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1, default=float)
  print(json.dumps(record, default=float))
  return 0


def newest_result(pattern: str, want) -> tuple[dict | None, str]:
  """The newest line (by its timestamp, else the file name) of results/<pattern> for which
  `want(record)` holds."""
  best, name = None, f"no {pattern} result"
  for path in sorted(glob.glob(os.path.join(RESULTS, pattern))):
    with open(path, encoding="utf-8") as f:
      for line in f:
        record = json.loads(line) if line.strip() else None
        if record and want(record) and (best is None or record.get("timestamp", "")
                                        >= best.get("timestamp", "")):
          best, name = record, os.path.basename(path)
  return best, name


def median_run(run_dirs_: list[str]) -> str:
  """Of the run directories, the one of median samples/s (the lower middle of an even count)."""
  speeds = []
  for run_dir in run_dirs_:
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
      speeds.append((json.load(f)["system/samples_per_s"], run_dir))
  return sorted(speeds)[(len(speeds) - 1) // 2][1]


def collect_children(processes, paths, timeout_s: float, what: str) -> list:
  """Waits for each child (at most `timeout_s` each) and reaps it, then loads the result each
  pickled to its path; RuntimeError naming the first child that failed."""
  from jaxrl_async.backends.processes import child
  failed = None
  for process in processes:
    process.join(timeout_s)
    code = child.reap(process)
    if code != 0 and failed is None:
      failed = f"{process.name}, {what}, failed (exit code {code})"
  if failed is not None:
    raise RuntimeError(failed)
  results = []
  for path in paths:
    with open(path, "rb") as f:
      results.append(pickle.load(f))
  return results
