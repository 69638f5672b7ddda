"""Meshes, logical axis rules and role placement: the only place that builds PartitionSpecs.

Layers name logical axes only (`('embed', 'mlp')`); this module maps them onto mesh axes. The
mesh has three axes: `data` (pure data parallel), `fsdp` (data parallel with parameters sharded
along `embed`) and `tensor` (Megatron-style model parallel over heads / mlp / vocab).

A logical axis whose dimension is not divisible by its mesh axes is replicated instead: the tiny
CPU models have dimensions (e.g. 2 kv heads) smaller than a slice's axes, and a run must not
fail on them. `describe_shardings` lists which parameters fell back, so it is visible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl_async.config_types import check_field_types

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated).
DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "vocab": "tensor",
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "norm": None,
    "cache_length": None,
}


@dataclasses.dataclass(frozen=True)
class MeshShape:
  """Sizes of the three mesh axes; -1 on one axis takes the remaining devices."""

  data: int = 1
  fsdp: int = -1
  tensor: int = 1

  def __post_init__(self):
    check_field_types(self)

  def num_devices(self, available: int) -> int:
    """Devices this mesh takes: all `available` with a -1 axis, else the product of the sizes."""
    sizes = (self.data, self.fsdp, self.tensor)
    return available if -1 in sizes else math.prod(sizes)

  def resolve(self, num_devices: int) -> tuple[int, int, int]:
    sizes = [self.data, self.fsdp, self.tensor]
    for name, size in zip(MESH_AXES, sizes):
      if size == 0 or size < -1:
        raise ValueError(f"mesh axis {name!r} must be a positive size or -1, got {size}")
    if sizes.count(-1) > 1:
      raise ValueError(f"at most one mesh axis may be -1, got {self}")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
      if num_devices % known:
        raise ValueError(f"{num_devices} devices do not divide into mesh {self}")
      sizes[sizes.index(-1)] = num_devices // known
    if math.prod(sizes) != num_devices:
      raise ValueError(f"mesh {self} needs {math.prod(sizes)} devices, {num_devices} given")
    return tuple(sizes)


def make_mesh(shape: MeshShape = MeshShape(), devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  sizes = shape.resolve(len(devices))
  return Mesh(np.asarray(devices, dtype=object).reshape(sizes), MESH_AXES)


def split_devices(num_learner: int, num_rollout: int | None = None,
                  devices: Sequence[jax.Device] | None = None) -> tuple[list, list]:
  """Role placement: disjoint device sets for the learner and the rollout side.

  With `num_rollout=None` the roles are colocated (both get the learner's devices).
  """
  devices = list(jax.devices() if devices is None else devices)
  if num_rollout is None:
    if num_learner > len(devices):
      raise ValueError(f"num_learner={num_learner} exceeds the {len(devices)} devices")
    return devices[:num_learner], devices[:num_learner]
  if num_learner < 1 or num_rollout < 1 or num_learner + num_rollout > len(devices):
    raise ValueError(
        f"num_learner={num_learner} + num_rollout={num_rollout} must be >= 1 each and fit in "
        f"{len(devices)} devices")
  return devices[:num_learner], devices[num_learner:num_learner + num_rollout]


@dataclasses.dataclass(frozen=True)
class Placement:
  """Role -> devices: the learner's mesh and the rollout side's (None = on the learner's)."""

  learner: Mesh
  rollout: Mesh | None = None

  @property
  def split(self) -> bool:
    return self.rollout is not None

  def devices(self, role: str) -> list:
    """The devices a role ('learner' or 'rollout') runs on."""
    if role not in ("learner", "rollout"):
      raise ValueError(f"role must be 'learner' or 'rollout', got {role!r}")
    mesh = self.learner if role == "learner" or self.rollout is None else self.rollout
    return list(mesh.devices.flat)


def _pick(ids, setting: str, devices: list) -> list:
  ids = list(ids)
  bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < len(devices)]
  if bad or len(set(ids)) != len(ids):
    raise ValueError(f"{setting}={tuple(ids)} must be distinct device indices in "
                     f"[0, {len(devices)})")
  return [devices[i] for i in ids]


def place_roles(learner_shape: MeshShape, rollout_shape: MeshShape | None = None,
                devices: Sequence[jax.Device] | None = None, *, learner_device_ids=None,
                rollout_device_ids=None) -> Placement:
  """The learner mesh and, with `rollout_shape`, a rollout mesh on a disjoint device set.

  Without ids, the learner takes the first devices and the rollout side the next ones. A -1 axis
  takes the devices the other mesh leaves (at most one of the two meshes may have one). Without
  `rollout_shape` the rollout side runs on the learner's devices (colocated).
  """
  devices = list(jax.devices() if devices is None else devices)
  if rollout_shape is None:
    if rollout_device_ids is not None:
      raise ValueError("rollout_device_ids needs rollout_mesh (a MeshShape), got rollout_mesh=None")
    pool = devices if learner_device_ids is None else _pick(learner_device_ids,
                                                            "learner_device_ids", devices)
    count = learner_shape.num_devices(len(pool))
    if count > len(pool):
      raise ValueError(f"learner_mesh {learner_shape} needs {count} devices, {len(pool)} exist")
    return Placement(make_mesh(learner_shape, pool[:count]))
  learner = None if learner_device_ids is None else _pick(learner_device_ids,
                                                          "learner_device_ids", devices)
  rollout = None if rollout_device_ids is None else _pick(rollout_device_ids,
                                                          "rollout_device_ids", devices)
  if learner is not None and rollout is not None and set(learner) & set(rollout):
    shared = sorted(d.id for d in set(learner) & set(rollout))
    raise ValueError(f"learner_device_ids and rollout_device_ids overlap on devices {shared}; "
                     "the two meshes must use disjoint devices")
  fixed = {"learner": _fixed_size(learner_shape), "rollout": _fixed_size(rollout_shape)}
  if fixed["learner"] is fixed["rollout"] is learner is rollout is None:
    raise ValueError(f"learner_mesh {learner_shape} and rollout_mesh {rollout_shape} both have "
                     "a -1 axis; give at least one of them fixed sizes")
  if learner is None:
    free = [d for d in devices if rollout is None or d not in rollout]
    want = fixed["learner"] or len(free) - (fixed["rollout"] if rollout is None else 0)
    learner = free[:max(want, 0)]
  if rollout is None:
    free = [d for d in devices if d not in learner]
    rollout = free[:fixed["rollout"] or len(free)]
  need = {"learner": learner_shape.num_devices(len(learner)),
          "rollout": rollout_shape.num_devices(len(rollout))}
  if need["learner"] != len(learner) or need["rollout"] != len(rollout) or not (
      learner and rollout):
    raise ValueError(
        f"learner_mesh {learner_shape} ({fixed['learner'] or 'the rest'} devices) and "
        f"rollout_mesh {rollout_shape} ({fixed['rollout'] or 'the rest'} devices) do not fit "
        f"on disjoint devices: {len(devices)} exist, the learner got {len(learner)} and the "
        f"rollout side {len(rollout)}")
  return Placement(make_mesh(learner_shape, learner), make_mesh(rollout_shape, rollout))


def _fixed_size(shape: MeshShape) -> int | None:
  sizes = (shape.data, shape.fsdp, shape.tensor)
  return None if -1 in sizes else math.prod(sizes)


def decode_state_shardings(mesh: Mesh, decode_state, cache_axes: Sequence[str]):
  """Shardings for a decode state (abstract or real): KV cache leaves by `cache_axes`, the
  per-slot vectors along the batch axes."""
  def one(path, leaf):
    in_cache = any(getattr(k, "name", None) == "cache" for k in path)
    axes = tuple(cache_axes) if in_cache else ("batch",) + (None,) * (len(leaf.shape) - 1)
    return named_sharding(mesh, axes, leaf.shape)

  return jax.tree_util.tree_map_with_path(one, decode_state)


def _mesh_axes_size(mesh: Mesh, axes) -> int:
  if axes is None:
    return 1
  axes = (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                    rules: Mapping = DEFAULT_RULES) -> PartitionSpec:
  """PartitionSpec for an array with these logical axes; undivisible axes are replicated."""
  if len(logical_axes) != len(shape):
    raise ValueError(f"logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}")
  used: set[str] = set()
  spec = []
  for name, dim in zip(logical_axes, shape):
    if name is not None and name not in rules:
      raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(rules)}")
    axes = rules.get(name) if name is not None else None
    flat = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
    flat = tuple(a for a in flat if a in mesh.shape and a not in used)
    if not flat or dim % _mesh_axes_size(mesh, flat):
      spec.append(None)
      continue
    used.update(flat)
    spec.append(flat[0] if len(flat) == 1 else flat)
  return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, logical_axes, shape, rules: Mapping = DEFAULT_RULES) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def param_shardings(logical_axes, params, mesh: Mesh, rules: Mapping = DEFAULT_RULES):
  """NamedShardings for params (arrays or ShapeDtypeStructs) given their logical axis names.

  `logical_axes` is a pytree like `params` whose leaves are tuples of logical axis names
  (`jaxrl_async.model.param_logical_axes`).
  """
  return jax.tree.map(lambda axes, p: named_sharding(mesh, axes, np.shape(p), rules),
                      logical_axes, params, is_leaf=lambda x: isinstance(x, tuple))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: Mapping = DEFAULT_RULES) -> NamedSharding:
  """Leading axis over the batch axes, the rest replicated (falls back if undivisible)."""
  return named_sharding(mesh, ("batch",) + (None,) * (len(shape) - 1), shape, rules)


def describe_shardings(shardings) -> dict[str, str]:
  """Path -> spec string, to log how parameters were placed."""
  flat = jax.tree_util.tree_flatten_with_path(shardings)[0]
  return {jax.tree_util.keystr(path): str(s.spec) for path, s in flat}
