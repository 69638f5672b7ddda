"""The weight store against shared memory: publish latency, MB/s and bytes per version, full
and delta publishes of bf16 rollout weights; prints one JSON line.

  python benchmarks/store_bench.py [--presets small qwen2.5-0.5b] [--repeats 5] [--warmup 1]
                                   [--density 0.03] [--out PATH]

For each preset (random weights at its shapes) the params move by one synthetic step a version:
a fraction `--density` of each leaf's elements (chosen at random) changes its bf16 value, the
rest keep their bits (the measured density of a real run is in docs/sync.md). Per version and
per channel, one timed sync is publish -> the version announced -> the reader's fetch done
(params on the reader's device); the median of `--repeats` versions after `--warmup`:
- shm: `SharedMemoryWeightChannel` (one host), the bf16 params whole;
- store_full: `TensorStoreChannel`, every version full (staged, checked, flipped, loaded and
  checked against its CRCs);
- store_delta: the same with `delta=True` (full only at the first version).
MB/s is the bf16 params' bytes over the median latency (what a full copy would have to move);
`*_bytes_per_version` is what one version wrote (the store's payload). `*_publish_blocking_s`
is how long `publish` held the caller. Reader and writer are in this process: on one host the
file system's page cache serves the reads, so across hosts add the network's time for the
bytes per version.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
from common import emit_json_line  # benchmarks/ is on sys.path

from jaxrl_async import model
from jaxrl_async.sync import delta as delta_lib
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
from jaxrl_async.sync.store_channel import TensorStoreChannel

TIMEOUT_S = 600.0
DTYPE = "bfloat16"


def preset_params(name: str, seed: int = 0) -> tuple[list[np.ndarray], object]:
  """(bf16 host leaves at the preset's shapes, their tree structure); random normal values
  scaled as an initialised model's (the values do not matter, only sizes and changes)."""
  config = model.get_config(name)
  _, abstract, _ = model.abstract_params(config)
  rng = np.random.default_rng(seed)
  leaves = [(rng.standard_normal(leaf.shape, np.float32) * 0.02) for leaf in
            jax.tree.leaves(abstract)]
  return delta_lib.cast_leaves(leaves, DTYPE), jax.tree.structure(abstract)


def step(leaves: list[np.ndarray], density: float, rng) -> list[np.ndarray]:
  """A copy where a fraction `density` of each leaf's elements changes by one bf16 ulp."""
  out = []
  for leaf in leaves:
    moved = leaf.copy()
    flat = delta_lib.bits(moved)
    picked = rng.random(flat.size) < density
    flat[picked] ^= np.uint16(1)  # the lowest mantissa bit: a different, nearby value
    out.append(moved)
  return out


def time_sync(writer, reader, version: int, params) -> tuple[float, float]:
  """(publish -> fetched seconds, seconds publish held the caller)."""
  began = time.perf_counter()
  writer.publish(version, params)
  blocking = time.perf_counter() - began
  if reader.wait_for_version(version - 1, timeout=TIMEOUT_S) < version:
    raise TimeoutError(f"version {version} not seen within {TIMEOUT_S} s")
  got, fetched = reader.fetch()
  jax.block_until_ready(fetched)
  if got != version:
    raise RuntimeError(f"fetched version {got}, expected {version}")
  return time.perf_counter() - began, blocking


def channels(kind: str, treedef, leaves, directory: str):
  abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(x.shape, x.dtype)
                                          for x in leaves])
  if kind == "shm":
    writer = SharedMemoryWeightChannel.create(abstract)
    return writer, SharedMemoryWeightChannel.attach(writer.name, abstract)
  options = {"delta": kind == "store_delta", "full_every": 10**9, "log": lambda *_: None}
  return (TensorStoreChannel(directory, abstract, **options),
          TensorStoreChannel(directory, abstract, name="reader", **options))


def bench_preset(name: str, repeats: int, warmup: int, density: float) -> dict:
  leaves, treedef = preset_params(name)
  nbytes = sum(leaf.nbytes for leaf in leaves)
  out = {f"{name}_params": int(sum(leaf.size for leaf in leaves)), f"{name}_bf16_bytes": nbytes}
  rng = np.random.default_rng(1)
  versions = [leaves]
  for _ in range(warmup + repeats):
    versions.append(step(versions[-1], density, rng))
  for kind in ("shm", "store_full", "store_delta"):
    with tempfile.TemporaryDirectory(prefix=f"store_bench_{name}_") as directory:
      writer, reader = channels(kind, treedef, leaves, directory)
      latencies, blocking, written = [], [], []
      try:
        for version, version_leaves in enumerate(versions, start=1):
          params = jax.tree.unflatten(treedef, version_leaves)
          before = writer.metrics()["sync/bytes"]
          seconds, held = time_sync(writer, reader, version, params)
          if version > 1 + warmup:  # the first version is full on every channel
            latencies.append(seconds)
            blocking.append(held)
            written.append(writer.metrics()["sync/bytes"] - before)
      finally:
        reader.close()
        writer.close()
    median = statistics.median(latencies)
    out.update({f"{name}_{kind}_latency_s": round(median, 5),
                f"{name}_{kind}_mb_per_s": round(nbytes / median / 1e6, 2),
                f"{name}_{kind}_publish_blocking_s": round(statistics.median(blocking), 5),
                f"{name}_{kind}_bytes_per_version": int(statistics.median(written))})
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--presets", nargs="+", default=["small", "qwen2.5-0.5b"])
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--warmup", type=int, default=1)
  parser.add_argument("--density", type=float, default=0.03,
                      help="fraction of bf16 elements that change per version")
  parser.add_argument("--out", default=None, help="also write the JSON line to this file")
  args = parser.parse_args()
  if args.repeats < 1 or args.warmup < 0 or not 0 <= args.density <= 1:
    parser.error(f"--repeats must be >= 1, --warmup >= 0 and --density in [0, 1], got "
                 f"{args.repeats}, {args.warmup}, {args.density}")
  result = {"benchmark": "store_bench", "platform": jax.devices()[0].platform,
            "dtype": DTYPE, "density": args.density, "repeats": args.repeats,
            "warmup": args.warmup}
  for name in args.presets:
    result.update(bench_preset(name, args.repeats, args.warmup, args.density))
  emit_json_line(result, args.out)


if __name__ == "__main__":
  main()
