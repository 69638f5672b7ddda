"""Placement: the learner and the rollout side on disjoint meshes of the 8 forced CPU devices.

Checks where every role's arrays live (learner state on the learner's devices only; the engine's
params and KV cache on the rollout devices only), that an update followed by a publish gives the
very same params as an unsplit run, and that a split run trains a few versions end to end.
"""

import jax
import numpy as np
import pytest

import gin
from jaxrl_async import sharding
from jaxrl_async.backends import threads
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.run import api
from jaxrl_async.run import build as build_lib
from jaxrl_async.sharding import MeshShape
from jaxrl_async.sync.channel import DeviceTransferChannel
from jaxrl_async.tasks.reverse import DigitReverseTask
from launch import train

GROUP_SIZE = 4
SPLIT = dict(learner_mesh=MeshShape(data=1, fsdp=4, tensor=1),
             rollout_mesh=MeshShape(data=1, fsdp=4, tensor=1))


def small_config(num_versions: int = 3, **overrides) -> RunConfig:
  # precompile_updates off: a tiny run meets few of the row counts it would compile ahead
  settings = dict(task=DigitReverseTask(0, max_len=8), precompile_updates=False,
                  warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=GROUP_SIZE,
                  mini_batch_size=2, max_concurrent_decodes=8, eval_size=16,
                  eval_every_versions=2, checkpoint_every_versions=2)
  settings.update(overrides)
  return RunConfig(total_samples=num_versions * settings["mini_batch_size"] * GROUP_SIZE,
                   **settings)


def quiet(*args, **kwargs):
  del args, kwargs


def device_ids(tree) -> set[int]:
  return {d.id for x in jax.tree.leaves(tree) for d in x.sharding.device_set}


# ---- sharding.place_roles ------------------------------------------------------------------------
def test_place_roles_splits_disjoint_meshes_with_their_own_shapes():
  placement = sharding.place_roles(MeshShape(fsdp=2, tensor=2), MeshShape(data=2, fsdp=-1))
  assert placement.split
  assert [d.id for d in placement.devices("learner")] == [0, 1, 2, 3]
  assert [d.id for d in placement.devices("rollout")] == [4, 5, 6, 7]
  assert dict(placement.learner.shape) == {"data": 1, "fsdp": 2, "tensor": 2}
  assert dict(placement.rollout.shape) == {"data": 2, "fsdp": 2, "tensor": 1}
  # A -1 axis on the learner takes what the rollout side leaves.
  placement = sharding.place_roles(MeshShape(fsdp=-1), MeshShape(data=1, fsdp=2, tensor=1))
  assert len(placement.devices("learner")) == 6 and len(placement.devices("rollout")) == 2
  # Explicit device ids, in any order.
  placement = sharding.place_roles(MeshShape(fsdp=2), MeshShape(fsdp=2),
                                   learner_device_ids=(6, 7), rollout_device_ids=(0, 3))
  assert [d.id for d in placement.devices("learner")] == [6, 7]
  assert [d.id for d in placement.devices("rollout")] == [0, 3]


def test_place_roles_colocated_keeps_the_learner_mesh():
  placement = sharding.place_roles(MeshShape(data=1, fsdp=1, tensor=1))
  assert not placement.split and placement.rollout is None
  assert placement.devices("rollout") == placement.devices("learner") == [jax.devices()[0]]
  assert len(sharding.place_roles(MeshShape()).devices("learner")) == 8


@pytest.mark.parametrize("learner, rollout, ids, message", [
    (MeshShape(fsdp=4), MeshShape(fsdp=8), {}, "do not fit"),
    (MeshShape(fsdp=-1), MeshShape(fsdp=-1), {}, "both have a -1 axis"),
    (MeshShape(fsdp=2), MeshShape(fsdp=2),
     dict(learner_device_ids=(0, 1), rollout_device_ids=(1, 2)), "overlap on devices \\[1\\]"),
    (MeshShape(fsdp=2), MeshShape(fsdp=2), dict(learner_device_ids=(0, 8)),
     "learner_device_ids=\\(0, 8\\) must be distinct device indices in \\[0, 8\\)"),
    (MeshShape(fsdp=2), MeshShape(fsdp=3), dict(rollout_device_ids=(4, 5)), "do not fit"),
    (MeshShape(fsdp=9), None, {}, "needs 9 devices, 8 exist"),
    (MeshShape(fsdp=1), None, dict(rollout_device_ids=(1,)), "needs rollout_mesh"),
], ids=["too_many", "two_rest", "overlap", "bad_id", "ids_vs_shape", "colocated_too_many",
        "ids_without_mesh"])
def test_place_roles_errors_name_the_setting(learner, rollout, ids, message):
  with pytest.raises(ValueError, match=message):
    sharding.place_roles(learner, rollout, **ids)


def test_build_rejects_a_placement_that_does_not_fit():
  with pytest.raises(ValueError, match="do not fit"):
    build_lib.build(small_config(learner_mesh=MeshShape(fsdp=4),
                                  rollout_mesh=MeshShape(fsdp=5)), log=quiet)


# ---- one update + one publish: the same params as an unsplit run ---------------------------------
@pytest.fixture(scope="module")
def parts_pair():
  unsplit = build_lib.build(small_config(learner_mesh=MeshShape(data=1, fsdp=4, tensor=1)),
                             log=quiet)
  split = build_lib.build(small_config(**SPLIT), log=quiet)
  return unsplit, split


def _one_version_of_groups(parts):
  cfg = parts.config
  batcher = parts.rollout.new_batcher()
  batcher.set_params(build_lib.copy_params(parts.learner.initial_state.params), 0)
  requests = []
  for group_id in range(cfg.groups_per_version):
    requests += build_lib.make_group_requests(next(parts.rollout.prompts), group_id,
                                               cfg.group_size, cfg.seed)
  by_group: dict[int, list] = {}
  for sample in parts.rollout.rewards.score_all(batcher.run_to_completion(requests)):
    by_group.setdefault(sample.group_id, []).append(sample)
  groups = [sorted(group, key=lambda s: s.meta["index_in_group"])
            for _, group in sorted(by_group.items())]
  assert all(len(g) == cfg.group_size and all(s.reward_status == "ok" for s in g)
             for g in groups)
  return groups, batcher


def test_split_build_places_each_role_on_its_own_devices(parts_pair):
  _, split = parts_pair
  assert device_ids(split.learner.initial_state) == {0, 1, 2, 3}
  assert set(split.rollout_mesh.devices.flat) == set(jax.devices()[4:])
  groups, batcher = _one_version_of_groups(split)
  assert len(groups) == split.config.groups_per_version
  assert device_ids(batcher.params) == {4, 5, 6, 7}
  assert device_ids(batcher._state) == {4, 5, 6, 7}  # the KV cache and slot state
  cache = batcher._state.cache.keys[0]
  assert cache.sharding == sharding.named_sharding(split.rollout_mesh, ("batch", "cache_length",
                                                                        "kv_heads", "head_dim"),
                                                   cache.shape)


def test_update_and_publish_equal_the_unsplit_run(parts_pair):
  unsplit, split = parts_pair
  start = jax.device_get(unsplit.learner.initial_state.params)
  jax.tree.map(np.testing.assert_array_equal, start, jax.device_get(split.learner.initial_state.params))
  groups, _ = _one_version_of_groups(unsplit)
  results = {}
  for name, parts in (("unsplit", unsplit), ("split", split)):
    state = jax.tree.map(lambda x: x.copy(), parts.learner.initial_state)
    state, _ = build_lib.learner_update(parts.learner, state, groups, None, 0, 0)
    channel = DeviceTransferChannel(parts.learner.spec.logical_axes, parts.rollout_mesh)
    channel.publish(1, state.params)
    results[name] = (state.params, channel.fetch()[1])
  learner_params, published = results["split"]
  assert device_ids(learner_params) == {0, 1, 2, 3}
  assert device_ids(published) == {4, 5, 6, 7}
  expected = sharding.param_shardings(split.learner.spec.logical_axes, published, split.rollout_mesh)
  assert all(jax.tree.leaves(jax.tree.map(lambda x, s: x.sharding == s, published, expected)))
  for got, want in zip(results["split"], results["unsplit"]):
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(got), jax.device_get(want))
  # The update changed the params: the comparison is not between two copies of the start.
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, start,
                                              jax.device_get(published))))


def test_the_async_weight_channel_publishes_onto_the_rollout_mesh(parts_pair, tmp_path):
  _, split = parts_pair
  channel = threads.make_channel(split, tmp_path)
  channel.publish(7, split.learner.initial_state.params)
  version, fetched = channel.fetch()
  assert version == 7 and device_ids(fetched) == {4, 5, 6, 7}
  assert device_ids(split.learner.initial_state.params) == {0, 1, 2, 3}  # the learner's stay where they were
  channel.close()


# ---- a split run, end to end ---------------------------------------------------------------------
@pytest.mark.parametrize("mode, overrides", [
    ("sync", dict()),
    ("async_partial", dict(staleness_threshold=1.0, partial_rollout=True)),
], ids=["sync", "async_partial"])
def test_split_run_trains_with_the_engine_on_the_rollout_devices(tmp_path, mode, overrides,
                                                                 monkeypatch):
  config = small_config(3, mode=mode, **SPLIT, **overrides)
  parts = build_lib.build(config, log=quiet)
  batchers = []
  make_batcher = build_lib.RolloutSide.new_batcher

  def recording_batcher(side):
    batchers.append(make_batcher(side))
    return batchers[-1]

  monkeypatch.setattr(build_lib.RolloutSide, "new_batcher", recording_batcher)
  result = api.train(parts, tmp_path, progress=False, log=quiet)
  summary = result.summary
  assert summary["policy_version"] == config.num_versions
  assert summary["consumed_samples"] == config.total_samples
  assert device_ids(result.state) == {0, 1, 2, 3}
  assert len(batchers) == 2  # the rollout's and the evaluator's
  for batcher in batchers:
    assert device_ids(batcher.params) == {4, 5, 6, 7}
    assert device_ids(batcher._state) == {4, 5, 6, 7}
  assert max(b.version for b in batchers) == config.num_versions


def test_gin_file_places_the_roles_4_plus_4():
  train.load_config(["gin/modes/async_partial.gin", "gin/placement/split_4_4.gin"], [])
  config = gin.get_configurable(RunConfig)()
  assert config.mode == "async_partial"
  placement = sharding.place_roles(config.learner_mesh, config.rollout_mesh)
  assert [d.id for d in placement.devices("learner")] == [0, 1, 2, 3]
  assert [d.id for d in placement.devices("rollout")] == [4, 5, 6, 7]
