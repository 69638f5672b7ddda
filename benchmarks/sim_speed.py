"""How fast the simulator runs: 1,000 policy versions of verl's 128-GPU fully async profile.

    python benchmarks/sim_speed.py --num_versions 1000 --out benchmarks/results/sim_speed

Prints the wall-clock seconds of the simulation (calibration excluded, timed separately), the
events and samples simulated, and two figures to judge the machine by: the load average and
the time of a fixed pure-Python loop (about 0.15 ms on an idle modern core), since the
simulator is single-threaded Python and runs as fast as the core it gets.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from jaxrl_async.sim import published, simulate


def python_loop_ms() -> float:
  return min(timeit.repeat("sum(range(10000))", number=50, repeat=5)) / 50 * 1e3


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_versions", type=int, default=1000)
  parser.add_argument("--gpus", type=int, default=128)
  parser.add_argument("--config", default="async_partial_s0.5")
  parser.add_argument("--fold", type=int, default=None)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  loop_before, load_before = python_loop_ms(), os.getloadavg()[0]
  began = time.perf_counter()
  profile, configs = published.verl_setup(args.gpus, fold=args.fold)
  calibration_s = time.perf_counter() - began
  began = time.perf_counter()
  result = simulate(profile, configs[args.config], num_versions=args.num_versions)
  elapsed = time.perf_counter() - began
  summary = result.summary
  line = {"benchmark": "sim_speed", "gpus": args.gpus, "config": args.config,
          "num_versions": args.num_versions, "simulate_s": elapsed,
          "calibration_s": calibration_s, "events": summary["sim/events"],
          "samples": summary["sim/put"], "rollout_replicas": profile.rollout.replicas,
          "groups_per_version": configs[args.config].groups_per_version,
          "simulated_hours": summary["system/wall_s"] / 3600,
          "load_average": [load_before, os.getloadavg()[0]],
          "python_loop_ms": [loop_before, python_loop_ms()],
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "under_10_s": elapsed < 10.0}
  if args.out:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
      json.dump(line, f, indent=1)
  print(json.dumps(line))
  return 0


if __name__ == "__main__":
  sys.exit(main())
