"""The weight channel: resharding between disjoint meshes, the orbax store, versions, metrics.

The learner holds its params on devices 0-3 (fsdp=4), the rollout side on devices 4-7
(fsdp=2 x tensor=2), so every transfer really changes both the devices and the layout.
"""

import math
import threading

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_async import model, sharding
from jaxrl_async.sync import DeviceTransferChannel, OrbaxStoreChannel, tree_bytes

LEARNER_SHAPE = sharding.MeshShape(fsdp=4)
ROLLOUT_SHAPE = sharding.MeshShape(fsdp=2, tensor=2)
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def tiny():
  """(host params, logical axes, abstract params) of the tiny preset."""
  config = model.get_config("tiny")
  decoder = model.init_model(config, seed=0)
  _, params = model.split_model(decoder)
  _, abstract, _ = model.abstract_params(config)
  return jax.device_get(params), model.param_logical_axes(decoder), abstract


@pytest.fixture(scope="module")
def meshes():
  learner_devices, rollout_devices = sharding.split_devices(4, 4)
  return (sharding.make_mesh(LEARNER_SHAPE, learner_devices),
          sharding.make_mesh(ROLLOUT_SHAPE, rollout_devices))


def on_learner(host_params, axes, learner_mesh, offset=0.0):
  """Fresh learner-side arrays (host params + offset), sharded on the learner mesh."""
  shifted = jax.tree.map(lambda x: x + np.float32(offset), host_params)
  return jax.device_put(shifted, sharding.param_shardings(axes, shifted, learner_mesh))


def assert_equal_trees(actual, expected):
  assert jax.tree.structure(actual) == jax.tree.structure(expected)
  for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert got.shape == want.shape and got.dtype == want.dtype
    assert np.array_equal(np.asarray(got), np.asarray(want))


def assert_on_rollout(fetched, axes, rollout_mesh, learner_mesh):
  expected = sharding.param_shardings(axes, fetched, rollout_mesh)
  rollout_devices = set(rollout_mesh.devices.flat)
  learner_devices = set(learner_mesh.devices.flat)
  for array, want in zip(jax.tree.leaves(fetched), jax.tree.leaves(expected)):
    assert array.sharding.is_equivalent_to(want, array.ndim), (array.sharding, want)
    assert array.sharding.device_set == rollout_devices
    assert not {shard.device for shard in array.addressable_shards} & learner_devices


@pytest.fixture
def store(tmp_path, tiny, meshes):
  """make(**kwargs) -> an OrbaxStoreChannel on tmp_path/weights, closed after the test."""
  _, axes, abstract = tiny
  made = []

  def make(directory=tmp_path / "weights", rollout_mesh=meshes[1], **kwargs):
    channel = OrbaxStoreChannel(directory, abstract, axes, rollout_mesh, **kwargs)
    made.append(channel)
    return channel

  yield make
  for channel in made:
    channel.close()


def make_channel(backend, store, tiny, meshes):
  if backend == "device":
    return DeviceTransferChannel(tiny[1], meshes[1])
  return store()


def publish_and_wait(channel, version, params):
  channel.publish(version, params)
  assert channel.wait_for_version(version - 1, timeout=TIMEOUT_S) == version


# ---- device transfer --------------------------------------------------------------------------

def test_meshes_are_disjoint_and_lay_out_params_differently(tiny, meshes):
  """Guards the premise of the transfer tests: a real reshard between device sets."""
  host, axes, _ = tiny
  learner_mesh, rollout_mesh = meshes
  assert not set(learner_mesh.devices.flat) & set(rollout_mesh.devices.flat)
  learner = sharding.param_shardings(axes, host, learner_mesh)
  rollout = sharding.param_shardings(axes, host, rollout_mesh)
  for param, src, dst in zip(jax.tree.leaves(host), jax.tree.leaves(learner),
                             jax.tree.leaves(rollout)):
    if param.ndim >= 2:
      assert src.shard_shape(param.shape) != dst.shard_shape(param.shape)


def test_device_transfer_reshards_onto_rollout_devices(tiny, meshes):
  host, axes, _ = tiny
  learner_mesh, rollout_mesh = meshes
  channel = DeviceTransferChannel(axes, rollout_mesh)
  channel.publish(1, on_learner(host, axes, learner_mesh))
  version, fetched = channel.fetch()
  assert version == 1
  assert_equal_trees(fetched, host)
  assert_on_rollout(fetched, axes, rollout_mesh, learner_mesh)


@pytest.mark.parametrize("colocated", [False, True])
def test_device_transfer_copy_survives_deleting_learner_arrays(tiny, meshes, colocated):
  host, axes, _ = tiny
  learner_mesh, rollout_mesh = meshes
  channel = DeviceTransferChannel(axes, None if colocated else rollout_mesh)
  learner_params = on_learner(host, axes, learner_mesh)
  channel.publish(1, learner_params)
  for array in jax.tree.leaves(learner_params):  # what donating them to the next step does
    array.delete()
  _, fetched = channel.fetch()
  assert not any(array.is_deleted() for array in jax.tree.leaves(fetched))
  assert_equal_trees(fetched, host)


def test_device_transfer_rejected_publish_keeps_previous_weights(tiny, meshes):
  host, axes, _ = tiny
  learner_mesh, rollout_mesh = meshes
  channel = DeviceTransferChannel(axes, rollout_mesh)
  channel.publish(3, on_learner(host, axes, learner_mesh))
  for stale in (3, 2):
    with pytest.raises(ValueError, match="not newer"):
      channel.publish(stale, on_learner(host, axes, learner_mesh, offset=1.0))
  version, fetched = channel.fetch()
  assert version == 3 and channel.latest_version() == 3
  assert_equal_trees(fetched, host)
  assert channel.metrics()["sync/publishes"] == 1


def test_device_wait_for_version_returns_once_published(tiny, meshes):
  host, axes, _ = tiny
  channel = DeviceTransferChannel(axes, meshes[1])
  assert channel.wait_for_version(-1, timeout=0.05) == -1  # nothing yet: times out
  publisher = threading.Thread(target=channel.publish,
                               args=(1, on_learner(host, axes, meshes[0])), name="publisher")
  publisher.start()
  try:
    assert channel.wait_for_version(0, timeout=TIMEOUT_S) == 1
  finally:
    publisher.join(TIMEOUT_S)
  assert channel.fetch()[0] == 1


# ---- orbax store --------------------------------------------------------------------------------

def test_store_other_channel_fetches_with_its_own_shardings(tiny, meshes, store):
  host, axes, _ = tiny
  learner_mesh, rollout_mesh = meshes
  learner_side = store(rollout_mesh=None)
  rollout_side = store()  # a second object on the same directory, as another process has
  assert rollout_side.latest_version() == -1
  publish_and_wait(learner_side, 1, on_learner(host, axes, learner_mesh))
  assert rollout_side.latest_version() == 1
  version, fetched = rollout_side.fetch()
  assert version == 1
  assert_equal_trees(fetched, host)
  assert_on_rollout(fetched, axes, rollout_mesh, learner_mesh)



def test_store_latest_version_ignores_incomplete_saves(tiny, meshes, store, tmp_path):
  host, axes, _ = tiny
  channel = store()
  publish_and_wait(channel, 1, on_learner(host, axes, meshes[0]))
  # What orbax writes while version 2 is still being saved: not a version yet.
  (tmp_path / "weights" / f"2{ocp.path.step.TMP_DIR_SUFFIX}-1234" / "default").mkdir(parents=True)
  assert channel.latest_version() == 1
  assert channel.wait_for_version(1, timeout=0.1) == 1
  assert channel.fetch()[0] == 1

def test_store_newest_wins_and_max_to_keep(tiny, meshes, store, tmp_path):
  host, axes, _ = tiny
  learner_side = store(max_to_keep=2)
  reader = store()
  for version in (1, 2, 5, 7):
    publish_and_wait(learner_side, version, on_learner(host, axes, meshes[0], offset=version))
    assert reader.latest_version() == version
    fetched_version, fetched = reader.fetch()
    assert fetched_version == version
    assert_equal_trees(fetched, jax.tree.map(lambda x, v=version: x + np.float32(v), host))
  learner_side.close()  # waits for the last deletions
  assert sorted(ocp.path.step.checkpoint_steps(tmp_path / "weights")) == [5, 7]


def test_store_publish_is_asynchronous(tiny, meshes, store, monkeypatch):
  """publish returns while the save's completion is held back; the version follows later."""
  host, axes, _ = tiny
  release = threading.Event()
  finish = OrbaxStoreChannel._finish

  def held_finish(self, *args):
    release.wait(TIMEOUT_S)
    finish(self, *args)

  monkeypatch.setattr(OrbaxStoreChannel, "_finish", held_finish)
  channel = store()
  publisher = threading.Thread(target=channel.publish,
                               args=(1, on_learner(host, axes, meshes[0])), name="publisher")
  publisher.start()
  publisher.join(TIMEOUT_S / 2)
  returned = not publisher.is_alive()
  published_while_held = channel.metrics()["sync/publishes"]
  release.set()
  publisher.join(TIMEOUT_S)
  assert returned, "publish waited for the save to complete"
  assert published_while_held == 0
  assert channel.wait_for_version(0, timeout=TIMEOUT_S) == 1
  channel.close()  # joins the save thread: its announcement is recorded
  assert channel.metrics()["sync/publishes"] == 1 and channel.fetch()[0] == 1


def test_store_wait_for_version_sees_another_channels_publish(tiny, meshes, store):
  host, axes, _ = tiny
  writer, reader = store(), store()
  assert reader.wait_for_version(-1, timeout=0.05) == -1
  publisher = threading.Thread(target=writer.publish,
                               args=(4, on_learner(host, axes, meshes[0])), name="publisher")
  publisher.start()
  try:
    assert reader.wait_for_version(3, timeout=TIMEOUT_S) == 4
  finally:
    publisher.join(TIMEOUT_S)
  assert reader.fetch()[0] == 4


def test_store_rejects_versions_not_newer_than_on_disk(tiny, meshes, store, tmp_path):
  host, axes, _ = tiny
  first = store()
  publish_and_wait(first, 3, on_learner(host, axes, meshes[0]))
  with pytest.raises(ValueError, match="not newer"):
    first.publish(3, on_learner(host, axes, meshes[0], offset=1.0))
  first.close()
  restarted = store()  # a new learner process on the same directory
  with pytest.raises(ValueError, match="not newer"):
    restarted.publish(2, on_learner(host, axes, meshes[0], offset=1.0))
  assert restarted.latest_version() == 3
  assert sorted(ocp.path.step.checkpoint_steps(tmp_path / "weights")) == [3]
  assert_equal_trees(restarted.fetch()[1], host)


# ---- both backends ------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["device", "store"])
def test_fetch_before_publish_raises_lookup_error(backend, tiny, meshes, store):
  channel = make_channel(backend, store, tiny, meshes)
  with pytest.raises(LookupError):
    channel.fetch()


@pytest.mark.parametrize("backend", ["device", "store"])
def test_metrics_report_latency_and_bytes_per_publish(backend, tiny, meshes, store):
  host, axes, _ = tiny
  channel = make_channel(backend, store, tiny, meshes)
  before = channel.metrics()
  assert math.isnan(before["sync/latency_s"]) and before["sync/bytes"] == 0
  params = on_learner(host, axes, meshes[0])
  for version in (1, 2):
    publish_and_wait(channel, version, params)
  channel.close()  # the store records a publish when its save thread finishes
  metrics = channel.metrics()
  assert metrics["sync/publishes"] == 2
  assert metrics["sync/bytes"] == 2 * tree_bytes(params) == 2 * tree_bytes(host)
  assert 0 < metrics["sync/latency_s"] < TIMEOUT_S
  assert 0 < metrics["sync/latency_s_mean"] < TIMEOUT_S


@pytest.mark.parametrize("backend", ["device", "store"])
@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_wait_for_version_rejects_non_positive_timeout(backend, timeout, tiny, meshes, store):
  channel = make_channel(backend, store, tiny, meshes)
  with pytest.raises(ValueError, match="timeout"):
    channel.wait_for_version(-1, timeout=timeout)
