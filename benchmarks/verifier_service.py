"""The verifier service's own CPU per request, and its callers'; prints one JSON line.

  python benchmarks/verifier_service.py [--callers 8] [--requests_per_caller 2000] [--repeats 3]

Starts the RLVR task's verifier service (`VerifierProcess`, the task's settings: concurrency 6,
time_scale 0.0002, so a median request sleeps 60 us), then `--callers` threads in this process
each send `--requests_per_caller` verify requests in turn over their own connection. Reported
per pass: requests/s, the service process's CPU (user + system) per request and this
process's CPU per request (the callers: encode, send, receive, decode), in microseconds; and the
median over the passes. In a run on two cores the service's and the callers' CPU comes out of
the cores the rollout and the learner share, so it is part of every RLVR figure.
`--out PATH` also writes the JSON line to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.workload_bound import processes_cpu_s
from jaxrl_async.tasks.verifier_service import VerifierProcess, VerifierSettings

RLVR_SETTINGS = VerifierSettings(concurrency=6, time_scale=0.0002, call_timeout_s=8.0)


def one_pass(process: VerifierProcess, callers: int, per_caller: int, first_id: int) -> dict:
  client = process.client()
  service = [psutil.Process(process.process.pid)]
  prompt, response = [5, 6, 7, 8, 9, 10, 11], [11, 10, 9, 8, 7, 6, 5, 2]

  def call(k: int) -> None:
    for i in range(first_id + k * per_caller, first_id + (k + 1) * per_caller):
      if client.verify(i, prompt, response).reward != 1.0:
        raise AssertionError(f"request {i}: a right answer was scored wrong")

  threads = [threading.Thread(target=call, args=(k,)) for k in range(callers)]
  service_began, callers_began = processes_cpu_s(service), time.process_time()
  began = time.perf_counter()
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  wall_s = time.perf_counter() - began
  requests = callers * per_caller
  return {"requests": requests, "requests_per_s": round(requests / wall_s),
          "service_cpu_us": round((processes_cpu_s(service) - service_began)
                                  / requests * 1e6, 1),
          "callers_cpu_us": round((time.process_time() - callers_began) / requests * 1e6, 1)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--callers", type=int, default=8)
  parser.add_argument("--requests_per_caller", type=int, default=2000)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args()
  process = VerifierProcess.start(RLVR_SETTINGS)
  try:
    load_began = os.getloadavg()[0]
    one_pass(process, args.callers, 50, 10**9)  # connections opened, code paths warm
    passes = [one_pass(process, args.callers, args.requests_per_caller,
                       p * args.callers * args.requests_per_caller) for p in range(args.repeats)]
  finally:
    process.stop()
  result = {"benchmark": "verifier_service", "callers": args.callers,
            "settings": {"concurrency": RLVR_SETTINGS.concurrency,
                         "time_scale": RLVR_SETTINGS.time_scale},
            "passes": passes,
            **{f"median_{key}": statistics.median(p[key] for p in passes)
               for key in ("requests_per_s", "service_cpu_us", "callers_cpu_us")},
            "load_1m": [round(load_began, 2), round(os.getloadavg()[0], 2)]}
  line = json.dumps(result)
  print(line)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
