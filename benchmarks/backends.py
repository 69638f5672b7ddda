"""One async mode on several backends, interleaved, same task, seed and sample budget.

    python benchmarks/backends.py --backends ray,processes --repeats 3 --total_samples 12800

Prints one JSON line: per backend, the median over the rounds (and every round's value) of
samples/s, the hand-off intervals' p50 and p99 (`handoff/*` of the run summaries) and the CPU
seconds per sample of the processes this benchmark started (this process, and every process
below it: rollout servers, Ray's workers and daemons), and each backend's samples/s over the
first backend's in the same round (`ratio_to_<first>`); `--out PATH` also writes it to
PATH.json. Each round runs every backend once in
turn, so on a loaded machine the rounds' ratios mean more than the absolute figures; the load
average at the start and end is in the line.

Compilation is kept out as in `modes.py` (the persistent compilation cache, and a warm-up run
per backend first). With 'ray' among the backends and no RAY_ADDRESS, a one-node Ray cluster
on 127.0.0.1 is started for the whole invocation (its start is not in any run's figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import psutil

from benchmarks.modes import run_mode
from jaxrl_async import compilation_cache

BACKENDS = ("threads", "processes", "ray")
HANDOFF_KEYS = ("handoff/publish_to_work_s_p50", "handoff/publish_to_work_s_p99",
                "handoff/publish_to_take_s_p50", "handoff/publish_to_take_s_p99",
                "handoff/publish_to_enqueue_s_p50", "handoff/publish_to_enqueue_s_p99",
                "rollout/swap_fetch_s_mean", "rollout/swap_load_s_mean")


class CpuMeter:
  """CPU seconds (user + system) of this process and of every process below it, sampled every
  `period_s` in a thread so that processes that end between samples keep what they used up to
  their last sample (a process's last moments can be missed: at most one period's CPU)."""

  def __init__(self, period_s: float = 0.25):
    self.period_s = period_s
    self._seen: dict[tuple[int, float], float] = {}  # (pid, create time) -> CPU s
    self._base: dict[tuple[int, float], float] = {}
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._loop, name="cpu-meter", daemon=True)

  def _sample(self) -> None:
    me = psutil.Process()
    for process in [me, *me.children(recursive=True)]:
      with contextlib.suppress(psutil.Error):
        times = process.cpu_times()
        self._seen[(process.pid, process.create_time())] = times.user + times.system

  def _loop(self) -> None:
    while not self._stop.wait(self.period_s):
      self._sample()

  def __enter__(self) -> CpuMeter:
    self._sample()
    self._base = dict(self._seen)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join(10.0)
    self._sample()

  def seconds(self) -> dict[str, float]:
    """CPU seconds used while metered: this process's ('driver') and all the others'."""
    me = os.getpid()
    used = {key: cpu - self._base.get(key, 0.0) for key, cpu in self._seen.items()}
    driver = sum(v for (pid, _), v in used.items() if pid == me)
    return {"driver": driver, "others": sum(used.values()) - driver}


def one_run(mode: str, bindings: list[str], run_dir: str, backend: str) -> dict:
  """One run's figures: samples/s, the hand-off quantiles, CPU seconds per sample."""
  with CpuMeter() as meter:
    result = run_mode(mode, bindings, run_dir, backend)
  summary = result["summary"]
  samples = summary["system/samples_per_s"] * summary["system/wall_s"]  # consumed samples
  cpu = meter.seconds()
  return {"samples_per_s": summary["system/samples_per_s"], "wall_s": summary["system/wall_s"],
          "final_accuracy": summary["eval/accuracy"],
          **{key: summary.get(key) for key in HANDOFF_KEYS},
          "cpu_s_per_sample_driver": cpu["driver"] / samples,
          "cpu_s_per_sample_others": cpu["others"] / samples,
          "cpu_s_per_sample": (cpu["driver"] + cpu["others"]) / samples}


def summarize(rounds: list[dict], backends: list[str]) -> dict:
  """Per backend: the median of each figure over the rounds and every round's value, and the
  ratio of its samples/s to the first backend's of the same round."""
  first = backends[0]
  for row in rounds:
    for backend in backends:
      row[backend][f"ratio_to_{first}"] = (row[backend]["samples_per_s"]
                                           / row[first]["samples_per_s"])
  table = {}
  for backend in backends:
    runs = [row[backend] for row in rounds]
    table[backend] = {key: {"median": float(statistics.median(r[key] for r in runs)),
                            "rounds": [r[key] for r in runs]}
                      for key in runs[0] if all(r[key] is not None for r in runs)}
  return table


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--backends", default="ray,processes",
                      help=f"comma-separated, from {BACKENDS}; ratios are to the first")
  parser.add_argument("--mode", default="async_partial")
  parser.add_argument("--total_samples", type=int, default=12_800)
  parser.add_argument("--warmup_samples", type=int, default=3200)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--out", default=None, help="also write the JSON line to <out>.json")
  args = parser.parse_args(argv)
  backends = [b.strip() for b in args.backends.split(",") if b.strip()]
  unknown = [b for b in backends if b not in BACKENDS]
  if not backends or unknown or len(set(backends)) != len(backends):
    parser.error(f"--backends {args.backends!r}: want distinct names from {BACKENDS}")
  if args.mode == "sync":
    parser.error("--mode sync runs in one process on every backend: choose an async mode")
  if args.repeats < 1 or args.total_samples < 1:
    parser.error("--repeats and --total_samples must be >= 1")
  bindings = [f"RunConfig.total_samples = {args.total_samples}", f"RunConfig.seed = {args.seed}",
              *args.gin_bindings]
  compilation_cache.enable()
  load_start = os.getloadavg()
  rounds = []
  with contextlib.ExitStack() as stack:
    if "ray" in backends and not os.environ.get("RAY_ADDRESS"):
      from jaxrl_async.backends.ray import placement
      cluster = placement.start_local_cluster([{"num_cpus": 2}])
      stack.callback(placement.stop_local_cluster, cluster)
    root = stack.enter_context(tempfile.TemporaryDirectory())
    if args.warmup_samples:
      warmup = [*bindings, f"RunConfig.total_samples = {args.warmup_samples}"]
      for backend in backends:
        print(f"warming up {backend} ...", file=sys.stderr, flush=True)
        run_mode(args.mode, warmup, os.path.join(root, f"warmup-{backend}"), backend)
    for repeat in range(args.repeats):  # interleaved: each round runs every backend once
      row = {}
      for backend in backends:
        print(f"running {backend} (round {repeat + 1} of {args.repeats}) ...", file=sys.stderr,
              flush=True)
        row[backend] = one_run(args.mode, bindings, os.path.join(root, f"{backend}-{repeat}"),
                               backend)
      rounds.append(row)
  line = {"benchmark": "backends", "mode": args.mode, "backends": backends,
          "total_samples": args.total_samples, "repeats": args.repeats, "seed": args.seed,
          "gin_bindings": args.gin_bindings,
          "load_average": {"start": load_start, "end": os.getloadavg()},
          "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
          "results": summarize(rounds, backends)}
  print(json.dumps(line))
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w", encoding="utf-8") as f:
      json.dump(line, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
