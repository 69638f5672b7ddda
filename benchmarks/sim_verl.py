"""Predicted async/sync speedups of verl's fully async Qwen2.5-Math-7B runs beside the
published ones (32, 64, 128 GPUs; at 128 also the mode and staleness rows).

    python benchmarks/sim_verl.py --num_versions 40 --out benchmarks/results/sim_verl

Profiles: jaxrl_async/sim/profiles/verl_fully_async_qwen25_math_7b.json (published numbers,
assumptions with reasons). Decode speed and learner cost come from the published sync run at
each GPU count; the published async figures are only compared against. The published speedup
is the ratio of total times over 400 steps (also given: over the first 100); the simulated one
is the ratio of samples/s over `--num_versions` versions. `learner_exponent` rows show how the
prediction moves with the one assumption it hinges on (how the learner's time scales when it
has half the GPUs); they are a sensitivity, not the prediction. `published_consistency`
(`published.table_consistency`) sets each published speedup beside the largest one its own sync
run allows when a step holds the same work in both runs: the async step is at least the
learner's update of it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from jaxrl_async.sim import published, simulate

MODE_ROWS = {"stream_off_policy": "stream_off_policy (trigger 4, require 4, s=0)",
             "async_partial_s0.1": "async partial s=0.1",
             "async_partial_s0.3": "async partial s=0.3",
             "async_partial_s0.5": "async partial s=0.5"}


def predict(gpus: int, configs_wanted, num_versions: int, seed: int, exponent=None) -> dict:
  spec = published.load_published()
  if exponent is not None:
    spec = json.loads(json.dumps(spec))
    spec["assumed"]["learner_gpu_scaling_exponent"]["value"] = exponent
  profile, configs = published.verl_setup(gpus, seed=seed, spec=spec)
  out = {}
  sync = simulate(profile, configs["sync"], num_versions=num_versions, seed=seed).summary
  out["sync"] = {"step_s": sync["system/wall_s"] / num_versions,
                 "samples_per_s": sync["system/samples_per_s"]}
  for name in configs_wanted:
    summary = simulate(profile, configs[name], num_versions=num_versions, seed=seed).summary
    out[name] = {"step_s": summary["system/wall_s"] / num_versions,
                 "samples_per_s": summary["system/samples_per_s"],
                 "speedup": summary["system/samples_per_s"] / sync["system/samples_per_s"],
                 "rollout_idle_ratio": summary["rollout/idle_ratio"],
                 "learner_idle_ratio": summary["learner/idle_ratio"],
                 "stale_ratio": summary["algo/stale_ratio"],
                 "partial_ratio": summary["algo/partial_ratio"],
                 "version_gap_max": summary["algo/version_gap_max"],
                 "version_gap_hist": summary["algo/version_gap_hist"]}
  out["notes"] = list(profile.notes)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_versions", type=int, default=40)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--gpus", default="32,64,128")
  parser.add_argument("--exponents", default="0,1", help="sensitivity rows (learner exponent)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  began = time.perf_counter()
  spec = published.load_published()
  consistency = published.table_consistency(spec)
  table = {}
  for gpus in [int(g) for g in args.gpus.split(",")]:
    pub = spec["published"][str(gpus)]
    wanted = list(MODE_ROWS) if gpus == 128 else ["async_partial_s0.5"]
    pred = predict(gpus, wanted, args.num_versions, args.seed)
    row = {"split": pub["split"], "published_sync_step_s": pub["sync_step_s"],
           "predicted_sync_step_s": pred["sync"]["step_s"],
           "published_async_step_s": pub["async_step_s"],
           "predicted_async_step_s": pred["async_partial_s0.5"]["step_s"],
           "published_speedup_400_steps": pub["speedup_400_steps"],
           "published_speedup_100_steps": pub["speedup_100_steps"],
           "predicted_speedup": pred["async_partial_s0.5"]["speedup"],
           "error_vs_400_steps": pred["async_partial_s0.5"]["speedup"] / pub[
               "speedup_400_steps"] - 1,
           "predicted": pred}
    row["within_15_percent"] = abs(row["error_vs_400_steps"]) <= 0.15
    if gpus == 128:
      modes = spec["published"]["128_modes"]
      row["modes"] = {name: {"published_speedup": pub["sync_step_s"] / modes[label],
                             "predicted_speedup": pred[name]["speedup"],
                             "error": pred[name]["speedup"] * modes[label] / pub["sync_step_s"]
                             - 1} for name, label in MODE_ROWS.items()}
    row["learner_exponent_sensitivity"] = {
        exponent: predict(gpus, ["async_partial_s0.5"], args.num_versions, args.seed,
                          float(exponent))["async_partial_s0.5"]["speedup"]
        for exponent in args.exponents.split(",") if exponent}
    row["published_consistency"] = consistency[str(gpus)]
    table[str(gpus)] = row
    largest = consistency[str(gpus)]["largest_speedup"]
    print(f"{gpus} GPUs: predicted {row['predicted_speedup']:.2f}x, published "
          f"{row['published_speedup_400_steps']:.2f}x (400 steps); the learner bound allows "
          + ", ".join(f"{v:.2f}x ({k})" for k, v in largest.items()),
          file=sys.stderr, flush=True)
  line = {"benchmark": "sim_verl", "num_versions": args.num_versions, "seed": args.seed,
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "load_average": os.getloadavg()[0], "elapsed_s": time.perf_counter() - began,
          "gpus": table}
  return common.emit_result(line, args.out)


if __name__ == "__main__":
  sys.exit(main())
