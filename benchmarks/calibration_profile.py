"""The async profile of a calibration: a sync run's fitted profile with the parameters a sync
run cannot show (benchmarks/sim_calibration.py, docs/simulator.md), each measured once: the
layout and contentions (from the concurrency ceiling or from an async run's spans), the buffer's
cost per sample, the hand-off latency and the run's edges."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

from benchmarks import common
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.sim import calibrate, simulate
from jaxrl_async.sinks import SPANS_FILE, read_spans

RESULTS = common.RESULTS


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


def buffer_cost(backend: str) -> tuple[float, str]:
  """Threads: 0 (the buffer is in-process, as in the sync run); processes: the newest stored
  cross-process buffer_throughput figure (columnar transport, a step's groups in one put)
  against the newest in-process one."""
  if backend == "threads":
    return 0.0, "threads: in-process buffer, as in the sync run"
  cross, cross_name = common.newest_result("buffer_throughput-cross_process-*.json",
                                    lambda r: "columnar_x4" in r.get("transports", {}))
  local, local_name = common.newest_result("buffer_throughput-*", lambda r: "samples_per_s_1_producer"
                                    in r and r.get("side", "new") == "new")
  if cross is None or local is None:
    return 0.0, f"not measured ({cross_name}; {local_name})"
  cross_rate = cross["transports"]["columnar_x4"]["samples_per_s"]
  local_rate = local["samples_per_s_1_producer"]
  return (calibrate.buffer_s_per_sample(cross_rate, local_rate),
          f"{cross_name}: columnar_x4 {cross_rate:.0f} samples/s; {local_name}: "
          f"{local_rate:.0f} samples/s in-process")


def async_profile_for(profile, backend: str, ceiling: dict | None, handoff_records: list | None,
                      handoff_config, seed: int, contention: float | None = None,
                      handoff_wall_s: float = math.nan, contention_run=None) -> tuple:
  """The sync run's profile with the three once-measured parameters (sim/calibrate.py): the
  layout and contention from `ceiling` (or one given `contention`, no layout), the buffer's
  cost per sample, and the hand-off latency from `handoff_records` (an async run's records,
  simulated under `handoff_config`). `contention_run` (run directory, config, model): the
  roles' slowdowns from that async run instead of the ceiling's (`contention_from_run`)."""
  if contention is not None:
    factors = {"contention": contention, "contention_source": "--contention"}
    used = dataclasses.replace(profile, contention=contention)
  elif backend == "processes":
    factors = calibrate.layout_factors(ceiling)
    used = calibrate.processes_layout(profile, factors)
  else:
    speedup = ceiling["roles"]["speedup"]
    factors = {"contention": max(0.0, 2.0 / speedup - 1.0), "roles_speedup": speedup}
    used = dataclasses.replace(profile, contention=factors["contention"])
  per_sample, buffer_source = buffer_cost(backend)
  used = calibrate.with_recompute(dataclasses.replace(used, buffer_s_per_sample=per_sample))
  if contention_run is not None:
    run_dir, run_config, model = contention_run
    measured = calibrate.contention_from_run(
        used, read_spans(os.path.join(run_dir, SPANS_FILE)),
        read_jsonl(os.path.join(run_dir, "metrics.jsonl")), run_config, seed, model)
    factors.update(ceiling_contention=factors.get("contention"),
                   ceiling_learner_contention=factors.get("learner_contention"),
                   run_contention=measured, contention=measured["rollout"]["contention"],
                   learner_contention=measured["learner"]["contention"])
    if measured["learner"]["model"] == "scale":
      used = calibrate.scaled_learner(used, measured["learner"]["scale"])
    used = dataclasses.replace(used, contention=factors["contention"],
                               learner_contention=factors["learner_contention"])
  handoff = startup = shutdown = 0.0
  if handoff_records is not None:
    simulated = simulate(dataclasses.replace(used, startup_s=0.0), handoff_config,
                         seed=seed).records
    handoff = calibrate.handoff_latency(handoff_records, simulated)
    startup, shutdown = calibrate.run_edges(handoff_records, handoff_wall_s, simulated)
    factors["handoff_measured_p50_s"] = calibrate.median_handoff(handoff_records)
    factors["handoff_simulated_p50_s"] = calibrate.median_handoff(simulated)
  factors.update(handoff_s=handoff, buffer_s_per_sample=per_sample, buffer_source=buffer_source,
                 startup_s=startup, shutdown_s=shutdown)
  if handoff_records is not None:
    used = dataclasses.replace(used, startup_s=startup, shutdown_s=shutdown)
  return dataclasses.replace(used, handoff_s=handoff), factors
