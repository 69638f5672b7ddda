"""Tests for jaxrl_async.model.weights and hf_config: config mapping, refusals, lossless round
trips, sharded loading onto a mesh."""

import dataclasses
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest
from safetensors import safe_open

from jaxrl_async import sharding
from jaxrl_async.model import abstract_params, weights
from jaxrl_async.model import hf_config as hf_config_lib
from jaxrl_async.model.config import RopeScaling
from jaxrl_async.model.hf_config import UnsupportedCheckpoint

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf"
FAMILIES = ("llama", "qwen2", "qwen3")


def _tensors(directory) -> dict[str, np.ndarray]:
  out = {}
  for name, file in weights.weight_files(directory).items():
    with safe_open(file, framework="np") as f:
      out[name] = f.get_tensor(name)
  return out


def _hf(family) -> dict:
  return json.loads((FIXTURES / family / "config.json").read_text())


# ---- config.json ------------------------------------------------------------------------------
def test_each_family_maps_to_its_switches():
  llama = weights.load_config(FIXTURES / "llama")
  assert llama.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
  assert not (llama.qkv_bias or llama.qk_norm or llama.tie_embeddings)
  assert llama.norm_eps == 1e-5 and llama.rope_theta == 500_000.0
  qwen2 = weights.load_config(FIXTURES / "qwen2", max_seq_len=96)
  assert qwen2.qkv_bias and qwen2.tie_embeddings and not qwen2.qk_norm
  assert (qwen2.max_seq_len, qwen2.n_layers, qwen2.d_ff) == (96, 3, 160)
  qwen3 = weights.load_config(FIXTURES / "qwen3", dtype="bfloat16", param_dtype="bfloat16")
  assert qwen3.qk_norm and not qwen3.qkv_bias
  assert qwen3.resolved_head_dim == 32 != qwen3.d_model // qwen3.n_heads
  assert (qwen3.dtype, qwen3.param_dtype) == ("bfloat16", "bfloat16")


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]},
     r"model_type='mistral'.*supported model_type values: \['llama', 'qwen2', 'qwen3'\]"),
    ({"architectures": ["LlamaForSequenceClassification"]}, r"architectures=.*LlamaForCausalLM"),
    ({"attention_bias": True}, r"attention_bias=true"),
    ({"mlp_bias": True}, r"mlp_bias=true"),
    ({"hidden_act": "gelu"}, r"hidden_act=\"gelu\""),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
     r"rope_scaling.rope_type=\"dynamic\".*supported rope_type values: \['default', 'linear'"),
    ({"use_sliding_window": True}, r"use_sliding_window=true"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types="),
    ({"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
])
def test_unsupported_settings_are_refused_by_name(change, message):
  with pytest.raises(UnsupportedCheckpoint, match=message):
    hf_config_lib.config_from_hf({**_hf("llama"), **change})


def test_missing_field_and_directory_errors(tmp_path):
  broken = _hf("qwen2")
  del broken["intermediate_size"]
  with pytest.raises(UnsupportedCheckpoint, match="intermediate_size"):
    hf_config_lib.config_from_hf(broken)
  with pytest.raises(FileNotFoundError, match="no config.json"):
    weights.load_config(tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_exported_config_reads_back_as_the_same_model(family, tmp_path):
  config = weights.load_config(FIXTURES / family)
  exported = hf_config_lib.config_to_hf(config, torch_dtype="float32", base=_hf(family))
  assert hf_config_lib.config_from_hf(exported) == config
  bare = hf_config_lib.config_to_hf(config, torch_dtype="float32")  # without the source's file
  assert bare["model_type"] == family
  assert hf_config_lib.config_from_hf(bare) == config


# ---- tensors ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_gives_back_the_same_tensors(family, tmp_path):
  source = FIXTURES / family
  config = weights.load_config(source)
  params = weights.load_params(source, config)
  _, abstract, _ = abstract_params(config)
  assert jax.tree.structure(params) == jax.tree.structure(abstract)
  # The sharded llama fixture is written back sharded too (small shards force an index).
  shard_bytes = 60_000 if family == "llama" else 2 << 30
  written = weights.save_params(params, config, tmp_path, base=source,
                                max_shard_bytes=shard_bytes)
  assert ("model.safetensors.index.json" in written) == (family == "llama")
  assert "tokenizer.json" in written and "tokenizer_config.json" in written
  original, exported = _tensors(source), _tensors(tmp_path)
  assert sorted(original) == sorted(exported)
  for name, array in original.items():
    assert exported[name].dtype == array.dtype and exported[name].shape == array.shape, name
    np.testing.assert_array_equal(exported[name], array, err_msg=name)
  assert weights.load_config(tmp_path) == config
  exported_config = json.loads((tmp_path / "config.json").read_text())
  for key, value in _hf(family).items():  # every field of the source survives
    assert exported_config[key] == value, key


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
  source = FIXTURES / "qwen3"
  config32 = weights.load_config(source)
  weights.save_params(weights.load_params(source, config32), config32, tmp_path / "bf16",
                      dtype="bfloat16", base=source)
  assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
  config16 = weights.load_config(tmp_path / "bf16", param_dtype="bfloat16")
  params16 = weights.load_params(tmp_path / "bf16", config16)
  assert {x.dtype.name for x in jax.tree.leaves(params16)} == {"bfloat16"}
  weights.save_params(params16, config16, tmp_path / "again")
  first, second = _tensors(tmp_path / "bf16"), _tensors(tmp_path / "again")
  assert sorted(first) == sorted(second)
  for name in first:
    assert first[name].dtype.name == "bfloat16"
    np.testing.assert_array_equal(first[name].view(np.uint16), second[name].view(np.uint16))


def test_sharded_load_lands_on_the_mesh_and_equals_the_unsharded_load():
  source = FIXTURES / "qwen2"
  config = weights.load_config(source)
  mesh = sharding.make_mesh(sharding.MeshShape(data=1, fsdp=4, tensor=2), jax.devices()[:8])
  _, abstract, axes = abstract_params(config)
  shardings = sharding.param_shardings(axes, abstract, mesh)
  sharded = weights.load_params(source, config, shardings=shardings)
  single = weights.load_params(source, config)
  flat_sharded = jax.tree_util.tree_leaves_with_path(sharded)
  flat_targets = dict(jax.tree_util.tree_leaves_with_path(shardings))
  split = 0
  for path, array in flat_sharded:
    assert array.sharding == flat_targets[path], path
    split += not array.sharding.is_fully_replicated
  assert split >= 5  # q/k/v/o and the MLP really are split across devices
  for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(single)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_shape_mismatch_and_missing_or_extra_tensors_name_the_tensor(tmp_path):
  source = FIXTURES / "qwen2"
  wrong = tmp_path / "wrong"
  shutil.copytree(source, wrong)
  hf = _hf("qwen2")
  hf["intermediate_size"] = 128
  (wrong / "config.json").write_text(json.dumps(hf))
  with pytest.raises(UnsupportedCheckpoint, match=r"mlp.gate_proj.weight.*\(160, 64\).*\(128, 64\)"):
    weights.load_params(wrong, weights.load_config(wrong))
  config = weights.load_config(source)
  params = weights.load_params(source, config)
  untied = dataclasses.replace(config, tie_embeddings=False)
  with pytest.raises(UnsupportedCheckpoint, match=r"lacks tensors: \['lm_head.weight'\]"):
    weights.load_params(source, untied)
  fewer_layers = dataclasses.replace(config, n_layers=2)
  with pytest.raises(UnsupportedCheckpoint, match=r"no parameter for.*model.layers.2"):
    weights.load_params(source, fewer_layers)
  assert os.path.isdir(source) and params


def test_hf_checkpoint_builds_the_model_config():
  spec = weights.HFCheckpoint(path=str(FIXTURES / "qwen3"), dtype="float32", remat=False)
  config = spec.model_config(max_seq_len=48)
  assert config.max_seq_len == 48 and config.qk_norm and not config.remat
