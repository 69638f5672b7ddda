"""Hugging Face `config.json` <-> `ModelConfig`, for the Llama 3.x, Qwen2/2.5 and Qwen3 families.

Anything in a config.json that would change the computation and that the decoder does not
implement (another architecture, biases on the output projection, sliding-window layers, a RoPE
scaling other than Llama 3's) is refused with an error naming the field, its value and what is
supported, never silently approximated.
"""

from __future__ import annotations

import json
import os
from typing import Any

from jaxrl_async.model.config import DTYPES, ModelConfig, RopeScaling

# model_type -> the architecture class name transformers writes for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class UnsupportedCheckpoint(ValueError):
  """A checkpoint whose architecture or settings the decoder does not implement."""


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no config.json in {directory!s}: not a Hugging Face model directory")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _refuse(field: str, value, why: str, model_type: str) -> None:
  raise UnsupportedCheckpoint(
      f"config.json {field}={json.dumps(value)} is not supported for model_type "
      f"{model_type!r}: {why}")


def _rope_scaling(hf: dict, model_type: str) -> RopeScaling | None:
  scaling = hf.get("rope_scaling")
  if scaling is None:
    return None
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind == "default":
    return None
  if kind != "llama3":
    _refuse("rope_scaling", scaling, "supported rope_type values are 'default' and 'llama3'",
            model_type)
  return RopeScaling(factor=float(scaling["factor"]),
                     low_freq_factor=float(scaling["low_freq_factor"]),
                     high_freq_factor=float(scaling["high_freq_factor"]),
                     original_max_position_embeddings=int(
                         scaling["original_max_position_embeddings"]))


def _check_supported(hf: dict) -> str:
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES:
    raise UnsupportedCheckpoint(
        f"config.json model_type={model_type!r} (architectures {hf.get('architectures')}) is not "
        f"supported; supported model_type values: {sorted(ARCHITECTURES)}")
  architectures = hf.get("architectures") or [ARCHITECTURES[model_type]]
  if architectures != [ARCHITECTURES[model_type]]:
    _refuse("architectures", architectures, f"expected [{ARCHITECTURES[model_type]!r}]",
            model_type)
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    _refuse("hidden_act", act, "the MLP is SwiGLU (hidden_act 'silu')", model_type)
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field, False) and not (model_type == "qwen2" and field == "attention_bias"):
      _refuse(field, hf[field], "projections other than q/k/v of Qwen2 have no bias here",
              model_type)
  if hf.get("use_sliding_window", False):
    _refuse("use_sliding_window", True, "every layer attends to the full context", model_type)
  layer_types = hf.get("layer_types")
  if layer_types and set(layer_types) != {"full_attention"}:
    _refuse("layer_types", sorted(set(layer_types)), "only 'full_attention' layers", model_type)
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    _refuse("partial_rotary_factor", hf["partial_rotary_factor"], "RoPE covers the whole head",
            model_type)
  return model_type


def config_from_hf(hf: dict[str, Any], *, max_seq_len: int | None = None,
                   dtype: str = "float32", param_dtype: str = "float32",
                   remat: bool = False) -> ModelConfig:
  """The ModelConfig of a Hugging Face config.json (a dict).

  max_seq_len: the KV cache / sequence length to build for (default max_position_embeddings).
  """
  model_type = _check_supported(hf)
  for field in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                "intermediate_size"):
    if field not in hf:
      raise UnsupportedCheckpoint(f"config.json has no {field!r} (model_type {model_type!r})")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim")
  if head_dim is not None and head_dim * heads == hf["hidden_size"]:
    head_dim = None  # the default; keeps the config equal to a preset's
  return ModelConfig(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=heads, n_kv_heads=hf.get("num_key_value_heads") or heads,
      d_ff=hf["intermediate_size"],
      max_seq_len=max_seq_len or hf.get("max_position_embeddings", 4096),
      head_dim=head_dim, rope_theta=float(hf.get("rope_theta", 10_000.0)),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), qkv_bias=model_type == "qwen2",
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), dtype=dtype,
      param_dtype=param_dtype, qk_norm=model_type == "qwen3",
      rope_scaling=_rope_scaling(hf, model_type), remat=remat)


def model_type_of(config: ModelConfig) -> str:
  """The Hugging Face family a ModelConfig exports as."""
  if config.qk_norm:
    if config.qkv_bias:
      raise UnsupportedCheckpoint("a config with both qk_norm and qkv_bias has no Hugging Face "
                                  "family (Qwen3 has q/k norms, Qwen2 q/k/v biases)")
    return "qwen3"
  return "qwen2" if config.qkv_bias else "llama"


def config_to_hf(config: ModelConfig, *, torch_dtype: str, base: dict | None = None,
                 model_type: str | None = None) -> dict[str, Any]:
  """A config.json (dict) for `config`; fields of `base` (the source checkpoint's config.json)
  that the decoder does not own (token ids, max_position_embeddings, ...) are kept."""
  model_type = model_type or (base or {}).get("model_type") or model_type_of(config)
  if model_type not in ARCHITECTURES:
    raise UnsupportedCheckpoint(f"model_type={model_type!r}; supported: {sorted(ARCHITECTURES)}")
  if torch_dtype not in DTYPES:
    raise ValueError(f"torch_dtype must be one of {DTYPES}, got {torch_dtype!r}")
  out = dict(base or {})
  scaling = config.rope_scaling
  out.update({
      "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
      "vocab_size": config.vocab_size, "hidden_size": config.d_model,
      "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.d_ff,
      "head_dim": config.resolved_head_dim, "rope_theta": config.rope_theta,
      "rms_norm_eps": config.norm_eps, "tie_word_embeddings": config.tie_embeddings,
      "hidden_act": "silu", "torch_dtype": HF_DTYPES[torch_dtype],
      "rope_scaling": None if scaling is None else {
          "rope_type": "llama3", "factor": scaling.factor,
          "low_freq_factor": scaling.low_freq_factor,
          "high_freq_factor": scaling.high_freq_factor,
          "original_max_position_embeddings": scaling.original_max_position_embeddings},
  })
  if "dtype" in out:
    out["dtype"] = HF_DTYPES[torch_dtype]
  out.setdefault("max_position_embeddings", config.max_seq_len)
  if model_type in ("llama", "qwen3"):
    out.setdefault("attention_bias", False)
  return out
