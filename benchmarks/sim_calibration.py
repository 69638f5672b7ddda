"""Calibration here: the simulator, fed the profile of a measured sync run, predicts the
measured samples/s of every mode of benchmarks/modes.py and of verl's recipes (same backend,
same budget).

    python benchmarks/sim_calibration.py --total_samples 12800 --work_dir runs/calibration \
        --out benchmarks/results/sim_calibration

Runs the five modes and the recipes of `--recipes` as benchmarks/modes.py does (its
`run_mode`, each from its gin file, after a discarded warm-up run of each), keeping each run
directory. Then it measures, once, the concurrency ceiling (`concurrency_ceiling.ceiling`: each
role's loop alone in one process, alone in the backend's layout, and both together).
`--reuse` skips all of this and reads the directories of an earlier call.

The profile is fitted on the sync run alone (`fit.profile_from_run`). The async modes get it
with the parameters a sync run cannot show (jaxrl_async/sim/calibrate.py, docs/simulator.md),
each measured once and shared by every mode:
- processes backend: each role's cost scaled to the layout, and each role's contention, from
  the ceiling (`--ceiling_from FILE` takes a stored concurrency_ceiling result instead);
  threads: one contention c = 2 / speedup - 1 from the ceiling's `roles`; `--contention`
  gives one c and no layout;
- the hand-off latency, from the records of the `--handoff_mode` warm-up run (default
  on_policy) against a simulation of that run without one;
- the buffer's cost per sample (processes backend), from the newest stored cross-process and
  in-process buffer_throughput results;
- the run's edges (the servers starting and stopping), from that same warm-up run;
- the recompute pass of a window's later updates, assumed at a third of an update per token.
The learner's fixed share of an update (`learner_fixed_fraction`) comes from the ceiling's
`roles` (the learner loop on whole and on half batches), or `--learner_fixed_fraction`.

`--repeats R` runs every mode R times, round by round (each round every mode once, in order):
each measured figure is the median over the rounds (one run's samples/s moves by about 15% on a
loaded 2-core machine, as much as the bar), and the profile is fitted on the sync round of
median samples/s. `--paired_rounds` also predicts each round from that round's own sync run
(and, with `--contention_rounds`, its own contention run) and gives each mode the median of
the rounds' errors: a host that drifts between rounds then moves a prediction and the run it is
compared with together.

Prints predicted and measured samples/s, the error, idle ratios and hand-off p50s per mode.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin
from benchmarks import calibration_profile, common, concurrency_ceiling
from benchmarks import modes as modes_benchmark
from jaxrl_async import compilation_cache
from jaxrl_async import config as config_lib
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.sim import calibrate, fit, simulate
from launch import train

CEILING_FILE = "concurrency_ceiling.json"


def run_dirs(work_dir: str, mode: str, repeats: int) -> list[str]:
  """A mode's run directories: `<work_dir>/<mode>` for one round, else one per round,
  `<work_dir>/<mode>-r<k>`."""
  if repeats == 1:
    return [os.path.join(work_dir, mode)]
  return [os.path.join(work_dir, f"{mode}-r{k}") for k in range(1, repeats + 1)]


def median_of(summaries, key: str):
  """The median of `key` over the runs' summaries that have it (None where none has)."""
  values = [summary[key] for summary, _ in summaries if summary.get(key) is not None]
  return statistics.median(values) if values else None


def paired_errors(predicted: list[float], measured: list[float]) -> dict:
  """Round k's prediction (from round k's own sync run) against round k's measured run: the
  errors, their median (the paired error) and whether it is within 15%."""
  errors = [p / m - 1 for p, m in zip(predicted, measured)]
  median = statistics.median(errors)
  return {"predicted_rounds": predicted, "errors": errors, "median_error": median,
          "within_15_percent": abs(median) <= 0.15}


def run_configs(names, bindings, task_files=()) -> dict:
  """Each mode's or recipe's RunConfig from its gin file, the task files and the bindings."""
  configs = {}
  for name in names:
    train.load_config([modes_benchmark.gin_file(name), *task_files], bindings)
    configs[name] = gin.get_configurable(config_lib.RunConfig)()
  gin.clear_config()
  return configs


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--total_samples", type=int, default=6400)
  parser.add_argument("--warmup_samples", type=int, default=1280)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--modes", default=",".join(modes_benchmark.MODES))
  parser.add_argument("--recipes", default="verl_fully_async,verl_defaults",
                      help="comma-separated recipes of gin/recipes/ run and predicted beside "
                           "the modes ('' for none)")
  parser.add_argument("--ceiling_batches", type=int, default=100,
                      help="batches per role loop of the ceiling measured once after the runs "
                           "(each role alone, both together: the contention and the layout); "
                           "0: the newest stored concurrency_ceiling result")
  parser.add_argument("--ceiling_repeats", type=int, default=1,
                      help="ceilings measured one after another; each figure is their median")
  parser.add_argument("--ceiling_only", action="store_true",
                      help="with --reuse: measure the ceiling into --work_dir, then predict")
  parser.add_argument("--ceiling_from", default=None,
                      help="a concurrency_ceiling result (JSON) to use instead of the one "
                           "measured with the runs")
  parser.add_argument("--repeats", type=int, default=1,
                      help="rounds of every mode, interleaved (mode by mode in each round); "
                           "each measured figure is the median over the rounds and the profile "
                           "is fitted on the sync round of median samples/s")
  parser.add_argument("--work_dir", default=os.path.join("runs", "sim_calibration"),
                      help="where the runs go: absent or empty, unless --reuse reads them")
  parser.add_argument("--reuse", action="store_true", help="use the run directories there")
  parser.add_argument("--contention", type=float, default=None,
                      help="one contention for both roles instead of the measured layout")
  parser.add_argument("--backend", choices=("threads", "processes"), default="processes",
                      help="where the async modes run their roles (sync: one process)")
  parser.add_argument("--learner_fixed_fraction", type=float, default=None,
                      help="share of an update's time fixed per update (default: the newest "
                           "concurrency_ceiling result's roles.learner_fixed_fraction, if any)")
  parser.add_argument("--handoff_mode", default="on_policy",
                      help="the mode whose warm-up run's records give the hand-off latency")
  parser.add_argument("--contention_mode", default=None,
                      help="a mode or recipe (one of those run) whose warm-up run gives both "
                           "roles' contentions (calibrate.role_contention) in place of the "
                           "ceiling's: how much each role slows beside the other busy one in "
                           "a real run of this host")
  parser.add_argument("--contention_model", choices=calibrate.CONTENTION_MODELS, default="contention",
                      help="with --contention_mode, how the learner's slowdown is read "
                           "(calibrate.contention_from_run): only beside a busy rollout, one "
                           "factor on all its work ('scale'), or the first where it fits with "
                           "c <= 3, else the second ('auto')")
  parser.add_argument("--contention_samples", type=int, default=6400,
                      help="samples of --contention_mode's warm-up run")
  parser.add_argument("--contention_rounds", action="store_true",
                      help="with --contention_mode: also run that mode at the start of every "
                           "round (contention-r<k>) and read the contentions from the round "
                           "of median samples/s, so the reading sees the host as the rounds do")
  parser.add_argument("--paired_rounds", action="store_true",
                      help="with --repeats >= 2: also predict every round from that round's "
                           "own sync run (and contention run, with --contention_rounds) and "
                           "report the median of the rounds' errors, so a host that drifts "
                           "between rounds moves a prediction and its measurement together")
  parser.add_argument("--task_file", action="append", default=[],
                      help="gin files after each mode's (e.g. gin/tasks/rlvr.gin: the RLVR "
                           "workload); the ceiling's role loops stay the default run's")
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if args.repeats < 1:
    parser.error(f"--repeats must be >= 1, got {args.repeats}")
  for path in args.task_file:
    if not os.path.isfile(path):
      parser.error(f"--task_file {path!r}: no such file")
  modes = [*args.modes.split(","),
           *(f"recipes/{r}" for r in filter(None, args.recipes.split(",")))]
  if "sync" not in modes:
    raise SystemExit("--modes must include sync (its run is the profile)")
  if args.contention_mode is not None and args.contention_mode not in modes:
    parser.error(f"--contention_mode {args.contention_mode!r} is not among the runs {modes}")
  if args.paired_rounds and args.repeats < 2:
    parser.error(f"--paired_rounds needs --repeats >= 2, got {args.repeats}")
  if args.contention_rounds and args.contention_mode is None:
    parser.error("--contention_rounds needs --contention_mode")
  bindings = [f"RunConfig.total_samples = {args.total_samples}", f"RunConfig.seed = {args.seed}",
              "RunConfig.eval_every_versions = 25",
              "RunConfig.checkpoint_every_versions = 1000000", *args.gin_bindings]
  if not args.reuse and os.path.isdir(args.work_dir) and os.listdir(args.work_dir):
    parser.error(f"--work_dir {args.work_dir} holds an earlier calibration's runs: --reuse "
                 "predicts from them; to measure again, remove it or name another --work_dir")
  load_path = os.path.join(args.work_dir, "load_average.json")
  measured = {}
  if args.reuse and args.ceiling_only:
    compilation_cache.enable()
    ceiling = calibrate.median_ceiling([
        concurrency_ceiling.ceiling(args.backend, args.ceiling_batches)
        for _ in range(args.ceiling_repeats)])
    ceiling.update(repeats=args.ceiling_repeats, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"),
                   load_average=os.getloadavg()[0])
    with open(os.path.join(args.work_dir, CEILING_FILE), "w", encoding="utf-8") as f:
      json.dump(ceiling, f)
  if not args.reuse:
    load_before = os.getloadavg()[0]
    compilation_cache.enable()
    for mode in modes:
      if args.warmup_samples:
        print(f"warming up {mode} ...", file=sys.stderr, flush=True)
        warm = os.path.join(args.work_dir, f"warmup-{mode}")
        samples = (args.contention_samples if mode == args.contention_mode
                   else args.warmup_samples)
        modes_benchmark.run_mode(mode, [*bindings, f"RunConfig.total_samples = {samples}"],
                                 warm, args.backend, args.task_file)
    for round_ in range(args.repeats):
      if args.contention_rounds:  # the host's slowdown read in every round, beside its runs
        print(f"contention run of {args.contention_mode} (round {round_ + 1}) ...",
              file=sys.stderr, flush=True)
        modes_benchmark.run_mode(args.contention_mode, [
            *bindings, f"RunConfig.total_samples = {args.contention_samples}"],
            os.path.join(args.work_dir, f"contention-r{round_ + 1}"), args.backend,
            args.task_file)
      for mode in modes:
        print(f"running {mode} (round {round_ + 1} of {args.repeats}) ...", file=sys.stderr,
              flush=True)
        modes_benchmark.run_mode(mode, bindings,
                                 run_dirs(args.work_dir, mode, args.repeats)[round_],
                                 args.backend, args.task_file)
    load_after = os.getloadavg()[0]
    if args.ceiling_batches:
      print("concurrency ceiling (each role alone, both together) ...", file=sys.stderr,
            flush=True)
      measured_ceiling = calibrate.median_ceiling([
          concurrency_ceiling.ceiling(args.backend, args.ceiling_batches)
          for _ in range(args.ceiling_repeats)])
      measured_ceiling["repeats"] = args.ceiling_repeats
      measured_ceiling["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S")
      with open(os.path.join(args.work_dir, CEILING_FILE), "w", encoding="utf-8") as f:
        json.dump(measured_ceiling, f)
    with open(load_path, "w", encoding="utf-8") as f:
      json.dump({"before": load_before, "after": load_after,
                 "after_ceiling": os.getloadavg()[0]}, f)
  runs_load = None
  if os.path.isfile(load_path):
    with open(load_path, encoding="utf-8") as f:
      runs_load = json.load(f)
  measured_idle, measured_handoff, rounds, sync_dir = {}, {}, {}, None
  for mode in modes:
    summaries = []
    for run_dir in run_dirs(args.work_dir, mode, args.repeats):
      with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        summaries.append((json.load(f), run_dir))
    rounds[mode] = [summary["system/samples_per_s"] for summary, _ in summaries]
    measured[mode] = statistics.median(rounds[mode])
    measured_idle[mode] = {role: median_of(summaries, f"{role}/idle_ratio")
                           for role in ("rollout", "learner")}
    measured_handoff[mode] = median_of(summaries, "handoff/publish_to_enqueue_s_p50")
    if mode == "sync":  # the profile's run: the round of median samples/s
      sync_dir = common.median_run([run_dir for _, run_dir in summaries])
  ceiling_path = args.ceiling_from or os.path.join(args.work_dir, CEILING_FILE)
  if args.ceiling_from:
    with open(args.ceiling_from, encoding="utf-8") as f:
      ceiling, ceiling_source = json.loads(f.readline()), os.path.basename(args.ceiling_from)
  elif os.path.isfile(ceiling_path):
    with open(ceiling_path, encoding="utf-8") as f:
      ceiling, ceiling_source = json.load(f), f"{CEILING_FILE} (measured with the runs)"
  else:
    ceiling, ceiling_source = calibration_profile.newest_ceiling()
    if ceiling is None and args.contention is None:
      raise SystemExit(f"{ceiling_source}: run with --ceiling_batches > 0")
    ceiling = ceiling or {}
  fixed_fraction, fixed_source = args.learner_fixed_fraction, "--learner_fixed_fraction"
  if fixed_fraction is None:
    fixed_fraction = ceiling.get("roles", {}).get("learner_fixed_fraction")
    fixed_source = f"{ceiling_source}: roles" if fixed_fraction is not None else "not measured"
  handoff_path = os.path.join(args.work_dir, f"warmup-{args.handoff_mode}", "metrics.jsonl")
  handoff_records = read_jsonl(handoff_path) if os.path.isfile(handoff_path) else None
  handoff_wall_s = math.nan
  if handoff_records is not None:
    with open(os.path.join(os.path.dirname(handoff_path), "summary.json"),
              encoding="utf-8") as f:
      handoff_wall_s = json.load(f)["system/wall_s"]
  handoff_config = None  # the warm-up run's config (none without a warm-up run)
  if handoff_records is not None:
    handoff_config = run_configs([args.handoff_mode], [
        *bindings, f"RunConfig.total_samples = {args.warmup_samples}"],
        args.task_file)[args.handoff_mode]
  contention_config = None
  if args.contention_mode is not None:
    contention_config = run_configs([args.contention_mode], [
        *bindings, f"RunConfig.total_samples = {args.contention_samples}"],
        args.task_file)[args.contention_mode]
  configs = run_configs(modes, bindings, args.task_file)

  def predict(sync_run: str, contention_dir: str | None):
    """The profile fitted on `sync_run`, its async profile (the contentions from
    `contention_dir`'s spans with --contention_mode), and each mode's simulated summary."""
    profile = fit.profile_from_run(sync_run, seed=args.seed,
                                   learner_fixed_fraction=fixed_fraction)
    contention_run = (None if contention_dir is None else
                      (contention_dir, contention_config, args.contention_model))
    async_profile, factors = calibration_profile.async_profile_for(
        profile, args.backend, ceiling, handoff_records, handoff_config, args.seed,
        args.contention, handoff_wall_s, contention_run)
    if contention_dir is not None:
      factors["contention_source"] = (f"{os.path.basename(contention_dir)} "
                                      f"({args.contention_mode}) run's spans, "
                                      f"{args.contention_model} model")
    factors["handoff_source"] = (f"warmup-{args.handoff_mode} run's records"
                                 if handoff_records is not None else "no run: 0")
    summaries = {mode: simulate(profile if mode == "sync" else async_profile, configs[mode],
                                seed=args.seed).summary for mode in modes}
    return profile, async_profile, factors, summaries

  contention_dirs = [None] * args.repeats
  if args.contention_mode is not None:
    contention_dirs = ([os.path.join(args.work_dir, f"contention-r{k}")
                        for k in range(1, args.repeats + 1)] if args.contention_rounds
                       else [os.path.join(args.work_dir, f"warmup-{args.contention_mode}")]
                       * args.repeats)
  contention_dir = (common.median_run(contention_dirs) if args.contention_rounds
                    else contention_dirs[0])
  profile, async_profile, factors, summaries = predict(sync_dir, contention_dir)
  paired = None
  if args.paired_rounds:  # each round predicted from its own sync run (and contention run)
    print("predicting each round from its own sync run ...", file=sys.stderr, flush=True)
    paired = [predict(sync_run, contention_run)[3] for sync_run, contention_run in
              zip(run_dirs(args.work_dir, "sync", args.repeats), contention_dirs)]
  table = {}
  for mode in modes:
    summary = summaries[mode]
    predicted = summary["system/samples_per_s"]
    name = mode.removeprefix("recipes/")
    table[name] = {"measured_samples_per_s": measured[mode],
                   "measured_rounds": rounds[mode],
                   "predicted_samples_per_s": predicted,
                   "error": predicted / measured[mode] - 1,
                   "within_15_percent": abs(predicted / measured[mode] - 1) <= 0.15,
                   "measured_vs_sync": measured[mode] / measured["sync"],
                   "predicted_vs_sync": predicted / table.get("sync", {}).get(
                       "predicted_samples_per_s", predicted),
                   "measured_rollout_idle_ratio": measured_idle[mode]["rollout"],
                   "predicted_rollout_idle_ratio": summary["rollout/idle_ratio"],
                   "measured_learner_idle_ratio": measured_idle[mode]["learner"],
                   "predicted_learner_idle_ratio": summary["learner/idle_ratio"],
                   "measured_handoff_p50_s": measured_handoff[mode],
                   "predicted_handoff_p50_s": summary.get("handoff/publish_to_enqueue_s_p50"),
                   "predicted_stale_ratio": summary["algo/stale_ratio"],
                   "predicted_version_gap_max": summary["algo/version_gap_max"]}
    if paired is not None:
      table[name]["paired"] = paired_errors(
          [row[mode]["system/samples_per_s"] for row in paired], rounds[mode])
  line = {"benchmark": "sim_calibration", "backend": args.backend, "task_files": args.task_file,
          "total_samples": args.total_samples, "repeats": args.repeats,
          "profile_run": os.path.basename(sync_dir),
          "warmup_samples": args.warmup_samples, "seed": args.seed,
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "runs_load_average": runs_load, "ceiling_source": ceiling_source,
          "once_measured": factors, "learner_fixed_fraction": fixed_fraction,
          "learner_fixed_fraction_source": fixed_source,
          "profile": profile.brief_dict(), "async_profile": async_profile.brief_dict(),
          "modes": table}
  if paired is not None:
    line["paired_within_15_percent"] = all(row["paired"]["within_15_percent"]
                                           for row in table.values())
  return common.emit_result(line, args.out)


if __name__ == "__main__":
  sys.exit(main())
