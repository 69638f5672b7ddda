"""VersionedBuffer throughput and queue latency; prints one JSON line.

  python benchmarks/buffer_throughput.py [--samples 96000] [--group_size 8] [--cross_process]

Producers acquire a slot per group and put its samples one by one; one consumer takes
`groups_per_batch` groups per get_groups call and publishes a new version after every
`groups_per_version` groups (an instant weight sync), so the consumer keeps up and admission is
exercised. Samples are built before the timed region. Reported: samples/s through put + get
with 1 and with 4 producer threads, and p50 / p99 enqueue -> consume latency in ms over every
sample of the 4-producer run (1-producer figures are reported too), beside the same 4 producer
threads through a plain `queue.Queue` bounded at the buffer's capacity (`bare_queue_*`: the
floor Python threads put under an in-process queue on this machine).

`--cross_process`: the buffer is served by `runtime.buffer_service` (the learner's side) and
`--producer_processes` spawned processes (default 2) admit up to K groups per
`acquire_group_slots` call and put the admitted ones with one `put_many` call over the real
transport (multiprocessing.connection on 127.0.0.1), for each K of `--groups_per_put` (default
1,4: a rollout step of continuous batching can finish several groups at once, and the rollout
servers put what one step finished in one call); the consumer takes groups in the buffer's own
process, as the learner does. It runs once per transport of `--transports` (default: 'pickle',
every Sample pickled, then 'columnar', one `wire.encode_samples` blob per batch) and K, and
reports them side by side: samples/s through put +
get, p50 / p99 latency from the producer's send (stamped 'created' just before `put_many`) to
`get_groups` returning, in ms, and the 1-minute load average at the start and end of each run.
`--out PATH` also writes the JSON line to PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import threading
import time

import numpy as np

from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.types import Sample

TIMEOUT_S = 60.0


def make_samples(num_groups: int, group_size: int, first_group_id: int) -> list[list[Sample]]:
  groups = []
  for group_id in range(first_group_id, first_group_id + num_groups):
    groups.append([
        Sample(prompt_id=group_id, group_id=group_id, group_size=group_size,
               prompt_tokens=np.arange(16, dtype=np.int32),
               response_tokens=np.arange(32, dtype=np.int32),
               behaviour_logprobs=np.full((32,), -1.0, np.float32),
               token_versions=np.zeros((32,), np.int32), finish_reason="eos",
               reward=float(index % 2), reward_status="ok", meta={"index_in_group": index})
        for index in range(group_size)
    ])
  return groups


def run_threads(produce, consume, work: list) -> float:
  """One producer thread per entry of `work` and one consumer thread; the seconds until all
  have finished."""
  threads = [threading.Thread(target=produce, args=(groups,), name=f"producer-{p}")
             for p, groups in enumerate(work)]
  threads.append(threading.Thread(target=consume, name="consumer"))
  start = time.perf_counter()
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(TIMEOUT_S * 4)
  return time.perf_counter() - start


def run(num_producers: int, num_samples: int, group_size: int, groups_per_version: int,
        staleness_threshold: float, groups_per_batch: int) -> dict[str, float]:
  num_groups = num_samples // group_size
  per_producer = num_groups // num_producers
  work = [make_samples(per_producer, group_size, p * per_producer) for p in range(num_producers)]
  total_groups = per_producer * num_producers
  budget = int(np.floor((1 + staleness_threshold) * groups_per_version))
  buffer = VersionedBuffer(group_size=group_size, groups_per_version=groups_per_version,
                           staleness_threshold=staleness_threshold, max_version_gap=None,
                           capacity=group_size * budget, clock=time.perf_counter)
  consumed: list[list[Sample]] = []

  def produce(groups: list[list[Sample]]) -> None:
    for group in groups:
      version = buffer.acquire_group_slot(TIMEOUT_S)
      for sample in group:
        sample.token_versions.fill(version)
        buffer.put(sample, TIMEOUT_S)

  def consume() -> None:
    learner_version, in_version = 0, 0
    remaining = total_groups
    while remaining:
      groups = buffer.get_groups(min(groups_per_batch, remaining), learner_version, TIMEOUT_S)
      consumed.extend(groups)
      remaining -= len(groups)
      in_version += len(groups)
      if in_version >= groups_per_version:
        learner_version, in_version = learner_version + 1, in_version - groups_per_version
        buffer.publish_version(learner_version)

  elapsed = run_threads(produce, consume, work)
  buffer.check_invariants()
  latency_ms = 1e3 * np.array([s.timestamps["consumed"] - s.timestamps["enqueued"]
                               for group in consumed for s in group])
  assert latency_ms.size == total_groups * group_size, "samples lost"
  return {"samples_per_s": latency_ms.size / elapsed,
          "latency_ms_p50": float(np.percentile(latency_ms, 50)),
          "latency_ms_p99": float(np.percentile(latency_ms, 99)),
          "admission_wait_s": buffer.metrics()["queue/admission_wait_s"]}


def run_bare_queue(num_producers: int, num_samples: int, group_size: int,
                   groups_per_version: int, staleness_threshold: float,
                   groups_per_batch: int) -> dict[str, float]:
  """The same threads and samples through a plain `queue.Queue` bounded at the buffer's
  capacity instead of the buffer: each producer puts its samples one by one, the consumer takes
  `groups_per_batch` groups' worth at a time. No admission, no group assembly, no versions: the
  floor that Python threads on this machine put under an in-process queue's enqueue -> consume
  latency at that bound (a queue that runs full holds each sample for capacity / throughput)."""
  num_groups = num_samples // group_size
  per_producer = num_groups // num_producers
  work = [make_samples(per_producer, group_size, p * per_producer) for p in range(num_producers)]
  total = per_producer * num_producers * group_size
  budget = int(np.floor((1 + staleness_threshold) * groups_per_version))
  room = threading.BoundedSemaphore(group_size * budget)  # as admission: the wait is not queued
  channel: queue.Queue = queue.Queue()
  latency_s: list[float] = []

  def produce(groups: list[list[Sample]]) -> None:
    for group in groups:
      for sample in group:
        if not room.acquire(timeout=TIMEOUT_S):
          raise TimeoutError("the bare queue's consumer stopped taking samples")
        sample.timestamps["enqueued"] = time.perf_counter()
        channel.put(sample)

  def consume() -> None:
    remaining, batch = total, groups_per_batch * group_size
    while remaining:
      taken = [channel.get(timeout=TIMEOUT_S) for _ in range(min(batch, remaining))]
      now = time.perf_counter()
      for _ in taken:
        room.release()
      latency_s.extend(now - s.timestamps["enqueued"] for s in taken)
      remaining -= len(taken)

  elapsed = run_threads(produce, consume, work)
  latency_ms = 1e3 * np.asarray(latency_s)
  assert latency_ms.size == total, "samples lost"
  return {"samples_per_s": latency_ms.size / elapsed,
          "latency_ms_p50": float(np.percentile(latency_ms, 50)),
          "latency_ms_p99": float(np.percentile(latency_ms, 99))}


def produce_remote(address, authkey, producer: int, num_groups: int, group_size: int,
                   go, transport: str = "columnar", groups_per_put: int = 1) -> None:
  """In a producer process: builds its samples, waits for `go`, then admits and puts them, up
  to `groups_per_put` groups per admission call and per `put_many` (a rollout step that
  finishes several groups puts them together)."""
  from jaxrl_async.backends.processes.buffer_service import RemoteBufferClient
  groups = make_samples(num_groups, group_size, producer * num_groups)
  buffer = RemoteBufferClient(address, authkey, f"producer-{producer}", transport=transport)
  buffer.acquire_group_slots(1, 0)  # connect before the timed region
  buffer.put_many(groups[0], TIMEOUT_S)
  go.wait(TIMEOUT_S)
  index = 1
  while index < len(groups):
    count = buffer.acquire_group_slots(min(groups_per_put, len(groups) - index), TIMEOUT_S)
    if not count:
      continue
    now = time.time()
    batch = [sample for group in groups[index:index + count] for sample in group]
    for sample in batch:
      sample.timestamps["created"] = now
    buffer.put_many(batch, TIMEOUT_S)
    index += count
  buffer.disconnect()


def load_average() -> float:
  return round(os.getloadavg()[0], 2)


def run_cross_process(num_producers: int, num_samples: int, group_size: int,
                      groups_per_version: int, staleness_threshold: float,
                      groups_per_batch: int, transport: str = "columnar",
                      groups_per_put: int = 1) -> dict[str, float]:
  import multiprocessing as mp

  from jaxrl_async.backends.processes import child
  from jaxrl_async.backends.processes.buffer_service import BufferService
  per_producer = num_samples // group_size // num_producers
  budget = int(np.floor((1 + staleness_threshold) * groups_per_version))
  buffer = VersionedBuffer(group_size=group_size, groups_per_version=groups_per_version,
                           staleness_threshold=staleness_threshold, max_version_gap=None,
                           capacity=group_size * budget)
  service = BufferService(buffer).start()
  go = mp.get_context("spawn").Event()
  producers = [child.spawn(f"{produce_remote.__module__}:produce_remote",
                           (service.address, service.authkey, p, per_producer, group_size, go,
                            transport, groups_per_put), name=f"producer-{p}")
               for p in range(num_producers)]
  latencies, consumed_groups = [], 0
  try:
    # Each producer's first group (put before the timed region) proves it is connected.
    first = buffer.get_groups(num_producers, 0, TIMEOUT_S * 4)
    consumed_groups += len(first)
    load_start = load_average()
    start = time.perf_counter()
    go.set()
    learner_version, in_version = 0, len(first)
    remaining = per_producer * num_producers - len(first)
    while remaining:
      groups = buffer.get_groups(min(groups_per_batch, remaining), learner_version, TIMEOUT_S)
      now = time.time()
      latencies += [now - s.timestamps["created"] for g in groups for s in g]
      remaining -= len(groups)
      in_version += len(groups)
      if in_version >= groups_per_version:
        learner_version, in_version = learner_version + 1, in_version - groups_per_version
        buffer.publish_version(learner_version)
    elapsed = time.perf_counter() - start
    load_end = load_average()
    for process in producers:
      process.join(TIMEOUT_S)
      if process.exitcode != 0:
        raise RuntimeError(f"{process.name} exited with {process.exitcode}")
  finally:
    for process in producers:
      child.reap(process)
    buffer.close()
    service.stop()
  buffer.check_invariants()
  latency_ms = 1e3 * np.asarray(latencies)
  return {"samples_per_s": round(latency_ms.size / elapsed),
          "latency_ms_p50": round(float(np.percentile(latency_ms, 50)), 4),
          "latency_ms_p99": round(float(np.percentile(latency_ms, 99)), 4),
          "load_avg_1m_start": load_start, "load_avg_1m_end": load_end}


def cross_process_report(transports: list[str], groups_per_put: list[int], **kwargs) -> dict:
  """One cross-process run per transport and groups-per-put setting, in order, side by side
  (keys 'TRANSPORT' for one group per put, 'TRANSPORT_xK' for K)."""
  results = {}
  for transport in transports:
    for per_put in groups_per_put:
      key = transport if per_put == 1 else f"{transport}_x{per_put}"
      results[key] = run_cross_process(transport=transport, groups_per_put=per_put, **kwargs)
  report = {"benchmark": "buffer_throughput", "mode": "cross_process",
            "transport": "multiprocessing.connection 127.0.0.1, one acquire_group_slots and "
                         "one put_many per K groups (K = 1 unless the key says _xK)",
            "producer_processes": kwargs["num_producers"], "samples": kwargs["num_samples"],
            "group_size": kwargs["group_size"],
            "groups_per_version": kwargs["groups_per_version"],
            "staleness_threshold": kwargs["staleness_threshold"],
            "groups_per_batch": kwargs["groups_per_batch"], "transports": results}
  if "pickle" in results and "columnar" in results:
    report["columnar_vs_pickle_samples_per_s"] = round(
        results["columnar"]["samples_per_s"] / results["pickle"]["samples_per_s"], 2)
  return report


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--samples", type=int, default=96_000)
  parser.add_argument("--group_size", type=int, default=8)
  parser.add_argument("--groups_per_version", type=int, default=16)
  parser.add_argument("--staleness_threshold", type=float, default=1.0)
  parser.add_argument("--groups_per_batch", type=int, default=4)
  parser.add_argument("--cross_process", action="store_true",
                      help="producers in other processes, over the buffer service")
  parser.add_argument("--producer_processes", type=int, default=2)
  parser.add_argument("--transports", default="pickle,columnar",
                      help="comma-separated RemoteBufferClient transports to compare")
  parser.add_argument("--groups_per_put", default="1,4",
                      help="comma-separated groups per admission call and per put_many "
                           "(cross-process runs)")
  parser.add_argument("--out", default=None, help="also write the JSON line to this file")
  args = parser.parse_args()
  kwargs = dict(num_samples=args.samples, group_size=args.group_size,
                groups_per_version=args.groups_per_version,
                staleness_threshold=args.staleness_threshold,
                groups_per_batch=args.groups_per_batch)
  if args.cross_process:
    from jaxrl_async.backends.processes.buffer_service import TRANSPORTS
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown or not transports:
      parser.error(f"--transports: {unknown or 'none'} not in {TRANSPORTS}")
    try:
      per_put = [int(k) for k in args.groups_per_put.split(",") if k.strip()]
    except ValueError:
      parser.error(f"--groups_per_put={args.groups_per_put!r}: comma-separated ints")
    if not per_put or min(per_put) < 1:
      parser.error(f"--groups_per_put={args.groups_per_put!r}: each must be >= 1")
    line = json.dumps(cross_process_report(transports, per_put,
                                           num_producers=args.producer_processes, **kwargs))
    print(line)
    if args.out:
      with open(args.out, "w", encoding="utf-8") as f:
        f.write(line + "\n")
    return
  one = run(num_producers=1, **kwargs)
  four = run(num_producers=4, **kwargs)
  bare = run_bare_queue(num_producers=4, **kwargs)
  line = json.dumps({
      "benchmark": "buffer_throughput",
      "samples": args.samples, "group_size": args.group_size,
      "groups_per_version": args.groups_per_version,
      "staleness_threshold": args.staleness_threshold,
      "groups_per_batch": args.groups_per_batch,
      "samples_per_s_1_producer": round(one["samples_per_s"]),
      "samples_per_s_4_producers": round(four["samples_per_s"]),
      "latency_ms_p50": round(four["latency_ms_p50"], 4),
      "latency_ms_p99": round(four["latency_ms_p99"], 4),
      "latency_ms_p50_1_producer": round(one["latency_ms_p50"], 4),
      "latency_ms_p99_1_producer": round(one["latency_ms_p99"], 4),
      "admission_wait_s_4_producers": round(four["admission_wait_s"], 3),
      # The floor: the same 4 producer threads through a plain queue.Queue.
      "bare_queue_samples_per_s_4_producers": round(bare["samples_per_s"]),
      "bare_queue_latency_ms_p50": round(bare["latency_ms_p50"], 4),
      "bare_queue_latency_ms_p99": round(bare["latency_ms_p99"], 4),
      "latency_p99_over_bare_queue": round(four["latency_ms_p99"] / bare["latency_ms_p99"], 3),
  })
  print(line)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(line + "\n")


if __name__ == "__main__":
  main()
