"""verl's published ablations and GPU table, predicted from one profile per GPU count.

    python benchmarks/sim_ablations.py --out benchmarks/results/sim_calibration-verl

`ablations`: the staleness_threshold (0, 0.1, 0.3, 0.5) and require_batches (1, 2, 4) rows of
verl's 128-GPU tables, simulated with the one 128-GPU profile (`published.verl_setup(128)`,
fitted on the published sync run; each row changes one knob, nothing is refitted), set beside
the published rows by shape (`sim/ablations.py`: rising up to where the gain stops, and where).
`table`: at 32, 64 and 128 GPUs the predicted async/sync speedup beside the largest speedup
the published sync run allows (`published.table_consistency`: the async step is at least the
learner's update of it) and the published one. Nothing is fitted to the published async runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common
from benchmarks.sim_verl import predict
from jaxrl_async.sim import ablations, published


def table(gpus_list, num_versions: int, seed: int) -> dict:
  consistency = published.table_consistency()
  out = {}
  for gpus in gpus_list:
    row = consistency[str(gpus)]
    predicted = predict(gpus, ["async_partial_s0.5"], num_versions, seed)
    out[str(gpus)] = {"predicted_speedup": predicted["async_partial_s0.5"]["speedup"],
                      "bound_largest_speedup": row["largest_speedup"],
                      "published_speedup_400_steps": row["published_speedup_400_steps"],
                      "published_exceeds_bound": row["published_exceeds"]}
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--num_versions", type=int, default=20)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--gpus", default="32,64,128")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  began = time.perf_counter()
  shapes = ablations.compare(args.num_versions, args.seed)
  rows = table([int(g) for g in args.gpus.split(",")], args.num_versions, args.seed)
  for knob, result in shapes.items():
    pred, pub = result["predicted_shape"], result["published_shape"]
    print(f"{knob}: predicted saturates at {pred['saturates_at']} (rising {pred['rising']}), "
          f"published at {pub['saturates_at']} (rising {pub['rising']}): same shape "
          f"{result['same_shape']}", file=sys.stderr)
  for gpus, row in rows.items():
    bounds = ", ".join(f"{k} {v:.2f}x" for k, v in row["bound_largest_speedup"].items())
    print(f"{gpus} GPUs: predicted {row['predicted_speedup']:.2f}x; bound {bounds}; "
          f"published {row['published_speedup_400_steps']:.2f}x", file=sys.stderr)
  line = {"benchmark": "sim_ablations", "num_versions": args.num_versions, "seed": args.seed,
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), "load_average": os.getloadavg()[0],
          "elapsed_s": time.perf_counter() - began, "ablations": shapes, "table": rows}
  return common.emit_result(line, args.out)


if __name__ == "__main__":
  sys.exit(main())
