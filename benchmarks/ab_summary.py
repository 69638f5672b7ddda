"""One JSON line per run of a `benchmarks/ab_checkouts.sh` directory, then the per-side medians.

  python benchmarks/ab_summary.py OUTDIR --old_commit C1 --new_commit C2 [--out FILE.jsonl]

Reads OUTDIR/D-<side>-r<round>.json (`benchmarks/modes.py` results) and OUTDIR/log (each
round's start time and load average). Each run line has its side, commit, round, start, load
at the start and the end, and the run's samples/s, accuracy, idle ratios, hand-off latencies
and consumed/generated length; the last two lines are each side's medians.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics

KEYS = ("samples_per_s", "wall_s", "final_accuracy", "learner_idle_ratio", "rollout_idle_ratio",
        "handoff_publish_to_work_s_p50", "handoff_publish_to_work_s_p99",
        "consumed_over_generated_mean")


def median(values):
  """The median of the values that are not None (None if all are: e.g. sync's hand-off)."""
  values = [v for v in values if v is not None]
  return statistics.median(values) if values else None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("outdir")
  parser.add_argument("--old_commit", required=True)
  parser.add_argument("--new_commit", required=True)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  starts = {}
  with open(os.path.join(args.outdir, "log"), encoding="utf-8") as f:
    for line in f:
      found = re.match(r"(old|new) r(\d+) start (\S+) (\S+)", line)
      if found:
        starts[(found[1], int(found[2]))] = (found[3], float(found[4]))
  lines, by_side = [], {"old": [], "new": []}
  for path in sorted(glob.glob(os.path.join(args.outdir, "D-*-r*.json"))):
    side, round_ = re.search(r"D-(old|new)-r(\d+)\.json$", path).groups()
    with open(path, encoding="utf-8") as f:
      result = json.load(f)
    started, load = starts.get((side, int(round_)), (None, None))
    for mode, figures in result["modes"].items():
      line = {"side": side, "commit": getattr(args, f"{side}_commit"), "round": int(round_),
              "mode": mode, "started": started, "load_average_1min_at_start": load,
              "load_average_end": result["load_average"]["end"][0],
              **{key: figures.get(key) for key in KEYS}}
      lines.append(line)
      by_side[side].append(line)
  for side, runs in by_side.items():
    if runs:
      lines.append({"side": side, "median_of_rounds": len(runs),
                    **{key: median([r[key] for r in runs]) for key in KEYS}})
  text = "".join(json.dumps(line) + "\n" for line in lines)
  print(text, end="")
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text)


if __name__ == "__main__":
  main()
