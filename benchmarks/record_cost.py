"""What recording the schedule costs an async run (`RunConfig.record_schedule`, docs/replay.md).

    python benchmarks/record_cost.py --repeats 3 --out benchmarks/results/record_cost.json

Runs the same async run (default gin/modes/async_partial.gin, the default settings) with
recording off and on, interleaved (off, on, off, on, ...) for `--repeats` rounds, and prints one
JSON line: per setting the median samples/s over the rounds (the run's own figure, evaluation
and checkpoint time excluded, and the whole run's wall-clock from start to summary), the cost
of recording as the ratio on/off (median of each round's ratio, with its spread), and the
record's size (bytes per sample, bytes per response token). `--warmup_samples` samples run
first (discarded) so the measured runs load compiled executables instead of compiling them.

Measure on a quiet machine, one benchmark at a time: single short runs vary by +-15% here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin
from benchmarks.common import emit_json_line
from jaxrl_async import compilation_cache
from jaxrl_async import config as config_lib
from jaxrl_async.run import api
from jaxrl_async.run.schedule_read import read_schedule
from launch import train

SETTINGS = ("off", "on")


def run_once(gin_file: str, bindings: list[str], record: bool, run_dir: str) -> dict:
  train.load_config([gin_file], [*bindings, f"RunConfig.record_schedule = {record}"])
  config = gin.get_configurable(config_lib.RunConfig)()
  gin.clear_config()
  began = time.perf_counter()
  summary = api.run(config, run_dir, progress=False, log=lambda *a: None)
  wall_s = time.perf_counter() - began
  row = {"samples_per_s": summary["system/samples_per_s"],
         "end_to_end_samples_per_s": summary["consumed_samples"] / wall_s,
         "consumed_samples": summary["consumed_samples"]}
  if record:
    intervals = read_schedule(run_dir)
    size = sum(i.bytes for i in intervals)
    tokens = sum(i.header["tokens"] for i in intervals)
    row.update(record_bytes=size, bytes_per_sample=size / summary["consumed_samples"],
               bytes_per_token=size / max(tokens, 1), record_files=len(intervals))
  return row


def summarize(rounds: list[dict]) -> dict:
  """Medians per setting and the on/off ratios (each round's, then their median and spread)."""
  out: dict = {"rounds": rounds}
  for setting in SETTINGS:
    rows = [r[setting] for r in rounds]
    out[setting] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
  for key in ("samples_per_s", "end_to_end_samples_per_s"):
    ratios = [r["on"][key] / r["off"][key] for r in rounds]
    out[f"{key}_ratio_on_off"] = statistics.median(ratios)
    out[f"{key}_ratio_min"], out[f"{key}_ratio_max"] = min(ratios), max(ratios)
  out["cost_fraction"] = 1.0 - out["samples_per_s_ratio_on_off"]
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", default="gin/modes/async_partial.gin")
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--warmup_samples", type=int, default=6400)
  parser.add_argument("--out", default=None, help="also write the JSON line here")
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  compilation_cache.enable()
  root = tempfile.mkdtemp(prefix="record_cost_")
  try:
    if args.warmup_samples:
      run_once(args.gin_file, [*args.gin_bindings,
                               f"RunConfig.total_samples = {args.warmup_samples}"],
               False, os.path.join(root, "warmup"))
    rounds = []
    for index in range(args.repeats):
      rounds.append({setting: run_once(args.gin_file, args.gin_bindings, setting == "on",
                                       os.path.join(root, f"{setting}-{index}"))
                     for setting in SETTINGS})
  finally:
    shutil.rmtree(root, ignore_errors=True)
  emit_json_line({"benchmark": "record_cost", "gin_file": args.gin_file,
                  "gin_bindings": args.gin_bindings, "repeats": args.repeats,
                  **summarize(rounds)}, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
