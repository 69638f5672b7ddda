"""The weight channel contract (publish, fetch, wait, versions only grow) over the in-process
device channel, the orbax store and shared memory; and the two cross-process channels read by
another process while the learner publishes: every copy read is one whole version."""

import json
import os
import threading
import time

import jax
import numpy as np
import pytest

from jaxrl_async.backends.processes import child
from jaxrl_async.sync import DeviceTransferChannel, OrbaxStoreChannel, futex
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel

from .children import filled, tiny_abstract

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def abstract():
  return tiny_abstract()


@pytest.fixture(params=["device", "store", "shm"])
def channel(request, abstract, tmp_path):
  if request.param == "device":
    made = DeviceTransferChannel(None)
  elif request.param == "store":
    made = OrbaxStoreChannel(tmp_path / "weights", abstract, None)
  else:
    made = SharedMemoryWeightChannel.create(abstract)
  yield made
  made.close()


def wait_announced(channel, version):
  assert channel.wait_for_version(version - 1, timeout=TIMEOUT_S) >= version


def values_of(params) -> set[float]:
  return {float(v) for leaf in jax.tree.leaves(params) for v in np.unique(np.asarray(leaf))}


def test_nothing_before_the_first_publish(channel):
  assert channel.latest_version() == -1
  with pytest.raises(LookupError):
    channel.fetch()
  assert channel.wait_for_version(-1, timeout=0.01) == -1


def test_fetch_returns_the_newest_version_whole(channel, abstract):
  for version in (1, 2, 5):
    channel.publish(version, filled(abstract, float(version)))
    wait_announced(channel, version)
  version, params = channel.fetch()
  assert version == 5 == channel.latest_version()
  assert values_of(params) == {5.0}
  assert jax.tree.structure(params) == jax.tree.structure(abstract)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(abstract)):
    assert got.shape == want.shape and got.dtype == want.dtype


def test_versions_only_grow(channel, abstract):
  channel.publish(3, filled(abstract, 3.0))
  wait_announced(channel, 3)
  for stale in (3, 2):
    with pytest.raises(ValueError, match="not newer"):
      channel.publish(stale, filled(abstract, 0.0))
  assert channel.fetch()[0] == 3


def test_a_waiter_wakes_on_publish(channel, abstract):
  result = {}
  waiter = threading.Thread(
      target=lambda: result.update(latest=channel.wait_for_version(0, timeout=TIMEOUT_S)),
      name="channel-waiter")
  waiter.start()
  channel.publish(1, filled(abstract, 1.0))
  waiter.join(TIMEOUT_S)
  assert not waiter.is_alive() and result == {"latest": 1}


def test_sync_metrics_count_bytes_and_publishes(channel, abstract):
  for version in (1, 2):
    channel.publish(version, filled(abstract, 1.0))
    wait_announced(channel, version)
  channel.close()  # the store's last save is announced by then
  nbytes = sum(a.size * np.dtype(a.dtype).itemsize for a in jax.tree.leaves(abstract))
  metrics = channel.metrics()
  assert metrics["sync/publishes"] == 2 and metrics["sync/bytes"] == 2 * nbytes


def test_shared_memory_rejects_params_of_another_shape(abstract):
  channel = SharedMemoryWeightChannel.create(abstract)
  try:
    wrong = jax.tree.map(lambda a: np.zeros((a.shape[0] + 1,) + a.shape[1:], a.dtype),
                         abstract)
    with pytest.raises(ValueError, match="shape"):
      channel.publish(1, wrong)
    with pytest.raises(ValueError, match="fewer"):
      SharedMemoryWeightChannel.attach(channel.name, jax.tree.map(
          lambda a: np.zeros((a.shape[0] * 4,) + a.shape[1:], a.dtype), abstract))
  finally:
    channel.close()


@pytest.mark.skipif(not futex.AVAILABLE, reason="no futexes: shared memory is polled")
def test_a_publish_wakes_a_reader_in_another_process(abstract, tmp_path):
  """The reader looks at the header only every 600 s: it returns within TIMEOUT_S only if the
  publish woke it (a lost wake-up, or a wait that polls, keeps it asleep past the deadline)."""
  channel = SharedMemoryWeightChannel.create(abstract)
  out = str(tmp_path / "woken.json")
  reader = child.spawn("tests.backends.children:wait_for_a_version",
                       (channel.name, out, 600.0), name="channel-sleeper")
  try:
    deadline = time.monotonic() + 120.0
    while not os.path.exists(out + ".ready"):
      assert reader.is_alive() and time.monotonic() < deadline, "the reader did not start"
      time.sleep(0.05)
    reader.join(0.5)  # most likely asleep on the wake word by now
    channel.publish(1, filled(abstract, 1.0))
    reader.join(TIMEOUT_S)
    assert reader.exitcode == 0, "the reader was not woken by the publish"
    with open(out, encoding="utf-8") as f:
      assert json.load(f) == {"latest": 1}
  finally:
    child.kill(reader)
    channel.close()


def test_a_reader_in_this_process_is_woken_without_rechecks(abstract):
  channel = SharedMemoryWeightChannel.create(abstract)
  reader = SharedMemoryWeightChannel.attach(channel.name, abstract, recheck_s=600.0)
  result = {}
  waiter = threading.Thread(
      target=lambda: result.update(latest=reader.wait_for_version(0, timeout=600.0)),
      name="shm-waiter", daemon=True)
  try:
    waiter.start()
    waiter.join(0.2)
    channel.publish(1, filled(abstract, 1.0))
    waiter.join(TIMEOUT_S)
    assert not waiter.is_alive() and result == {"latest": 1}
  finally:
    reader.close()
    channel.close()


@pytest.mark.parametrize("kind, versions", [("shm", 2000), ("store", 6)])
def test_another_process_reads_only_whole_versions(kind, versions, abstract, tmp_path):
  """The child reads as fast as it can while this process publishes back to back."""
  if kind == "shm":
    channel = SharedMemoryWeightChannel.create(abstract)
    location = channel.name
  else:
    location = str(tmp_path / "weights")
    channel = OrbaxStoreChannel(location, abstract, None)
  out = str(tmp_path / "reads.json")
  reader = child.spawn("tests.backends.children:read_consistently",
                       (kind, location, versions, out), name="channel-reader")
  try:
    channel.publish(1, filled(abstract, 1.0))
    deadline = time.monotonic() + 120.0
    while not os.path.exists(out + ".ready"):
      assert reader.is_alive() and time.monotonic() < deadline, "the reader did not start"
      time.sleep(0.05)
    for version in range(2, versions + 1):
      channel.publish(version, filled(abstract, float(version)))
    reader.join(120.0)
    assert reader.exitcode == 0, f"the reader exited with {reader.exitcode}"
  finally:
    child.reap(reader)
    channel.close()
  with open(out, encoding="utf-8") as f:
    reads = json.load(f)["reads"]
  assert reads and reads[-1][0] == versions
  for version, values in reads:
    assert values == [float(version)], f"a copy mixed versions: {version} holds {values}"
  assert [v for v, _ in reads] == sorted(v for v, _ in reads)
  assert len(reads) > 2, "the reader should have read while versions were being published"


def test_shared_memory_moves_every_dtype_and_shape_bit_for_bit():
  """Every dtype, a scalar and an empty leaf come back from the slot exact, on the device and
  as host arrays."""
  rng = np.random.default_rng(0)
  params = {"w": rng.standard_normal((3, 5)).astype(np.float32),
            "half": jax.numpy.asarray(rng.standard_normal(7), jax.numpy.bfloat16),
            "step": np.int32(-7), "ids": np.arange(-3, 6, dtype=np.int8),
            "mask": np.array([True, False, True]), "none": np.zeros((0, 4), np.float32),
            "odd": np.array([3e38, -np.inf, np.nan], np.float32)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
  channel = SharedMemoryWeightChannel.create(abstract)
  reader = SharedMemoryWeightChannel.attach(channel.name, abstract)
  try:
    channel.publish(1, jax.device_put(params))
    version, fetched = reader.fetch()
    _, host = reader.read_host()
    assert version == 1
    for name, value in params.items():
      for got in (fetched[name], host[name]):
        assert got.dtype == np.asarray(value).dtype and got.shape == np.shape(value), name
        np.testing.assert_array_equal(np.asarray(got).reshape(-1).view(np.uint8),
                                      np.asarray(value).reshape(-1).view(np.uint8))
  finally:
    reader.close()
    channel.close()
