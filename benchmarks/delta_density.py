"""Changed bf16 elements per version and bytes per delta publish of a run that used the weight
store with deltas; prints one JSON line.

  python benchmarks/delta_density.py RUN_DIR [--skip 1] [--out PATH]

RUN_DIR is a run made with `RunConfig.sync_backend = 'store'`, `RunConfig.sync_delta = True` and
`RunConfig.rollout_param_dtype = 'bfloat16'`; its `weights/published.jsonl` has one line per
committed version (`sync/store_channel.py`): the elements whose bits changed against the
previous committed version, the payload bytes written and whether the version went full or as
a delta. `--skip` leaves out the first versions (the first publish is full and has nothing to
compare with). Reported: the density (changed / elements) per version as min, median, p90, max
and mean over the versions; bytes per delta version against a full version's; how many
versions went full (the first, every `sync_full_every`-th, after a reader asked for one); and
the rollout side's loads (`weights/loads/*.jsonl`): how many there were and how many ended at a
digest other than the one published for their version (the digest names every leaf's CRC-32,
which a delta's result is checked against as it is applied; 0 means every load was, leaf by
leaf, the full version).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit_json_line


def read_published(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, "weights", "published.jsonl")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{path} not found: was the run made with "
                            "RunConfig.sync_backend = 'store'?")
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def read_loads(run_dir: str) -> list[dict]:
  """Every rollout server's loads, in no particular order."""
  directory = os.path.join(run_dir, "weights", "loads")
  loads = []
  for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
    with open(os.path.join(directory, name), encoding="utf-8") as f:
      loads += [json.loads(line) for line in f if line.strip()]
  return loads


def check_loads(published: list[dict], loads: list[dict]) -> dict:
  """How many loads there were and how many ended at another digest than their version's."""
  digests = {line["version"]: line["digest"] for line in published}
  wrong = [load for load in loads if digests.get(load["version"]) != load["digest"]]
  return {"loads": len(loads), "loads_digest_mismatch": len(wrong)}


def quantile(values: list[float], q: float) -> float:
  ordered = sorted(values)
  return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(lines: list[dict], skip: int = 1) -> dict:
  """The figures of a run's published.jsonl lines (module docstring)."""
  measured = [line for line in lines[skip:] if line["changed"] >= 0]
  if not measured:
    raise ValueError(f"no version after the first {skip} has a count of changed elements")
  densities = [line["changed"] / max(line["elements"], 1) for line in measured]
  deltas = [line["bytes"] for line in measured if line["kind"] == "delta"]
  fulls = [line["bytes"] for line in lines if line["kind"] == "full"]
  out = {"versions": len(lines), "versions_measured": len(measured),
         "elements": measured[0]["elements"],
         "density_min": min(densities), "density_median": statistics.median(densities),
         "density_p90": quantile(densities, 0.9), "density_max": max(densities),
         "density_mean": sum(line["changed"] for line in measured)
         / sum(line["elements"] for line in measured),
         "versions_full": len(fulls), "versions_delta": len(deltas)}
  if fulls:
    out["full_bytes"] = statistics.median(fulls)
  if deltas:
    out.update({"delta_bytes_median": statistics.median(deltas), "delta_bytes_max": max(deltas)})
    if fulls:
      out["delta_over_full_median"] = out["delta_bytes_median"] / out["full_bytes"]
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("run_dir")
  parser.add_argument("--skip", type=int, default=1)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  published = read_published(args.run_dir)
  figures = {"run_dir": args.run_dir, **summarize(published, args.skip),
             **check_loads(published, read_loads(args.run_dir))}
  emit_json_line(figures, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
