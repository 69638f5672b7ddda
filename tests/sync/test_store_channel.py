"""The weight store: deltas equal full publishes bit for bit at every version, a corrupted
delta is caught and replaced by a full publish, a publish that fails half way is never seen, a
load that raises is counted and retried, and every load's digest is the published one."""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from jaxrl_async import faults, model
from jaxrl_async.sync import delta as delta_lib
from jaxrl_async.sync import store_channel
from jaxrl_async.sync import store_format as fmt
from jaxrl_async.sync.store_channel import TensorStoreChannel

TIMEOUT_S = 30.0
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture(scope="module")
def tiny():
  config = model.get_config("tiny")
  _, params = model.split_model(model.init_model(config, seed=0))
  _, abstract, _ = model.abstract_params(config)
  return jax.device_get(params), abstract


@pytest.fixture
def channels(tmp_path, tiny):
  """open(directory, **kwargs) -> a channel, closed after the test (faults reset too)."""
  made = []

  def open_channel(directory="weights", **kwargs):
    kwargs.setdefault("rollout_dtype", "bfloat16")
    channel = TensorStoreChannel(tmp_path / directory, tiny[1], log=lambda *_: None, **kwargs)
    made.append(channel)
    return channel

  yield open_channel
  faults.configure(None)
  for channel in made:
    channel.close()


def learning_steps(params, versions, seed=0):
  """Params after each of `versions` small steps, as an optimizer would move them."""
  rng = np.random.default_rng(seed)
  for _ in range(versions):
    params = jax.tree.map(lambda x: x + np.float32(1e-3) * rng.standard_normal(x.shape)
                          .astype(np.float32) * np.abs(x), params)
    yield params


def publish_and_fetch(writer, reader, version, params):
  writer.publish(version, params)
  assert writer.wait_for_version(version - 1, TIMEOUT_S) == version
  assert reader.wait_for_version(version - 1, TIMEOUT_S) >= version
  return reader.fetch()


def manifest(directory, version) -> dict:
  with open(os.path.join(directory, str(version), fmt.MANIFEST), encoding="utf-8") as f:
    return json.load(f)


def jsonl(path) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def bits_of(params):
  return [delta_lib.bits(np.asarray(leaf)) for leaf in jax.tree.leaves(params)]


def test_deltas_equal_full_publishes_bit_for_bit_at_every_version(channels, tiny):
  delta_writer = channels("delta", delta=True, full_every=5)
  delta_reader = channels("delta", delta=True)
  full_writer, full_reader = channels("full"), channels("full")
  for version, params in enumerate(learning_steps(tiny[0], 7), start=1):
    got_delta = publish_and_fetch(delta_writer, delta_reader, version, params)
    got_full = publish_and_fetch(full_writer, full_reader, version, params)
    assert got_delta[0] == got_full[0] == version
    expected = [delta_lib.bits(x) for x in delta_lib.cast_leaves(
        [np.asarray(x) for x in jax.tree.leaves(params)], "bfloat16")]
    for a, b, want in zip(bits_of(got_delta[1]), bits_of(got_full[1]), expected):
      assert a.dtype == np.uint16 and np.array_equal(a, want) and np.array_equal(b, want)
  sent = delta_writer.metrics()
  assert sent["sync/publishes_delta"] == 5 and sent["sync/publishes_full"] == 2  # 1 and 5
  assert sent["sync/bytes"] < full_writer.metrics()["sync/bytes"]
  assert 0 < sent["sync/delta_density_mean"] < 1
  assert delta_reader.reader_state()["counts"]["loads_delta"] == 5


def corrupt_payload(directory, version):
  """Flips one byte in the middle of a version's stored payload (its first chunk)."""
  path = os.path.join(directory, str(version), fmt.PAYLOAD, "0")
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0xFF]))


def test_a_corrupted_delta_is_caught_and_a_full_publish_replaces_it(channels, tiny, tmp_path):
  writer = channels(delta=True, full_every=100)
  reader = channels(delta=True)
  steps = learning_steps(tiny[0], 4)
  for version in (1, 2):
    assert publish_and_fetch(writer, reader, version, next(steps))[0] == version
  params = next(steps)
  writer.publish(3, params)
  assert writer.wait_for_version(2, TIMEOUT_S) == 3
  assert manifest(tmp_path / "weights", 3)["kind"] == "delta"
  corrupt_payload(tmp_path / "weights", 3)
  held_version, _ = reader.fetch()
  assert held_version == 2  # the corrupted version is not used; the one held stays
  counts = reader.reader_state()["counts"]
  assert counts["delta_fallbacks"] == 1 and counts["load_failed"] == 1
  assert reader.latest_version() == 2  # no full version yet: nothing newer to load
  final = next(steps)
  got_version, got = publish_and_fetch(writer, reader, 4, final)
  assert got_version == 4
  assert manifest(tmp_path / "weights", 4)["kind"] == "full"
  expected = delta_lib.cast_leaves([np.asarray(x) for x in jax.tree.leaves(final)], "bfloat16")
  for a, want in zip(bits_of(got), expected):
    assert np.array_equal(a, delta_lib.bits(want))


def test_a_publish_that_fails_half_way_is_never_seen(channels, tiny, tmp_path):
  faults.configure("sync.stage=raise@2")
  writer = channels(delta=True)
  reader = channels(delta=True)
  steps = learning_steps(tiny[0], 3)
  assert publish_and_fetch(writer, reader, 1, next(steps))[0] == 1
  writer.publish(2, next(steps))  # staged and checked, then the fault: no flip
  writer._join_pending()
  assert writer.latest_version() == 1 and reader.latest_version() == 1
  assert not (tmp_path / "weights" / "2").exists()
  assert os.listdir(tmp_path / "weights" / fmt.STAGING) == []
  assert writer.metrics()["sync/publish_failed"] == 1
  assert publish_and_fetch(writer, reader, 3, next(steps))[0] == 3
  third = manifest(tmp_path / "weights", 3)
  assert third["kind"] == "delta" and third["base_version"] == 1


def test_a_load_that_raises_is_counted_and_retried(channels, tiny, monkeypatch):
  monkeypatch.setattr(store_channel, "LOAD_RETRY_S", 0.01)
  faults.configure("sync.load=raise@2")
  writer, reader = channels(), channels()
  steps = learning_steps(tiny[0], 2)
  assert publish_and_fetch(writer, reader, 1, next(steps))[0] == 1
  assert publish_and_fetch(writer, reader, 2, next(steps))[0] == 1  # the load raised
  assert reader.reader_state()["counts"]["load_failed"] == 1
  assert reader.wait_for_version(1, TIMEOUT_S) == 2
  assert reader.fetch()[0] == 2


def test_every_load_logs_the_digest_the_writer_published(channels, tiny, tmp_path):
  writer = channels(delta=True, full_every=3)
  reader = channels(delta=True, name="server0")
  for version, params in enumerate(learning_steps(tiny[0], 4), start=1):
    publish_and_fetch(writer, reader, version, params)
  directory = tmp_path / "weights"
  published = {line["version"]: line["digest"] for line in jsonl(directory / "published.jsonl")}
  loads = jsonl(directory / "loads" / "server0.jsonl")
  assert [load["version"] for load in loads] == [1, 2, 3, 4]
  assert all(load["digest"] == published[load["version"]] for load in loads)
  assert reader.reader_state()["digest"] == published[4]
