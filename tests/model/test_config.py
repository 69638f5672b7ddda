"""Tests for jaxrl_async.model.config: validation names the field, presets, parameter counts."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl_async.model import PRESETS, ModelConfig, abstract_params, get_config


def _count(params) -> int:
  return int(sum(np.prod(leaf.shape) for leaf in jax.tree.leaves(params)))


@pytest.mark.parametrize("field", ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                                   "d_ff", "max_seq_len"])
@pytest.mark.parametrize("bad", [0, -3, 2.0])
def test_positive_int_fields_are_validated_by_name(field, bad):
  with pytest.raises(ValueError, match=rf"ModelConfig\.{field} must be a positive int.*{bad!r}"):
    ModelConfig(**{field: bad})


def test_heads_not_divisible_by_kv_heads_names_both_fields():
  with pytest.raises(ValueError, match=r"n_heads=6 must be a multiple of n_kv_heads=4"):
    ModelConfig(d_model=48, n_heads=6, n_kv_heads=4)


def test_d_model_not_divisible_by_heads_names_fields_unless_head_dim_is_set():
  with pytest.raises(ValueError, match=r"d_model=66 must be divisible by n_heads=4"):
    ModelConfig(d_model=66, n_heads=4)
  config = ModelConfig(d_model=66, n_heads=4, head_dim=8)
  assert config.resolved_head_dim == 8


def test_odd_head_dim_is_rejected_for_rope():
  with pytest.raises(ValueError, match=r"head_dim must be even.*7"):
    ModelConfig(head_dim=7)
  with pytest.raises(ValueError, match=r"head_dim must be even.*9"):
    ModelConfig(d_model=36, n_heads=4)  # derived head_dim 9


def test_bad_dtype_names_the_field_and_value():
  with pytest.raises(ValueError, match=r"ModelConfig\.dtype.*'float64'"):
    ModelConfig(dtype="float64")


def test_config_is_frozen():
  config = ModelConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.d_model = 8  # type: ignore[misc]


def test_get_config_applies_overrides_and_validates_them():
  config = get_config("tiny", max_seq_len=51, vocab_size=32)
  assert (config.max_seq_len, config.vocab_size) == (51, 32)
  assert PRESETS["tiny"].max_seq_len == 64  # the preset itself is untouched
  with pytest.raises(ValueError, match="n_kv_heads"):
    get_config("tiny", n_kv_heads=3)
  with pytest.raises(ValueError, match=r"unknown model preset 'huge'.*tiny"):
    get_config("huge")


def test_tiny_preset_values():
  config = get_config("tiny")
  assert config.resolved_head_dim == config.d_model // config.n_heads == 16
  assert config.n_heads % config.n_kv_heads == 0


@pytest.mark.parametrize("overrides", [
    {}, {"tie_embeddings": True}, {"qkv_bias": True}, {"head_dim": 8},
    {"n_kv_heads": 4, "qkv_bias": True, "tie_embeddings": True},
])
def test_num_params_matches_the_built_model(overrides):
  config = get_config("tiny", **overrides)
  _, params, _ = abstract_params(config)
  assert config.num_params() == _count(params)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_num_params_matches_abstract_params_for_every_preset(name):
  config = get_config(name)
  _, params, _ = abstract_params(config)  # shapes only: nothing is allocated
  assert config.num_params() == _count(params)


@pytest.mark.parametrize("name, published", [
    ("qwen2-0.5b", 494_032_768),  # Qwen2-0.5B model card / HF safetensors total
    ("llama3.2-1b", 1_235_814_400),  # Llama-3.2-1B HF safetensors total
])
def test_published_presets_have_the_published_parameter_count(name, published):
  assert get_config(name).num_params() == published
