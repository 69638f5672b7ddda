"""The adaptive staleness controller's path, measured against the simulator's prediction.

    python benchmarks/adaptive_trajectory.py --sync_run SWEEP/000-seed=0,mode=sync,... \
        --adaptive_run SWEEP/004-seed=0,staleness_controller=adaptive,...

The profile is fitted on the sync run alone (`sim.fit.profile_from_run`) and given the
parameters a sync run cannot show as `benchmarks/sim_calibration.py` gives them (the layout and
contention of the newest stored `concurrency_ceiling` result, or `--ceiling_from`; the buffer's
cost per sample; the hand-off latency from `--handoff_run`, an async run of the same workload,
or none). Each adaptive run's RunConfig is rebuilt from its sweep trial (`trial.json`: gin files
and bindings) and simulated with the controller the live loop runs (`staleness_control`). Both
paths are `staleness/threshold` per policy version; the figures:

  mean_threshold        the mean s over the run's versions, measured and predicted
  trajectory_error      mean over versions of |s_predicted - s_measured|, over the measured mean
  samples_per_s         measured and predicted, and the error of the prediction
  changes               the versions at which s changed, and to what, on each side

No KL is simulated: a KL budget that binds in the live run cannot bind in the prediction, which
the output says where the measured path shows a KL reason (`staleness/reason`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin
from benchmarks import calibration_profile
from jaxrl_async import config as config_lib
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.sim import fit, simulate
from launch import train


def version_records(run_dir: str) -> list[dict]:
  """The run's per-version records (those with a policy version), in order."""
  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  return [r for r in records if "staleness/threshold" in r]


def trial_config(run_dir: str) -> config_lib.RunConfig:
  """The RunConfig the sweep trial ran (its gin files and bindings)."""
  with open(os.path.join(run_dir, "trial.json"), encoding="utf-8") as f:
    trial = json.load(f)
  train.load_config(trial["gin_files"], trial["bindings"])
  try:
    return gin.get_configurable(config_lib.RunConfig)()
  finally:
    gin.clear_config()


def path_of(records: list[dict]) -> list[float]:
  return [float(r["staleness/threshold"]) for r in records]


def changes_of(records: list[dict]) -> list[tuple[int, float, str]]:
  """(version, new s, reason) at each window whose decision moved s."""
  out = []
  for index, record in enumerate(records):
    change = record.get("staleness/change")
    if change:
      out.append((index + 1, float(record["staleness/threshold"]) + float(change),
                  str(record.get("staleness/reason", ""))))
  return out


def compare_paths(measured: list[float], predicted: list[float]) -> dict:
  """Mean s on each side and the mean absolute gap over the measured mean (the shorter path's
  versions)."""
  n = min(len(measured), len(predicted))
  if n == 0:
    raise ValueError("no versions with staleness/threshold on one side")
  mean_measured = sum(measured[:n]) / n
  gap = sum(abs(p - m) for p, m in zip(predicted[:n], measured[:n], strict=True)) / n
  return {"versions": n, "mean_threshold_measured": mean_measured,
          "mean_threshold_predicted": sum(predicted[:n]) / n,
          "final_threshold_measured": measured[n - 1], "final_threshold_predicted": predicted[n - 1],
          "trajectory_error": gap / mean_measured if mean_measured > 0 else math.inf}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--sync_run", required=True, help="a sync run of the workload (the fit)")
  parser.add_argument("--adaptive_run", action="append", required=True,
                      help="a sweep trial of the adaptive controller (repeat for rounds)")
  parser.add_argument("--handoff_run", default=None,
                      help="an async sweep trial whose records give the hand-off latency")
  parser.add_argument("--ceiling_from", default=None,
                      help="a concurrency_ceiling result (default: the newest stored)")
  parser.add_argument("--backend", default="processes", choices=("threads", "processes"))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=None, help="also write the JSON line to this file")
  args = parser.parse_args(argv)

  if args.ceiling_from:
    with open(args.ceiling_from, encoding="utf-8") as f:
      ceiling, ceiling_source = json.loads(f.readline()), os.path.basename(args.ceiling_from)
  else:
    ceiling, ceiling_source = calibration_profile.newest_ceiling()
  profile = fit.profile_from_run(args.sync_run, seed=args.seed,
                                 learner_fixed_fraction=(ceiling or {}).get("roles", {}).get(
                                     "learner_fixed_fraction"))
  handoff_records = handoff_config = None
  handoff_wall_s = math.nan
  if args.handoff_run:
    handoff_records = read_jsonl(os.path.join(args.handoff_run, "metrics.jsonl"))
    handoff_config = trial_config(args.handoff_run)
    with open(os.path.join(args.handoff_run, "summary.json"), encoding="utf-8") as f:
      handoff_wall_s = json.load(f)["system/wall_s"]
  used, factors = calibration_profile.async_profile_for(
      profile, args.backend, ceiling, handoff_records, handoff_config, args.seed,
      handoff_wall_s=handoff_wall_s)
  runs = []
  for run_dir in args.adaptive_run:
    config = trial_config(run_dir)
    if not config.adaptive_staleness:
      raise SystemExit(f"{run_dir}: not an adaptive run (staleness_controller="
                       f"{config.staleness_controller!r})")
    measured = version_records(run_dir)
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
      measured_sps = json.load(f)["system/samples_per_s"]
    result = simulate(dataclasses.replace(used), config, seed=args.seed)
    predicted = [r for r in result.records if "staleness/threshold" in r]
    predicted_sps = result.summary["system/samples_per_s"]
    kl_bound = [c for c in changes_of(measured) if "kl " in c[2]]
    runs.append({"run": os.path.basename(run_dir.rstrip("/")),
                 **compare_paths(path_of(measured), path_of(predicted)),
                 "samples_per_s_measured": measured_sps, "samples_per_s_predicted": predicted_sps,
                 "samples_per_s_error": predicted_sps / measured_sps - 1,
                 "changes_measured": changes_of(measured),
                 "changes_predicted": changes_of(predicted),
                 "measured_kl_decisions": len(kl_bound),
                 "note": ("the measured path has KL-bound decisions, which the simulator cannot "
                          "make (no KL simulated)") if kl_bound else ""})
  line = {"benchmark": "adaptive_trajectory", "backend": args.backend,
          "sync_run": os.path.basename(args.sync_run.rstrip("/")),
          "ceiling_source": ceiling_source, "once_measured": factors,
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "runs": runs}
  text = json.dumps(line, default=float)
  print(text)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text + "\n")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
