"""Functions the runtime tests run in spawned child processes (importable by module path)."""

from __future__ import annotations

import json
import os
import time


def tiny_abstract():
  from jaxrl_async import model
  _, abstract, _ = model.abstract_params(model.get_config("tiny"))
  return abstract


def filled(abstract, value: float):
  """Params of the abstract's shapes with every entry equal to `value`."""
  import jax
  import numpy as np
  return jax.tree.map(lambda a: np.full(a.shape, value, a.dtype), abstract)


def read_consistently(kind: str, location: str, last_version: int, out_path: str,
                      timeout: float = 120.0) -> None:
  """Fetches whatever is newest until `last_version` arrives; records, for every fetch, the
  version and the set of values its leaves hold (one value = a consistent copy)."""
  import jax
  import numpy as np

  from jaxrl_async.sync import OrbaxStoreChannel
  from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
  abstract = tiny_abstract()
  if kind == "shm":
    channel = SharedMemoryWeightChannel.attach(location, abstract)
  else:
    channel = OrbaxStoreChannel(location, abstract, None)
  deadline = time.monotonic() + timeout
  reads, seen = [], -1
  try:
    while seen < last_version:
      if time.monotonic() > deadline:
        raise TimeoutError(f"version {last_version} did not come within {timeout} s")
      if channel.wait_for_version(seen, timeout=1.0) <= seen:
        continue
      version, params = channel.fetch()
      values = sorted({float(v) for leaf in jax.tree.leaves(params)
                       for v in np.unique(np.asarray(leaf))})
      reads.append([version, values])
      if seen < 0:  # the writer starts publishing back to back once this file exists
        with open(out_path + ".ready", "w", encoding="utf-8") as f:
          f.write("ready")
      seen = max(seen, version)
  finally:
    channel.close()
  with open(out_path + ".tmp", "w", encoding="utf-8") as f:
    json.dump({"reads": reads, "retries": getattr(channel, "retries", 0)}, f)
  os.replace(out_path + ".tmp", out_path)


def wait_for_a_version(location: str, out_path: str, recheck_s: float) -> None:
  """Attaches to a shared-memory channel whose reader looks at the header only every
  `recheck_s` seconds, waits (timeout recheck_s) for a version > 0 and records what it got."""
  from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
  channel = SharedMemoryWeightChannel.attach(location, tiny_abstract(), recheck_s=recheck_s)
  try:
    with open(out_path + ".ready", "w", encoding="utf-8") as f:
      f.write("ready")
    latest = channel.wait_for_version(0, timeout=recheck_s)
  finally:
    channel.close()
  with open(out_path + ".tmp", "w", encoding="utf-8") as f:
    json.dump({"latest": latest}, f)
  os.replace(out_path + ".tmp", out_path)


def produce_groups(address, authkey, num_groups: int, out_path: str) -> None:
  """Admits and puts `num_groups` whole groups of 2 through a remote buffer client."""
  from jaxrl_async.backends.processes.buffer_service import RemoteBufferClient
  from tests.buffer.factory import make_group
  buffer = RemoteBufferClient(address, authkey, "producer")
  admitted = buffer.acquire_group_slots(num_groups, 30.0)
  for group_id in range(admitted):
    buffer.put_many(make_group(group_id, 2), timeout=30.0)
  buffer.disconnect()
  with open(out_path, "w", encoding="utf-8") as f:
    json.dump({"admitted": admitted}, f)


def sleep_without_death_signal(seconds: float) -> None:
  """Clears the death signal child.spawn set, then sleeps: an orphan, the control case."""
  import ctypes
  ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 0)  # PR_SET_PDEATHSIG, none
  ready = os.environ.get("JAXRL_ASYNC_TEST_ORPHAN_READY")
  if ready:  # the test kills the parent only once the signal is cleared
    with open(ready, "w", encoding="utf-8") as f:
      f.write("cleared")
  time.sleep(seconds)
