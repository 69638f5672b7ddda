"""Tests for jaxrl_async.sharding: mesh shapes, logical -> mesh rules, sharded == unsharded."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_async import sharding
from jaxrl_async.model import apply, get_config, init_model, param_logical_axes, split_model
from jaxrl_async.sharding import MeshShape


def test_eight_host_devices_are_available():
  assert len(jax.devices()) == 8  # tests/conftest.py forces them; the checks below rely on it


# ---- MeshShape / make_mesh -------------------------------------------------------------------
@pytest.mark.parametrize("shape, expected", [
    (MeshShape(), (1, 8, 1)),
    (MeshShape(fsdp=4, tensor=2), (1, 4, 2)),
    (MeshShape(data=2, fsdp=-1, tensor=2), (2, 2, 2)),
    (MeshShape(data=-1, fsdp=1, tensor=4), (2, 1, 4)),
    (MeshShape(data=2, fsdp=2, tensor=2), (2, 2, 2)),
])
def test_mesh_shape_resolves(shape, expected):
  assert shape.resolve(8) == expected


@pytest.mark.parametrize("shape, num_devices, match", [
    (MeshShape(fsdp=0), 8, r"mesh axis 'fsdp' must be a positive size or -1, got 0"),
    (MeshShape(tensor=-2), 8, r"mesh axis 'tensor'.*-2"),
    (MeshShape(data=-1, fsdp=-1), 8, r"at most one mesh axis may be -1"),
    (MeshShape(fsdp=-1, tensor=3), 8, r"8 devices do not divide"),
    (MeshShape(data=2, fsdp=2, tensor=1), 8, r"needs 4 devices, 8 given"),
])
def test_mesh_shape_errors(shape, num_devices, match):
  with pytest.raises(ValueError, match=match):
    shape.resolve(num_devices)


def test_make_mesh_axes_and_device_subset():
  mesh = sharding.make_mesh(MeshShape(fsdp=4, tensor=2))
  assert mesh.axis_names == sharding.MESH_AXES == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
  one = sharding.make_mesh(MeshShape(), jax.devices()[:1])
  assert dict(one.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
  with pytest.raises(ValueError, match="needs 8 devices, 2 given"):
    sharding.make_mesh(MeshShape(fsdp=4, tensor=2), jax.devices()[:2])


def test_split_devices_colocated_and_disjoint():
  devices = jax.devices()
  learner, rollout = sharding.split_devices(4)
  assert learner == rollout == devices[:4]
  learner, rollout = sharding.split_devices(6, 2)
  assert learner == devices[:6] and rollout == devices[6:]
  assert not set(learner) & set(rollout)
  with pytest.raises(ValueError, match="num_learner=9 exceeds the 8 devices"):
    sharding.split_devices(9)
  with pytest.raises(ValueError, match=r"num_learner=6 \+ num_rollout=3"):
    sharding.split_devices(6, 3)
  with pytest.raises(ValueError, match="num_rollout=0"):
    sharding.split_devices(2, 0)


# ---- logical rules ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mesh8():
  return sharding.make_mesh(MeshShape(fsdp=4, tensor=2))


def test_logical_to_spec_maps_axes(mesh8):
  assert sharding.logical_to_spec(("embed", "mlp"), (64, 192), mesh8) == P("fsdp", "tensor")
  assert sharding.logical_to_spec(("heads", "head_dim", "embed"), (4, 16, 64), mesh8) == P(
      "tensor", None, "fsdp")
  assert sharding.logical_to_spec(("norm",), (64,), mesh8) == P(None)
  assert sharding.logical_to_spec((None, "vocab"), (3, 16), mesh8) == P(None, "tensor")


def test_logical_to_spec_replicates_undivisible_axes(mesh8):
  # 6 is not divisible by fsdp=4 and 3 not by tensor=2: both fall back to replicated.
  assert sharding.logical_to_spec(("embed", "mlp"), (6, 3), mesh8) == P(None, None)
  # batch over (data, fsdp) = 4 rows-ways; 6 rows do not divide.
  assert sharding.logical_to_spec(("batch", "length"), (8, 5), mesh8) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec(("batch", "length"), (6, 5), mesh8) == P(None, None)


def test_a_mesh_axis_is_used_once_per_array(mesh8):
  # 'batch' takes fsdp, so 'embed' (also fsdp) must not shard over it a second time.
  assert sharding.logical_to_spec(("batch", "embed"), (8, 64), mesh8) == P(("data", "fsdp"), None)
  assert sharding.logical_to_spec(("heads", "mlp"), (4, 8), mesh8) == P("tensor", None)


def test_logical_to_spec_errors(mesh8):
  with pytest.raises(ValueError, match=r"logical axis 'bogus' has no rule"):
    sharding.logical_to_spec(("bogus",), (4,), mesh8)
  with pytest.raises(ValueError, match=r"do not match shape"):
    sharding.logical_to_spec(("embed",), (4, 4), mesh8)


def test_custom_rules(mesh8):
  rules = dict(sharding.DEFAULT_RULES, embed="tensor", mlp=None)
  assert sharding.logical_to_spec(("embed", "mlp"), (64, 192), mesh8, rules) == P("tensor", None)


def test_batch_sharding_and_replicated(mesh8):
  assert sharding.batch_sharding(mesh8, (8, 3)).spec == P(("data", "fsdp"), None)
  assert sharding.batch_sharding(mesh8, (5,)).spec == P(None)
  assert sharding.replicated(mesh8).spec == P()
  array = jax.device_put(np.arange(24.0).reshape(8, 3), sharding.batch_sharding(mesh8, (8, 3)))
  assert {s.data.shape for s in array.addressable_shards} == {(2, 3)}


# ---- parameters ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
  model = init_model(get_config("tiny"), seed=0)
  graphdef, params = split_model(model)
  return graphdef, params, param_logical_axes(model)


def test_param_shardings_of_the_tiny_model(tiny, mesh8):
  _, params, axes = tiny
  shardings = sharding.param_shardings(axes, params, mesh8)
  assert jax.tree.structure(shardings) == jax.tree.structure(params)
  described = sharding.describe_shardings(shardings)
  assert described["['embed']"] == str(P("tensor", "fsdp"))
  assert described["['blocks'][0]['attn']['k']"] == str(P("fsdp", "tensor", None))
  assert described["['blocks'][1]['mlp']['down']"] == str(P("tensor", "fsdp"))
  assert described["['final_norm']['scale']"] == str(P(None))
  # Abstract params get the same shardings as real ones.
  abstract = jax.eval_shape(lambda: params)
  assert sharding.describe_shardings(sharding.param_shardings(axes, abstract, mesh8)) == described


def test_sharded_forward_equals_unsharded(tiny, mesh8):
  graphdef, params, axes = tiny
  shardings = sharding.param_shardings(axes, params, mesh8)
  placed = jax.device_put(params, shardings)
  assert len(placed["blocks"][0]["mlp"]["gate"].addressable_shards) == 8
  assert placed["blocks"][0]["mlp"]["gate"].addressable_shards[0].data.shape == (16, 96)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (8, 8)), jnp.int32)
  tokens_sharded = jax.device_put(tokens, sharding.batch_sharding(mesh8, tokens.shape))
  fwd = jax.jit(functools.partial(apply, graphdef))
  sharded, _ = fwd(placed, tokens_sharded)
  single, _ = fwd(jax.device_put(params, jax.devices()[0]), jax.device_put(tokens, jax.devices()[0]))
  assert len(sharded.sharding.device_set) == 8
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(single), atol=1e-5)


def test_mesh_shape_num_devices():
  assert MeshShape(data=1, fsdp=2, tensor=2).num_devices(8) == 4
  assert MeshShape(fsdp=-1, tensor=2).num_devices(8) == 8
  assert MeshShape(data=1, fsdp=1, tensor=1).num_devices(8) == 1
