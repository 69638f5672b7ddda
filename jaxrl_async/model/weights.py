"""Hugging Face checkpoints in and out: safetensors shards <-> the decoder's parameters.

    config = weights.load_config(directory, max_seq_len=1024, dtype="bfloat16")
    params = weights.load_params(directory, config, shardings=shardings)  # straight to devices
    weights.save_params(params, config, out_dir, base=directory)           # back to HF format

Loading reads tensor by tensor through safetensors' lazy `safe_open` (numpy): each device's
shard of a parameter is sliced out of the file (`jax.make_array_from_callback`), so the host
holds at most one tensor's slices at a time, never a second copy of the model. Saving brings one
parameter at a time to the host and writes shards of at most `max_shard_bytes`, with
model.safetensors.index.json when there are several.

Layouts: HF linear weights are [out, in]; ours are [in, ...] with heads split out
(q: [D, H, Dh], o: [H, Dh, D]), so each mapping is a transpose and a reshape, exact both ways.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from jaxrl_async.model.config import ModelConfig
from jaxrl_async.model.decoder import abstract_params
from jaxrl_async.model.hf_config import (
  UnsupportedCheckpoint,
  config_from_hf,
  config_to_hf,
  read_hf_config,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Files beside the weights that a serving stack reads; copied by `save_params(base=...)`.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja", "vocab.json", "merges.txt",
                   "tokenizer.model")
# Tensors that some checkpoints carry and the decoder recomputes or does not use.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
  """Where a run's initial weights come from (bound in gin/models/*.gin).

  dtype: activations; param_dtype: how parameters are stored (and trained); remat: gradient
  checkpointing of each block in the learner's forward.
  """

  path: str
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  remat: bool = True

  def model_config(self, max_seq_len: int | None = None) -> ModelConfig:
    return load_config(self.path, max_seq_len=max_seq_len, dtype=self.dtype,
                       param_dtype=self.param_dtype, remat=self.remat)

  def load(self, config: ModelConfig, mesh=None, logical_axes=None):
    """The params, placed by their logical axes on `mesh` (or on the default device)."""
    shardings = None
    if mesh is not None:
      from jaxrl_async import sharding  # the only place PartitionSpecs are made

      _, abstract, axes = abstract_params(config)
      shardings = sharding.param_shardings(logical_axes or axes, abstract, mesh)
    return load_params(self.path, config, shardings=shardings)


def load_config(directory, **kwargs) -> ModelConfig:
  """`hf_config.config_from_hf` of the directory's config.json."""
  return config_from_hf(read_hf_config(directory), **kwargs)


# ---- the name and layout map ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Tensor:
  hf_name: str
  path: tuple  # keys into our params
  kind: str  # 'same', 'transpose', 'in_heads' ([H*Dh, D] -> [D, H, Dh]), 'out_heads', 'bias'


def tensor_map(config: ModelConfig) -> list[_Tensor]:
  """Every parameter of `config`'s decoder with its Hugging Face name, in HF's order."""
  out = [_Tensor("model.embed_tokens.weight", ("embed",), "same")]
  for layer in range(config.n_layers):
    hf, ours = f"model.layers.{layer}.", ("blocks", layer)
    out.append(_Tensor(hf + "input_layernorm.weight", ours + ("attn_norm", "scale"), "same"))
    for name in ("q", "k", "v"):
      out.append(_Tensor(hf + f"self_attn.{name}_proj.weight", ours + ("attn", name), "in_heads"))
      if config.qkv_bias:
        out.append(_Tensor(hf + f"self_attn.{name}_proj.bias", ours + ("attn", f"{name}_bias"),
                           "bias"))
    out.append(_Tensor(hf + "self_attn.o_proj.weight", ours + ("attn", "o"), "out_heads"))
    if config.qk_norm:
      for name in ("q", "k"):
        out.append(_Tensor(hf + f"self_attn.{name}_norm.weight",
                           ours + ("attn", f"{name}_norm", "scale"), "same"))
    out.append(_Tensor(hf + "post_attention_layernorm.weight", ours + ("mlp_norm", "scale"),
                       "same"))
    for name in ("gate", "up", "down"):
      out.append(_Tensor(hf + f"mlp.{name}_proj.weight", ours + ("mlp", name), "transpose"))
  out.append(_Tensor("model.norm.weight", ("final_norm", "scale"), "same"))
  if not config.tie_embeddings:
    out.append(_Tensor("lm_head.weight", ("lm_head",), "transpose"))
  return out


def _hf_shape(kind: str, shape: tuple) -> tuple:
  if kind == "same":
    return shape
  if kind == "transpose":
    return shape[::-1]
  if kind == "in_heads":  # ours [D, H, Dh]
    return (shape[1] * shape[2], shape[0])
  if kind == "out_heads":  # ours [H, Dh, D]
    return (shape[2], shape[0] * shape[1])
  return (shape[0] * shape[1],)  # bias, ours [H, Dh]


def _read_region(hf_slice, kind: str, index: tuple, shape: tuple) -> np.ndarray:
  """Our array's `index` region (a tuple of unit-step slices), read lazily from the HF tensor."""
  bounds = [s.indices(n)[:2] for s, n in zip(index, shape)]
  rows = [slice(a, b) for a, b in bounds]
  if kind == "same":
    return hf_slice[tuple(rows)]
  if kind == "transpose":
    return hf_slice[tuple(rows[::-1])].T
  head_dim = shape[-2] if kind == "out_heads" else shape[-1]
  if kind == "in_heads":  # [D, H, Dh] from W [H*Dh, D]
    (d0, d1), (h0, h1), _ = bounds
    block = hf_slice[h0 * head_dim:h1 * head_dim, d0:d1].T
    return block.reshape(d1 - d0, h1 - h0, head_dim)[:, :, rows[2]]
  if kind == "out_heads":  # [H, Dh, D] from W [D, H*Dh]
    (h0, h1), _, (d0, d1) = bounds
    block = hf_slice[d0:d1, h0 * head_dim:h1 * head_dim].T
    return block.reshape(h1 - h0, head_dim, d1 - d0)[:, rows[1], :]
  (h0, h1), _ = bounds  # bias [H, Dh] from b [H*Dh]
  return hf_slice[h0 * head_dim:h1 * head_dim].reshape(h1 - h0, head_dim)[:, rows[1]]


def _to_hf(kind: str, array: np.ndarray) -> np.ndarray:
  if kind == "same":
    return array
  if kind == "transpose":
    return array.T
  if kind == "in_heads":
    return array.reshape(array.shape[0], -1).T
  if kind == "out_heads":
    return array.reshape(-1, array.shape[-1]).T
  return array.reshape(-1)


# ---- import ------------------------------------------------------------------------------------
def weight_files(directory) -> dict[str, str]:
  """HF tensor name -> the safetensors file (full path) that holds it."""
  index_path = os.path.join(directory, INDEX_FILE)
  if os.path.isfile(index_path):
    with open(index_path, encoding="utf-8") as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(directory, file) for name, file in weight_map.items()}
  single = os.path.join(directory, SINGLE_FILE)
  if not os.path.isfile(single):
    raise FileNotFoundError(f"{directory!s} has neither {INDEX_FILE} nor {SINGLE_FILE}")
  with safe_open(single, framework="np") as f:
    return dict.fromkeys(f.keys(), single)


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _get(tree, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def load_params(directory, config: ModelConfig, *, shardings=None):
  """The decoder's params (nested dict of jax.Arrays, dtype `config.param_dtype`) from a HF
  directory. shardings: a pytree like the params of `jax.sharding.Sharding`s (e.g.
  `sharding.param_shardings(logical_axes, params, mesh)`), or None for the default device."""
  _, abstract, _ = abstract_params(config)
  files = weight_files(directory)
  tensors = tensor_map(config)
  expected = {t.hf_name for t in tensors}
  unexpected = sorted(name for name in files if name not in expected
                      and not name.endswith(IGNORED_SUFFIXES)
                      and not (name == "lm_head.weight" and config.tie_embeddings))
  if unexpected:
    raise UnsupportedCheckpoint(
        f"{directory!s} has tensors the decoder has no parameter for: {unexpected[:5]}"
        f"{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)} in all)")
  missing = sorted(expected - set(files))
  if missing:
    raise UnsupportedCheckpoint(f"{directory!s} lacks tensors: {missing[:5]} "
                                f"({len(missing)} in all)")
  default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params: dict = {}
  handles: dict[str, object] = {}
  try:
    for tensor in tensors:
      file = files[tensor.hf_name]
      if file not in handles:
        handles[file] = safe_open(file, framework="np").__enter__()
      target = _get(abstract, tensor.path)
      hf_slice = handles[file].get_slice(tensor.hf_name)
      found = tuple(hf_slice.get_shape())
      if found != _hf_shape(tensor.kind, target.shape):
        raise UnsupportedCheckpoint(
            f"tensor {tensor.hf_name} in {file} has shape {found}; config.json implies "
            f"{_hf_shape(tensor.kind, target.shape)}")
      sharding = default if shardings is None else _get(shardings, tensor.path)
      _set(params, tensor.path, _make_array(hf_slice, tensor.kind, target, sharding))
  finally:
    for handle in handles.values():
      handle.__exit__(None, None, None)
  return params


def _make_array(hf_slice, kind: str, target, sharding) -> jax.Array:
  regions: dict[tuple, np.ndarray] = {}  # devices holding the same region share one read

  def region(index: tuple) -> np.ndarray:
    key = tuple(s.indices(n)[:2] for s, n in zip(index, target.shape))
    if key not in regions:
      regions[key] = np.ascontiguousarray(
          _read_region(hf_slice, kind, index, target.shape).astype(target.dtype))
    return regions[key]

  return jax.make_array_from_callback(target.shape, sharding, region)


# ---- export ------------------------------------------------------------------------------------
def save_params(params, config: ModelConfig, directory, *, base=None, dtype: str | None = None,
                max_shard_bytes: int = 2 << 30,
                host_fn: Callable | None = None) -> list[str]:
  """Write params as a HF directory (safetensors + config.json); returns the files written.

  base: the source checkpoint directory; its config.json fields the decoder does not own, and
  its tokenizer / generation files, are carried over. dtype: the tensors' dtype on disk
  (default: each parameter's own). host_fn: array -> numpy (default `jax.device_get`).
  """
  host_fn = host_fn or (lambda x: np.asarray(jax.device_get(x)))
  os.makedirs(directory, exist_ok=True)
  # Plan the shards from shapes alone, then bring one shard's tensors to the host at a time.
  shards: list[list[_Tensor]] = [[]]
  sizes = [0]
  disk_dtypes = set()
  for tensor in tensor_map(config):
    leaf = _get(params, tensor.path)
    disk_dtype = jnp.dtype(dtype or leaf.dtype)
    disk_dtypes.add(disk_dtype.name)
    nbytes = int(np.prod(leaf.shape)) * disk_dtype.itemsize
    if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
      shards.append([])
      sizes.append(0)
    shards[-1].append(tensor)
    sizes[-1] += nbytes
  names = ([SINGLE_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  written = []
  for name, shard in zip(names, shards):
    arrays = {}
    for tensor in shard:
      array = host_fn(_get(params, tensor.path))
      array = array.astype(jnp.dtype(dtype or array.dtype))
      arrays[tensor.hf_name] = np.ascontiguousarray(_to_hf(tensor.kind, array))
    save_file(arrays, os.path.join(directory, name), metadata={"format": "pt"})
    del arrays
    written.append(name)
  if len(shards) > 1:
    index = {"metadata": {"total_size": sum(sizes)},
             "weight_map": {t.hf_name: name for name, shard in zip(names, shards) for t in shard}}
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
      json.dump(index, f, indent=2)
    written.append(INDEX_FILE)
  torch_dtype = disk_dtypes.pop() if len(disk_dtypes) == 1 else "float32"
  hf = config_to_hf(config, torch_dtype=torch_dtype,
                    base=None if base is None else read_hf_config(base))
  with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
    json.dump(hf, f, indent=2, sort_keys=True)
  written.append("config.json")
  if base is not None:
    for name in TOKENIZER_FILES:
      source = os.path.join(base, name)
      if os.path.isfile(source) and os.path.abspath(source) != os.path.abspath(
          os.path.join(directory, name)):
        shutil.copyfile(source, os.path.join(directory, name))
        written.append(name)
  return written
