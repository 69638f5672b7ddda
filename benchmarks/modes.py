"""Sync and the four async modes, one after another, same task, seed and sample budget.

    python benchmarks/modes.py --total_samples 25600 --out benchmarks/results/modes

Prints one JSON line (per mode: final accuracy, samples/s, idle ratios, version gap, stale and
partial ratios, time to reach sync's final accuracy; and the ratios against sync) and writes
<out>.json, the run report of every mode in <out>-report/ (`jaxrl-async report`: index.html and
its figures) and <out>.png, the report's overview (accuracy against wall-clock for every mode;
samples/s and idle ratios).
Each mode runs from its gin file in gin/modes/, so the benchmark measures what users run.

Single runs of ~15 s vary by about +-15% here (run to run, same settings). `--repeats N` runs
N rounds, each round every mode once in turn (sync, async, sync, async, ...), and reports the
median of each figure over the rounds with the spread of samples/s and of its ratio to the
same round's sync run (`*_min`, `*_max`); every round's figures are kept in <out>.json.

`--ceiling_batches N` (default 100; 0 skips it) also measures, in the same invocation, what
running the two roles at once can gain on this machine with this workload
(`concurrency_ceiling.ceiling`: the default run's learner and rollout loops, alone and together,
laid out as `--backend` lays out a run) and gives each run's ratio to sync as a fraction of that
ceiling (`fraction_of_ceiling`).

`--task_file FILE` (repeatable) loads a task's gin file after each mode's or recipe's file, e.g.
`gin/tasks/rlvr.gin` for the RLVR workload (docs/workloads.md). With a task file the ceiling is
the workload's own bound instead (`workload_bound.bound`: rollout at full slots, reward at the
verifier's concurrency, learner on recorded batches, each alone, laid out as `--backend` lays
out a run; `--bound_run` names the run whose settings it measures, by default the first async
one): `ceiling.speedup` is sync's seconds per sample over the bound, and a run's
`fraction_of_ceiling` its samples/s times the bound. `--together_s S` (default 5; 0 skips it)
also measures every role at once, none waiting, in three windows of S seconds
(`workload_together`: what the roles make side by side on these cores, `ceiling.together`), and
gives each run's samples/s as a fraction of it (`fraction_of_together`): the share of the
roles' side-by-side rate that the run's schedule turned into samples.

`--async_run_on F` (default 1) lets every async run train F times `--total_samples`. A run r
times as fast as sync has trained r / 2 times sync's samples at half sync's wall-clock; with
F >= r / 2 its curve reaches that point, so whether it reaches sync's final accuracy within
half sync's wall-clock can be read from it, past sync's sample count. Its accuracy
and samples/s are still taken at `--total_samples` (from the curve's evaluation there), so the
comparison with sync stays at equal samples; `final_accuracy_at_end` is where it ended.

Compilation is kept out of the comparison: XLA's persistent compilation cache is on
(`jaxrl_async.compilation_cache`), and every mode first runs `--warmup_samples` samples
(discarded), so the measured runs load their executables instead of compiling them (each run
still traces and lowers its functions). `--warmup_samples 0` measures cold starts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin
from benchmarks import concurrency_ceiling, workload_bound, workload_together
from jaxrl_async import compilation_cache, report
from jaxrl_async import config as config_lib
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from launch import train

MODES = config_lib.MODES


def gin_file(name: str) -> str:
  """A mode's gin file (gin/modes/<mode>.gin), or a recipe's ('recipes/<name>')."""
  if name.startswith("recipes/"):
    return f"gin/{name}.gin"
  return f"gin/modes/{name}.gin"


def run_mode(mode: str, bindings: list[str], run_dir: str, backend: str = "threads",
             task_files=()) -> dict:
  """Runs one mode or recipe (then `task_files`, in order); the async ones on `backend`, sync
  always in one process (its fastest form: both cores, no process boundary). `api.run` starts
  a task's services (e.g. the RLVR workload's verifier) for the run."""
  if mode != "sync":
    bindings = [*bindings, f"RunConfig.backend = '{backend}'"]
  train.load_config([gin_file(mode), *task_files], bindings)
  config = gin.get_configurable(config_lib.RunConfig)()
  gin.clear_config()
  summary = api.run(config, run_dir, progress=False, log=lambda *a: None)
  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  curve = [(r["time_s"], r["samples"], r["eval/accuracy"]) for r in records
           if "eval/accuracy" in r]
  per_version = [r for r in records if "algo/version_gap_max" in r]
  return {
      "summary": summary, "curve": curve,
      "version_gap_max": max(r["algo/version_gap_max"] for r in per_version),
      "stale_ratio_mean": sum(r["algo/stale_ratio"] for r in per_version) / len(per_version),
      "partial_ratio_mean": sum(r["algo/partial_ratio"] for r in per_version) / len(per_version),
      "max_partial_span": max(r["algo/max_partial_span"] for r in per_version),
  }


def at_samples(curve, samples: int) -> tuple[float, float]:
  """(wall-clock s, held-out accuracy) of the curve's evaluation after `samples` samples."""
  for time_s, done, accuracy in curve:
    if done == samples:
      return time_s, accuracy
  raise ValueError(f"no evaluation after exactly {samples} samples (evaluations at "
                   f"{[done for _, done, _ in curve]}): make --total_samples a multiple of "
                   "--eval_every_versions versions' samples")


def mode_rows(results: dict, equal_samples: int | None = None) -> dict:
  """Each run's figures, and its ratios against the sync run of the same round.

  `equal_samples`: a run that trained past that many samples (--async_run_on) gives its
  accuracy and samples/s at that point of its curve (`final_accuracy_at_end`: where it ended),
  so both compare with sync at equal samples; its time to sync's final accuracy is read from
  the whole curve."""
  base = results.get("sync")
  table = {}
  for mode, result in results.items():
    summary = result["summary"]
    accuracy, samples_per_s = summary["eval/accuracy"], summary["system/samples_per_s"]
    if equal_samples is not None and summary["consumed_samples"] > equal_samples:
      time_s, accuracy = at_samples(result["curve"], equal_samples)
      samples_per_s = equal_samples / time_s
    row = {
        "final_accuracy": accuracy,
        "final_accuracy_at_end": summary["eval/accuracy"],
        "samples_per_s": samples_per_s,
        "wall_s": summary["system/wall_s"],
        **{f"{role}_idle_ratio": summary[f"{role}/idle_ratio"]
           for role in ("rollout", "reward", "learner", "sync")},
        "version_gap_max": result["version_gap_max"],
        "stale_ratio_mean": result["stale_ratio_mean"],
        "partial_ratio_mean": result["partial_ratio_mean"],
        "max_partial_span": result["max_partial_span"],
        **{key.split("/", 1)[1]: summary.get(key) for key in (
            "lengths/generated_mean", "lengths/generated_p90", "lengths/consumed_mean",
            "lengths/consumed_p90", "lengths/consumed_over_generated_mean")},
        **{key.replace("/", "_"): summary.get(key) for key in (
            "handoff/publish_to_work_s_p50", "handoff/publish_to_work_s_p99",
            "handoff/publish_to_take_s_p50", "handoff/publish_to_take_s_p99",
            "rollout/swap_fetch_s_mean", "rollout/swap_load_s_mean")},
    }
    if base is not None:
      target = base["summary"]["eval/accuracy"]
      reach = time_to_reach(result["curve"], target)
      row["samples_per_s_vs_sync"] = row["samples_per_s"] / base["summary"][
          "system/samples_per_s"]
      row["time_to_sync_final_accuracy_s"] = reach
      sync_reach = time_to_reach(base["curve"], target)
      row["time_to_sync_final_accuracy_vs_sync"] = (
          None if reach is None or not sync_reach else reach / sync_reach)
      row["accuracy_minus_sync"] = row["final_accuracy"] - target
    table[mode] = row
  return table


def median_row(rows: list[dict]) -> dict:
  """The median of every figure over the rounds (None where a round has none: a run that never
  reached sync's accuracy), the spread of samples/s and of its ratio, and the rounds' count.
  version_gap_max is the maximum over the rounds (a bound holds only if it holds in each)."""
  out = {}
  for key in rows[0]:
    values = [row[key] for row in rows]
    if key == "version_gap_max":
      out[key] = max(values)
    elif any(v is None for v in values):
      out[key] = None
    else:
      out[key] = float(statistics.median(values))
  for key in ("samples_per_s", "samples_per_s_vs_sync"):
    if key in rows[0]:
      out[f"{key}_min"] = min(row[key] for row in rows)
      out[f"{key}_max"] = max(row[key] for row in rows)
  out["rounds"] = len(rows)
  return out


def time_to_reach(curve, target: float) -> float | None:
  for time_s, _, accuracy in curve:
    if accuracy >= target:
      return time_s
  return None


def draw(run_dirs: dict, out: str) -> None:
  """Every mode's run report in <out>-report/ (jaxrl_async.report); its overview as <out>.png."""
  try:
    paths = report.write_report(list(run_dirs.values()), out + "-report", names=list(run_dirs))
  except ImportError as error:
    print(f"no plot: {error}; {out}.png not written", file=sys.stderr)
    return
  shutil.copyfile(paths["overview"], out + ".png")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--total_samples", type=int, default=25_600)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--modes", default=",".join(MODES))
  parser.add_argument("--recipes", default="",
                      help="comma-separated recipes of gin/recipes/ to run beside the modes "
                           "(e.g. verl_fully_async,verl_defaults), reported under their names")
  parser.add_argument("--eval_every_versions", type=int, default=20)
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--variant", action="append", default=[],
                      help="NAME=MODE:BINDING[;BINDING...]: one more run, of MODE's gin file "
                           "(a mode, or recipes/NAME for a recipe) with these bindings on top, "
                           "reported as NAME (e.g. "
                           "'async_partial_t2=async_partial:RunConfig.trigger_parameter_sync_step"
                           " = 2')")
  parser.add_argument("--backend", choices=("threads", "processes", "ray"), default="threads",
                      help="how the async modes run their roles (sync runs in one process); "
                           "ray: the cluster RAY_ADDRESS names, else a one-node cluster on "
                           "127.0.0.1 started for the benchmark")
  parser.add_argument("--warmup_samples", type=int, default=6400,
                      help="samples per mode run first and discarded (fills the compile cache)")
  parser.add_argument("--repeats", type=int, default=1,
                      help="rounds of every mode, interleaved (sync, async, sync, async ...); "
                           "with more than one, each figure is the median over the rounds "
                           "(ratios: the median of each round's ratio) and every round is "
                           "kept under 'rounds'")
  parser.add_argument("--ceiling_batches", type=int, default=100,
                      help="batches per role loop for the ceiling measured after the runs "
                           "(0: not measured)")
  parser.add_argument("--ceiling_data_batches", type=int,
                      default=concurrency_ceiling.DATA_BATCHES,
                      help="rollout batches the ceiling's learner loop cycles through")
  parser.add_argument("--task_file", action="append", default=[],
                      help="a task's gin file loaded after each mode's or recipe's (e.g. "
                           "gin/tasks/rlvr.gin); the ceiling is then the workload's bound")
  parser.add_argument("--bound_run", default=None,
                      help="with --task_file: the run (mode, recipe or variant name) whose "
                           "settings the bound measures (default: the first async run)")
  parser.add_argument("--bound_samples", type=int, default=2048,
                      help="with --task_file: samples generated and scored for the bound")
  parser.add_argument("--together_s", type=float, default=5.0,
                      help="with --task_file: also every role at once, in 3 windows of this "
                           "many seconds (benchmarks/workload_together.py; 0 skips it)")
  parser.add_argument("--async_run_on", type=float, default=1.0,
                      help="the async runs train this many times --total_samples (>= 1), so "
                           "their time to sync's final accuracy can lie past sync's sample "
                           "count; accuracy and samples/s are still compared at "
                           "--total_samples, read from each run's curve")
  parser.add_argument("--out", default=os.path.join(
      "benchmarks", "results", f"modes-{time.strftime('%Y%m%d-%H%M%S')}"))
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  if not args.async_run_on >= 1.0:
    parser.error(f"--async_run_on must be >= 1, got {args.async_run_on}")
  if args.ceiling_batches < 0:
    parser.error(f"--ceiling_batches must be >= 0, got {args.ceiling_batches}")
  if args.ceiling_data_batches < 1:
    parser.error(f"--ceiling_data_batches must be >= 1, got {args.ceiling_data_batches}")
  os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  bindings = [f"RunConfig.total_samples = {args.total_samples}", f"RunConfig.seed = {args.seed}",
              f"RunConfig.eval_every_versions = {args.eval_every_versions}",
              "RunConfig.checkpoint_every_versions = 1000000", *args.gin_bindings]
  runs = {mode: (mode, []) for mode in args.modes.split(",") if mode}
  for recipe in filter(None, args.recipes.split(",")):
    if not os.path.isfile(gin_file(f"recipes/{recipe}")):
      parser.error(f"--recipes: no gin/recipes/{recipe}.gin")
    runs[recipe] = (f"recipes/{recipe}", [])
  for spec in args.variant:
    name, _, rest = spec.partition("=")
    mode, _, extra = rest.partition(":")
    known = mode in MODES or (mode.startswith("recipes/") and os.path.isfile(gin_file(mode)))
    if not name or not known or name in runs:
      parser.error(f"--variant {spec!r}: want NAME=MODE:BINDING[;BINDING...] with a new NAME "
                   f"and MODE in {MODES} or recipes/<a recipe of gin/recipes/>")
    runs[name] = (mode, [b.strip() for b in extra.split(";") if b.strip()])
  for path in args.task_file:
    if not os.path.isfile(path):
      parser.error(f"--task_file: no file {path}")
  if args.bound_samples < 1:
    parser.error(f"--bound_samples must be >= 1, got {args.bound_samples}")
  if args.together_s < 0:
    parser.error(f"--together_s must be >= 0, got {args.together_s}")
  if args.bound_run is not None and args.bound_run not in runs:
    parser.error(f"--bound_run {args.bound_run!r} is none of the runs {sorted(runs)}")
  compilation_cache.enable()
  with contextlib.ExitStack() as stack:
    if args.backend == "ray" and not os.environ.get("RAY_ADDRESS"):
      from jaxrl_async.backends.ray import placement
      cluster = placement.start_local_cluster([{"num_cpus": 2}])
      stack.callback(placement.stop_local_cluster, cluster)
    return measure(args, runs, bindings)


def bound_run(runs: dict, chosen: str | None) -> str:
  """The run whose settings the workload bound measures: `chosen`, else the first async run,
  else the first run."""
  if chosen is not None:
    return chosen
  return next((name for name, (mode, _) in runs.items() if mode != "sync"), next(iter(runs)))


def measure_bound(args, runs: dict, bindings: list[str], table: dict) -> dict:
  """The workload's bound (`workload_bound.bound`) for the settings of `bound_run`, and the
  ceiling speedup over the sync run of the table (None without one)."""
  name = bound_run(runs, args.bound_run)
  mode, extra = runs[name]
  ceiling = workload_bound.bound(args.backend, [gin_file(mode), *args.task_file],
                                 [*bindings, *extra], samples=args.bound_samples,
                                 updates=args.ceiling_batches, together_s=args.together_s)
  sync = table.get("sync")
  return {**ceiling, "run": name, "speedup": None if sync is None else
          workload_bound.ceiling_speedup(sync["samples_per_s"], ceiling["bound_s_per_sample"])}


def add_fractions(table: dict, ceiling: dict) -> None:
  """Each row's `fraction_of_ceiling` (of the workload's bound, or of the core-overlap
  speedup for a row with a sync run to compare with) and, with the roles measured together,
  its `fraction_of_together`."""
  for row in table.values():
    if ceiling["kind"] == "workload_bound":
      row["fraction_of_ceiling"] = workload_bound.fraction_of_ceiling(
          row["samples_per_s"], ceiling["bound_s_per_sample"])
      if "together" in ceiling:
        row["fraction_of_together"] = workload_together.fraction_of_together(
            row["samples_per_s"], ceiling["together"]["together_s_per_sample"])
    elif row.get("samples_per_s_vs_sync") is not None:
      row["fraction_of_ceiling"] = row["samples_per_s_vs_sync"] / ceiling["speedup"]


def measure(args, runs: dict, bindings: list[str]) -> int:
  load_start = os.getloadavg()
  rounds: list[dict] = []  # one {name: result} per repeat
  with tempfile.TemporaryDirectory() as root:
    if args.warmup_samples:
      warmup = [*bindings, f"RunConfig.total_samples = {args.warmup_samples}"]
      for name, (mode, extra) in runs.items():
        print(f"warming up {name} ...", file=sys.stderr, flush=True)
        run_mode(mode, [*warmup, *extra], os.path.join(root, f"warmup-{name}"), args.backend,
                 args.task_file)
    for repeat in range(args.repeats):  # interleaved: each round runs every mode once
      results = {}
      for name, (mode, extra) in runs.items():
        suffix = f" (round {repeat + 1} of {args.repeats})" if args.repeats > 1 else ""
        print(f"running {name}{suffix} ...", file=sys.stderr, flush=True)
        longer = ([] if mode == "sync" or args.async_run_on == 1.0 else [
            f"RunConfig.total_samples = {round(args.total_samples * args.async_run_on)}"])
        results[name] = run_mode(mode, [*bindings, *extra, *longer],
                                 os.path.join(root, f"{name}-{repeat}"), args.backend,
                                 args.task_file)
      rounds.append(results)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    draw({name: os.path.join(root, f"{name}-0") for name in rounds[0]}, args.out)
  per_round = [mode_rows(results, args.total_samples) for results in rounds]
  table = per_round[0] if args.repeats == 1 else {
      name: median_row([rows[name] for rows in per_round]) for name in per_round[0]}
  ceiling = None
  if args.ceiling_batches:
    print("measuring the ceiling ...", file=sys.stderr, flush=True)
    ceiling = (measure_bound(args, runs, bindings, table) if args.task_file else
               concurrency_ceiling.ceiling(args.backend, args.ceiling_batches, args.gin_bindings,
                                           args.ceiling_data_batches))
    add_fractions(table, ceiling)
  line = {"benchmark": "modes", "backend": args.backend, "task_files": args.task_file,
          "load_average": {"start": load_start, "end": os.getloadavg()},
          "total_samples": args.total_samples, "async_run_on": args.async_run_on,
          "seed": args.seed,
          "warmup_samples": args.warmup_samples, "repeats": args.repeats,
          "variants": {name: {"mode": mode, "bindings": extra}
                       for name, (mode, extra) in runs.items() if extra},
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "modes": table,
          **({} if ceiling is None else {"ceiling": ceiling})}
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out + ".json", "w", encoding="utf-8") as f:
    json.dump({**line, "curves": {m: r["curve"] for m, r in rounds[0].items()},
               **({"rounds": per_round} if args.repeats > 1 else {})}, f, indent=1)
  print(json.dumps(line))
  return 0


if __name__ == "__main__":
  sys.exit(main())
