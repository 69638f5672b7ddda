"""Weight sync MB/s of both channels, tiny and ~100x ('small') model; prints one JSON line.

  python benchmarks/sync_bench.py [--repeats 5] [--warmup 1] [--presets tiny small] [--out PATH]
                                  [--cross_process]

The learner holds its params on devices 0-3 (MeshShape(fsdp=4)), the rollout side fetches onto
devices 4-7 (MeshShape(fsdp=2, tensor=2)), so every sync changes devices and layout. On a CPU
the 8 devices are forced host devices. One timed sync is:
- device: `publish` (device_put onto the rollout shardings, blocked until ready) + `fetch`;
- store: `publish` (orbax save into a temp directory) -> version announced (on disk) -> `fetch`
  (restore onto the rollout shardings, blocked until ready).
Both backends are timed on the same params, alternating, `--warmup` untimed rounds first; the
median of `--repeats` rounds is reported. MB/s = param bytes / median latency (MB = 1e6 bytes).
For the store, `publish_blocking_s` is how long publish holds the learner and `announce_s` the
channel's own publish -> announced latency.

`--cross_process` adds the channels between processes: this process publishes (the learner), a
spawned child (a rollout server, on its own default device) waits for the version, fetches it
and reports when the params are ready there. One timed sync is publish -> ready in the child,
for shared memory (`runtime.shm_channel`) and for the orbax store: `<preset>_shm_xproc_*` and
`<preset>_store_xproc_*`.

The weight store of `sync_backend='store'` (staged, checked versions and delta publishes of bf16
weights, sync/store_channel.py) is measured beside shared memory by benchmarks/store_bench.py.
"""

from __future__ import annotations

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from common import emit_json_line  # noqa: E402  (benchmarks/ is on sys.path)

from jaxrl_async import model, sharding  # noqa: E402
from jaxrl_async.sync import DeviceTransferChannel, OrbaxStoreChannel, tree_bytes  # noqa: E402

LEARNER_SHAPE = sharding.MeshShape(fsdp=4)
ROLLOUT_SHAPE = sharding.MeshShape(fsdp=2, tensor=2)
TIMEOUT_S = 120.0


def sync_device(channel: DeviceTransferChannel, version: int, params) -> float:
  began = time.perf_counter()
  channel.publish(version, params)
  _, fetched = channel.fetch()
  jax.block_until_ready(fetched)
  return time.perf_counter() - began


def sync_store(channel: OrbaxStoreChannel, version: int, params) -> tuple[float, float]:
  """(publish -> fetched seconds, seconds publish blocked the caller)."""
  began = time.perf_counter()
  channel.publish(version, params)
  blocking = time.perf_counter() - began
  if channel.wait_for_version(version - 1, timeout=TIMEOUT_S) < version:
    raise TimeoutError(f"version {version} not announced within {TIMEOUT_S} s")
  fetched_version, fetched = channel.fetch()
  jax.block_until_ready(fetched)
  if fetched_version != version:
    raise RuntimeError(f"fetched version {fetched_version}, expected {version}")
  return time.perf_counter() - began, blocking


def bench_preset(name: str, learner_mesh, rollout_mesh, repeats: int, warmup: int) -> dict:
  config = model.get_config(name)
  decoder = model.init_model(config, seed=0)
  _, host_params = model.split_model(decoder)
  axes = model.param_logical_axes(decoder)
  _, abstract, _ = model.abstract_params(config)
  params = jax.device_put(host_params, sharding.param_shardings(axes, host_params, learner_mesh))
  jax.block_until_ready(params)
  nbytes = tree_bytes(params)

  device_channel = DeviceTransferChannel(axes, rollout_mesh)
  device_s, store_s, blocking_s = [], [], []
  with tempfile.TemporaryDirectory(prefix=f"sync_bench_{name}_") as directory:
    store_channel = OrbaxStoreChannel(directory, abstract, axes, rollout_mesh, max_to_keep=2)
    try:
      for round_index in range(warmup + repeats):
        version = round_index + 1
        device_round = sync_device(device_channel, version, params)
        store_round, blocking_round = sync_store(store_channel, version, params)
        if round_index >= warmup:
          device_s.append(device_round)
          store_s.append(store_round)
          blocking_s.append(blocking_round)
    finally:
      store_channel.close()
    announce_s = store_channel.latencies[warmup:]
  assert store_channel.metrics()["sync/bytes"] == (warmup + repeats) * nbytes

  device_median, store_median = statistics.median(device_s), statistics.median(store_s)
  return {
      f"{name}_params": int(sum(np.size(x) for x in jax.tree.leaves(host_params))),
      f"{name}_bytes": nbytes,
      f"{name}_device_mb_per_s": round(nbytes / device_median / 1e6, 2),
      f"{name}_device_latency_s": round(device_median, 5),
      f"{name}_store_mb_per_s": round(nbytes / store_median / 1e6, 2),
      f"{name}_store_latency_s": round(store_median, 5),
      f"{name}_store_publish_blocking_s": round(statistics.median(blocking_s), 5),
      f"{name}_store_announce_s": round(statistics.median(announce_s), 5),
  }


def fetch_in_child(kind: str, location: str, preset: str, versions: int, conn) -> None:
  """In the child: for each version, wait, fetch, block until ready, send (version, time)."""
  from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
  _, abstract, _ = model.abstract_params(model.get_config(preset))
  if kind == "shm":
    channel = SharedMemoryWeightChannel.attach(location, abstract)
  else:
    channel = OrbaxStoreChannel(location, abstract, None)
  conn.send(("ready", time.time()))
  try:
    for version in range(1, versions + 1):
      if channel.wait_for_version(version - 1, timeout=TIMEOUT_S) < version:
        raise TimeoutError(f"version {version} not seen within {TIMEOUT_S} s")
      got, params = channel.fetch()
      jax.block_until_ready(params)
      conn.send((got, time.time()))
  finally:
    channel.close()


def bench_cross_process(name: str, repeats: int, warmup: int) -> dict:
  import multiprocessing as mp

  from jaxrl_async.backends.processes import child
  from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
  config = model.get_config(name)
  decoder = model.init_model(config, seed=0)
  _, params = model.split_model(decoder)
  _, abstract, _ = model.abstract_params(config)
  nbytes = tree_bytes(params)
  out = {}
  for kind in ("shm", "store"):
    with tempfile.TemporaryDirectory(prefix=f"sync_bench_{name}_") as directory:
      if kind == "shm":
        channel = SharedMemoryWeightChannel.create(abstract)
        location = channel.name
      else:
        channel = OrbaxStoreChannel(directory, abstract, None)
        location = directory
      parent, child_end = mp.get_context("spawn").Pipe()
      reader = child.spawn(f"{fetch_in_child.__module__}:fetch_in_child",
                           (kind, location, name, warmup + repeats, child_end),
                           name=f"sync-reader-{kind}")
      child_end.close()
      latencies = []
      try:
        if not parent.poll(TIMEOUT_S * 2):
          raise TimeoutError("the reader process did not start")
        parent.recv()
        for version in range(1, warmup + repeats + 1):
          began = time.time()
          channel.publish(version, params)
          if not parent.poll(TIMEOUT_S):
            raise TimeoutError(f"the reader did not fetch version {version}")
          got, ready_at = parent.recv()
          if got != version:
            raise RuntimeError(f"the reader fetched version {got}, expected {version}")
          if version > warmup:
            latencies.append(ready_at - began)
      finally:
        child.reap(reader)
        channel.close()
        parent.close()
    median = statistics.median(latencies)
    out[f"{name}_{kind}_xproc_mb_per_s"] = round(nbytes / median / 1e6, 2)
    out[f"{name}_{kind}_xproc_latency_s"] = round(median, 5)
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--presets", nargs="+", default=["tiny", "small"])
  parser.add_argument("--out", default=None, help="also write the JSON line to this file")
  parser.add_argument("--cross_process", action="store_true",
                      help="also time shared memory and the store between two processes")
  args = parser.parse_args()
  if args.repeats < 1 or args.warmup < 0:
    parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats}, {args.warmup}")
  learner_devices, rollout_devices = sharding.split_devices(4, 4)
  learner_mesh = sharding.make_mesh(LEARNER_SHAPE, learner_devices)
  rollout_mesh = sharding.make_mesh(ROLLOUT_SHAPE, rollout_devices)
  result = {
      "benchmark": "sync_bench",
      "platform": jax.devices()[0].platform,
      "learner": f"devices {[d.id for d in learner_devices]} {LEARNER_SHAPE}",
      "rollout": f"devices {[d.id for d in rollout_devices]} {ROLLOUT_SHAPE}",
      "repeats": args.repeats, "warmup": args.warmup,
  }
  for name in args.presets:
    result.update(bench_preset(name, learner_mesh, rollout_mesh, args.repeats, args.warmup))
    if args.cross_process:
      result.update(bench_cross_process(name, args.repeats, args.warmup))
  emit_json_line(result, args.out)


if __name__ == "__main__":
  main()
