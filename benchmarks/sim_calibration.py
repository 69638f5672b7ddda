"""Calibration here: the simulator, fed the profile of a measured sync run, predicts the
measured samples/s of every mode of benchmarks/modes.py (same backend, same budget).

    python benchmarks/sim_calibration.py --total_samples 6400 --work_dir runs/calibration \
        --out benchmarks/results/sim_calibration

Runs the five modes as benchmarks/modes.py does (its `run_mode`, each from its gin file, after
a discarded warm-up run per mode), keeping each run directory; fits the profile from the sync
run's metrics.jsonl (`jaxrl-async simulate --profile_from`); simulates every mode with that
profile and the mode's own knobs; prints predicted and measured samples/s and the error.
`--reuse` skips the runs and reads the run directories of an earlier call.

The async modes run their roles on `--backend` (default: separate processes; 'threads': one
process). The simulator models the roles as sharing one host with contention c (k roles
computing at once each run at 1 / (1 + c (k - 1)) speed), with c = 2 / speedup - 1 from
benchmarks/concurrency_ceiling.py's newest result: two XLA processes at once (processes) or
the two role loops in threads (threads); or --contention.

On the processes backend the roles also run at other speeds than in the sync run the profile
comes from: the rollout server on its own core with one XLA thread, the learner beside it.
`--layout measured` (the default there) takes that from the same concurrency_ceiling result's
`roles_processes` figures, measured on the default run's role loops: rollout decode steps
scaled by rollout_pinned / rollout in one process, learner costs by learner alone / learner in
one process, and a contention for each role from how much its loop slows while the other
runs beside it (rollout: its batches beside the learner / rollout pinned alone - 1; learner:
its batches beside the rollout / learner alone - 1); a result without the per-role figures
gives one c for both (both at once / rollout pinned alone - 1). `--layout none` keeps the
sync run's speeds.

The sync run's updates all have one size, so its fit cannot tell the learner's cost per update
from its cost per token (stream_off_policy's updates are half as big). The same result's
`roles.learner_fixed_fraction` (the learner loop on whole and on half batches) splits them, or
`--learner_fixed_fraction`.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import modes as modes_benchmark
from jaxrl_async import compilation_cache
from jaxrl_async.sim import fit, simulate
from launch.simulate import mode_configs

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def newest_ceiling() -> tuple[dict | None, str]:
  """The newest concurrency_ceiling result of the default run (by its timestamp; a result
  measured with gin bindings, e.g. the small model's, is of another run and is skipped)."""
  best, name = None, "no concurrency_ceiling result of the default run"
  for path in glob.glob(os.path.join(RESULTS, "concurrency_ceiling-*.json")):
    with open(path, encoding="utf-8") as f:
      record = json.loads(f.readline())
    if "-small-" in os.path.basename(path) or record.get("gin_bindings"):
      continue
    if best is None or record["timestamp"] > best["timestamp"]:
      best, name = record, os.path.basename(path)
  return best, name


def default_contention(backend: str) -> tuple[float, str]:
  """Threads: the role loops in threads; processes: two XLA processes at once."""
  ceiling, name = newest_ceiling()
  if ceiling is None:
    return 0.0, f"{name}: contention 0"
  key = "roles" if backend == "threads" else "xla_processes"
  speedup = ceiling[key]["speedup"]
  return max(0.0, 2.0 / speedup - 1.0), f"{name}: {key} speedup {speedup:.3f}"


def processes_layout(profile, ceiling: dict):
  """`profile` (fitted from a sync run: both roles on every core, one after the other) moved
  to the processes backend's layout by concurrency_ceiling's `roles_processes` and `roles`
  figures (see the module doc). Returns (profile, the factors used)."""
  one, layout = ceiling["roles"], ceiling["roles_processes"]
  rollout_scale = layout["rollout_pinned_ms_per_batch"] / one["rollout_ms_per_batch"]
  learner_scale = layout["learner_ms_per_batch"] / one["learner_ms_per_batch"]
  if layout.get("rollout_beside_ms_per_batch") and layout.get("learner_beside_ms_per_batch"):
    contention = max(0.0, layout["rollout_beside_ms_per_batch"]
                     / layout["rollout_pinned_ms_per_batch"] - 1)
    learner_contention = max(0.0, layout["learner_beside_ms_per_batch"]
                             / layout["learner_ms_per_batch"] - 1)
  else:
    contention = max(0.0,
                     layout["both_ms_per_batch"] / layout["rollout_pinned_ms_per_batch"] - 1)
    learner_contention = None
  rollout = dataclasses.replace(
      profile.rollout,
      decode_curve=tuple((n, seconds * rollout_scale) for n, seconds in profile.rollout.decode_curve),
      prefill_s_per_token=profile.rollout.prefill_s_per_token * rollout_scale)
  learner = dataclasses.replace(profile.learner,
                                per_update_s=profile.learner.per_update_s * learner_scale,
                                s_per_token=profile.learner.s_per_token * learner_scale)
  factors = {"rollout_scale": rollout_scale, "learner_scale": learner_scale,
             "contention": contention, "learner_contention": learner_contention}
  return dataclasses.replace(profile, rollout=rollout, learner=learner, contention=contention,
                             learner_contention=learner_contention), factors


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--total_samples", type=int, default=6400)
  parser.add_argument("--warmup_samples", type=int, default=1280)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--modes", default=",".join(modes_benchmark.MODES))
  parser.add_argument("--work_dir", default=os.path.join("runs", "sim_calibration"))
  parser.add_argument("--reuse", action="store_true", help="use the run directories there")
  parser.add_argument("--contention", type=float, default=None)
  parser.add_argument("--backend", choices=("threads", "processes"), default="processes",
                      help="where the async modes run their roles (sync: one process)")
  parser.add_argument("--layout", choices=("measured", "none"), default=None,
                      help="processes backend: move the sync profile to the servers' layout "
                           "by concurrency_ceiling's roles_processes figures (default "
                           "'measured' on processes without --contention, else 'none')")
  parser.add_argument("--learner_fixed_fraction", type=float, default=None,
                      help="share of an update's time fixed per update (default: the newest "
                           "concurrency_ceiling result's roles.learner_fixed_fraction, if any)")
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  modes = args.modes.split(",")
  if "sync" not in modes:
    raise SystemExit("--modes must include sync (its run is the profile)")
  bindings = [f"RunConfig.total_samples = {args.total_samples}", f"RunConfig.seed = {args.seed}",
              "RunConfig.eval_every_versions = 25",
              "RunConfig.checkpoint_every_versions = 1000000", *args.gin_bindings]
  load_path = os.path.join(args.work_dir, "load_average.json")
  measured = {}
  if not args.reuse:
    load_before = os.getloadavg()[0]
    compilation_cache.enable()
    for mode in modes:
      if args.warmup_samples:
        print(f"warming up {mode} ...", file=sys.stderr, flush=True)
        warm = os.path.join(args.work_dir, f"warmup-{mode}")
        modes_benchmark.run_mode(mode, [*bindings, f"RunConfig.total_samples = "
                                        f"{args.warmup_samples}"], warm, args.backend)
      print(f"running {mode} ...", file=sys.stderr, flush=True)
      modes_benchmark.run_mode(mode, bindings, os.path.join(args.work_dir, mode), args.backend)
    with open(load_path, "w", encoding="utf-8") as f:
      json.dump({"before": load_before, "after": os.getloadavg()[0]}, f)
  runs_load = None
  if os.path.isfile(load_path):
    with open(load_path, encoding="utf-8") as f:
      runs_load = json.load(f)
  measured_idle = {}
  for mode in modes:
    with open(os.path.join(args.work_dir, mode, "summary.json"), encoding="utf-8") as f:
      run_summary = json.load(f)
    measured[mode] = run_summary["system/samples_per_s"]
    measured_idle[mode] = {role: run_summary.get(f"{role}/idle_ratio")
                           for role in ("rollout", "learner")}
  contention, contention_source = ((args.contention, "--contention")
                                   if args.contention is not None
                                   else default_contention(args.backend))
  fixed_fraction, fixed_source = args.learner_fixed_fraction, "--learner_fixed_fraction"
  if fixed_fraction is None:
    ceiling, source = newest_ceiling()
    fixed_fraction = (ceiling or {}).get("roles", {}).get("learner_fixed_fraction")
    fixed_source = f"{source}: roles" if fixed_fraction is not None else "not measured"
  profile = fit.profile_from_run(os.path.join(args.work_dir, "sync"), seed=args.seed,
                                 learner_fixed_fraction=fixed_fraction)
  layout = args.layout or ("measured" if args.backend == "processes" and args.contention is None
                           else "none")
  async_profile = dataclasses.replace(profile, contention=contention)
  layout_factors = None
  if layout == "measured":
    ceiling, source = newest_ceiling()
    if ceiling is None or "roles_processes" not in ceiling:
      raise SystemExit(f"--layout measured needs a concurrency_ceiling result with "
                       f"roles_processes ({source}): run benchmarks/concurrency_ceiling.py")
    if args.contention is not None:
      raise SystemExit("--layout measured sets the contention itself; use --layout none with "
                       "--contention")
    async_profile, layout_factors = processes_layout(profile, ceiling)
    contention, contention_source = layout_factors["contention"], f"{source}: roles_processes"
  configs = mode_configs(modes, bindings)
  table = {}
  for mode in modes:
    used = profile if mode == "sync" else async_profile
    summary = simulate(used, configs[mode], seed=args.seed).summary
    predicted = summary["system/samples_per_s"]
    table[mode] = {"measured_samples_per_s": measured[mode],
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
                   "predicted_stale_ratio": summary["algo/stale_ratio"],
                   "predicted_version_gap_max": summary["algo/version_gap_max"]}
  line = {"benchmark": "sim_calibration", "backend": args.backend,
          "total_samples": args.total_samples,
          "warmup_samples": args.warmup_samples, "seed": args.seed,
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "runs_load_average": runs_load,
          "contention": contention, "contention_source": contention_source,
          "layout": layout, "layout_factors": layout_factors,
          "learner_fixed_fraction": fixed_fraction,
          "learner_fixed_fraction_source": fixed_source,
          "profile": profile.to_dict(), "modes": table}
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
      json.dump(line, f, indent=1, default=float)
  print(json.dumps(line, default=float))
  return 0


if __name__ == "__main__":
  sys.exit(main())
