"""Hugging Face `config.json` <-> `ModelConfig`, for the Llama 3.x, Qwen2/2.5 and Qwen3 families.

Every key of a config.json is either read into the ModelConfig, or known not to change the
forward pass (provenance, token ids, generation defaults, ...), or checked against the one value
the decoder implements; anything else (another architecture, biases the decoder lacks,
sliding-window layers, partial rotary, a RoPE scaling it does not implement, a key it does not
know) is refused with `UnsupportedCheckpoint`, naming the key, its value and the model type,
never silently approximated. docs/real_model_configs.md lists the keys and the published
configs the tests read.

Both layouts transformers writes are read the same way transformers reads them: 4.x keeps RoPE
in top-level `rope_theta` and `rope_scaling`, 5.x in one `rope_parameters` dict (theta, type
and scaling together). A file holding both layouts must give the same RoPE either way, else it
is refused. `config_to_hf` writes both, consistently, so that either version reads it back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jaxrl_async.model.config import (
  DTYPES,
  LinearRopeScaling,
  ModelConfig,
  RopeScaling,
  YarnRopeScaling,
)
from jaxrl_async.model.hf_keys import (
  ARCHITECTURES,
  DEFAULT_ROPE_THETA,
  FAMILY_DEFAULTS,
  HF_DTYPES,
  REQUIRED_KEYS,
  ROPE_KEYS,
  UnsupportedCheckpoint,
  allowed_values,
  key_problems,
  model_type_of_hf,
  problem,
  refuse,
  show,
)


def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
  """A JSON object file of a checkpoint directory ({} when the file is absent)."""
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    value = json.load(f)
  if not isinstance(value, dict):
    raise ValueError(f"{path} must hold a JSON object, got {type(value).__name__}")
  return value


def read_hf_config(directory: str | os.PathLike) -> dict[str, Any]:
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no config.json in {directory!s}: not a Hugging Face model directory")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# ---- RoPE ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RopeReading:
  """RoPE as one transformers version reads a config.json: theta and the scaling dict."""

  theta: Any
  params: dict  # rope_type and the scaling keys, without rope_theta


def _rope_params(source: dict | None) -> dict:
  params = {k: v for k, v in (source or {}).items() if k != "rope_theta"}
  kind = params.pop("rope_type", None)
  legacy = params.pop("type", None)
  params["rope_type"] = kind if kind is not None else (legacy or "default")
  if legacy is not None:
    params["type"] = legacy  # kept to compare with rope_type
  return params


def read_rope_4x(hf: dict) -> RopeReading:
  """transformers 4.x: top-level rope_theta and rope_scaling; rope_parameters is not read."""
  return RopeReading(hf.get("rope_theta", DEFAULT_ROPE_THETA), _rope_params(hf.get("rope_scaling")))


def read_rope_5x(hf: dict) -> RopeReading:
  """transformers 5.x: a non-empty rope_scaling replaces rope_parameters; the theta inside the
  dict wins over a top-level rope_theta."""
  source = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  return RopeReading(source.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)),
                     _rope_params(source))


def _has_4x_rope(hf: dict) -> bool:
  return "rope_theta" in hf or hf.get("rope_scaling") is not None


def _has_5x_rope(hf: dict) -> bool:
  return bool(hf.get("rope_parameters"))


def read_rope(hf: dict, model_type: str) -> RopeReading:
  """The RoPE settings of either layout; a file with both must describe one RoPE in both."""
  for key in ("rope_scaling", "rope_parameters"):
    if hf.get(key) is not None and not isinstance(hf[key], dict):
      refuse([problem(key, hf[key], "allowed: a dict or null")], model_type)
  if not _has_5x_rope(hf):
    reading = read_rope_4x(hf)
    if reading != read_rope_5x(hf):  # a rope_theta inside rope_scaling
      refuse([problem("rope_scaling", hf.get("rope_scaling"),
                        f"its rope_theta disagrees with rope_theta={show(hf.get('rope_theta'))}")],
              model_type)
    return reading
  parameters = hf["rope_parameters"]
  new = RopeReading(parameters.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)),
                    _rope_params(parameters))
  if _has_4x_rope(hf):
    old = read_rope_4x(hf)
    if not old == new == read_rope_5x(hf):
      refuse([problem("rope_parameters", parameters,
                        f"it gives RoPE theta {show(new.theta)} with {show(new.params)}, but "
                        f"rope_theta={show(hf.get('rope_theta'))}, rope_scaling="
                        f"{show(hf.get('rope_scaling'))} give theta {show(old.theta)} with "
                        f"{show(old.params)}; a file with both layouts must describe one RoPE")],
              model_type)
  return new


def _number(key: str, value, problems: list[str], *, minimum=None, integer=False):
  kinds = (int,) if integer else (int, float)
  if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or (
      minimum is not None and value < minimum):
    what = "an integer" if integer else "a number"
    problems.append(problem(key, value, f"allowed: {what}"
                             + (f" >= {minimum}" if minimum is not None else "")))
    return None
  return value


def _rope_scaling(reading: RopeReading, hf: dict, model_type: str):
  """The decoder's RoPE scaling object (or None) for a RopeReading, or UnsupportedCheckpoint."""
  params = dict(reading.params)
  kind, legacy = params.pop("rope_type"), params.pop("type", None)
  where = "rope_parameters" if _has_5x_rope(hf) else "rope_scaling"
  problems = []
  if legacy is not None and legacy != kind:
    problems.append(problem(f"{where}.type", legacy, f"disagrees with rope_type={show(kind)}"))
  if kind not in ROPE_KEYS:
    refuse([problem(f"{where}.rope_type", kind,
                      f"supported rope_type values: {sorted(ROPE_KEYS)}")], model_type)
  if "partial_rotary_factor" in params:
    value = params.pop("partial_rotary_factor")
    if not allowed_values(1, 1.0)(value):
      problems.append(problem(f"{where}.partial_rotary_factor", value,
                               "allowed: 1.0 (RoPE covers the head)"))
  allowed = ROPE_KEYS[kind]
  for key in sorted(set(params) - set(allowed)):
    problems.append(problem(f"{where}.{key}", params[key],
                             f"not a key of rope_type {kind!r}; allowed: {sorted(allowed)}"))
  for key, default in allowed.items():
    if default is None and params.get(key) is None:
      problems.append(f"{where}.{key} is missing (required for rope_type {kind!r})")
  if problems:
    refuse(problems, model_type)
  return _make_scaling(kind, params, hf, model_type, where)


def _make_scaling(kind: str, params: dict, hf: dict, model_type: str, where: str):
  problems: list[str] = []
  max_positions = hf.get("max_position_embeddings",
                         FAMILY_DEFAULTS[model_type]["max_position_embeddings"])

  def num(key, **kwargs):
    return _number(f"{where}.{key}", params[key], problems, **kwargs)

  if kind == "default":
    return None
  factor = num("factor", minimum=1)
  if kind == "linear":
    scaling = dict(factor=factor)
  else:
    params.setdefault("original_max_position_embeddings", max_positions)
    original = num("original_max_position_embeddings", minimum=1, integer=True)
    if kind == "llama3":
      scaling = dict(factor=factor, low_freq_factor=num("low_freq_factor"),
                     high_freq_factor=num("high_freq_factor"),
                     original_max_position_embeddings=original)
    else:
      # transformers reads a missing (or 0) beta as its default
      fast, slow = params.get("beta_fast") or 32.0, params.get("beta_slow") or 1.0
      attention = params.get("attention_factor")
      scaling = dict(factor=factor, original_max_position_embeddings=original,
                     beta_fast=_number(f"{where}.beta_fast", fast, problems),
                     beta_slow=_number(f"{where}.beta_slow", slow, problems),
                     attention_factor=None if attention is None else num("attention_factor"),
                     truncate=params.get("truncate", True))
      if not isinstance(scaling["truncate"], bool):
        problems.append(problem(f"{where}.truncate", scaling["truncate"], "allowed: a bool"))
  if problems:
    refuse(problems, model_type)
  cls = {"linear": LinearRopeScaling, "llama3": RopeScaling, "yarn": YarnRopeScaling}[kind]
  try:
    return cls(**scaling)
  except ValueError as e:
    raise UnsupportedCheckpoint(f"config.json {where}={show(dict(params, rope_type=kind))} "
                                f"is not supported for model_type {model_type!r}: {e}") from e


# ---- config.json -> ModelConfig ------------------------------------------------------------------
def _read_shape(hf: dict, model_type: str) -> dict:
  """The integer shape fields, transformers' defaults filled in, checked."""
  missing = [k for k in REQUIRED_KEYS if k not in hf]
  if missing:
    raise UnsupportedCheckpoint(f"config.json has no {missing[0]!r} (model_type {model_type!r}); "
                                f"required: {list(REQUIRED_KEYS)}")
  defaults = FAMILY_DEFAULTS[model_type]
  problems: list[str] = []
  shape = {k: _number(k, hf[k], problems, minimum=1, integer=True) for k in REQUIRED_KEYS}
  kv = hf.get("num_key_value_heads", defaults["num_key_value_heads"])
  shape["num_key_value_heads"] = (shape["num_attention_heads"] if kv is None else
                                  _number("num_key_value_heads", kv, problems, minimum=1,
                                          integer=True))
  head_dim = hf.get("head_dim", defaults["head_dim"])
  if head_dim is None and model_type != "llama" and "head_dim" in hf:
    problems.append(problem("head_dim", None, f"allowed: an integer ({model_type} reads no "
                             "default for an explicit null)"))
  elif head_dim is not None:
    head_dim = _number("head_dim", head_dim, problems, minimum=2, integer=True)
  shape["head_dim"] = head_dim
  shape["max_position_embeddings"] = _number(
      "max_position_embeddings", hf.get("max_position_embeddings",
                                        defaults["max_position_embeddings"]),
      problems, minimum=1, integer=True)
  shape["rms_norm_eps"] = _number("rms_norm_eps", hf.get("rms_norm_eps", defaults["rms_norm_eps"]),
                                  problems)
  layer_types = hf.get("layer_types")
  if isinstance(layer_types, list) and len(layer_types) != shape["num_hidden_layers"]:
    problems.append(problem("layer_types", layer_types, f"{len(layer_types)} entries for "
                             f"num_hidden_layers={shape['num_hidden_layers']}"))
  tie = hf.get("tie_word_embeddings", defaults["tie_word_embeddings"])
  if not isinstance(tie, bool):
    problems.append(problem("tie_word_embeddings", tie, "allowed: true or false"))
  shape["tie_word_embeddings"] = tie
  if problems:
    refuse(problems, model_type)
  return shape


def _theta(reading: RopeReading, model_type: str) -> float:
  problems: list[str] = []
  theta = _number("rope_theta", reading.theta, problems)
  if problems or not theta > 1:
    refuse([problem("rope_theta", reading.theta, "allowed: a number > 1")], model_type)
  return float(theta)


def config_from_hf(hf: dict[str, Any], *, max_seq_len: int | None = None,
                   dtype: str = "float32", param_dtype: str = "float32",
                   remat: bool = False) -> ModelConfig:
  """The ModelConfig of a Hugging Face config.json (a dict), in the 4.x or the 5.x layout.

  max_seq_len: the KV cache / sequence length to build for (default max_position_embeddings).
  Raises UnsupportedCheckpoint for any key the decoder cannot honour.
  """
  for name, value in (("dtype", dtype), ("param_dtype", param_dtype)):
    if value not in DTYPES:
      raise ValueError(f"{name} must be one of {DTYPES}, got {value!r}")
  model_type = model_type_of_hf(hf)
  problems = key_problems(hf, model_type)
  if problems:
    refuse(problems, model_type)
  shape = _read_shape(hf, model_type)
  reading = read_rope(hf, model_type)
  theta = _theta(reading, model_type)
  scaling = _rope_scaling(reading, hf, model_type)
  heads, head_dim = shape["num_attention_heads"], shape["head_dim"]
  if head_dim is not None and head_dim * heads == shape["hidden_size"]:
    head_dim = None  # the default; keeps the config equal to a preset's
  try:
    return ModelConfig(
        vocab_size=shape["vocab_size"], d_model=shape["hidden_size"],
        n_layers=shape["num_hidden_layers"], n_heads=heads,
        n_kv_heads=shape["num_key_value_heads"], d_ff=shape["intermediate_size"],
        max_seq_len=max_seq_len or shape["max_position_embeddings"], head_dim=head_dim,
        rope_theta=theta, norm_eps=float(shape["rms_norm_eps"]), qkv_bias=model_type == "qwen2",
        tie_embeddings=shape["tie_word_embeddings"], dtype=dtype, param_dtype=param_dtype,
        qk_norm=model_type == "qwen3", rope_scaling=scaling, remat=remat)
  except ValueError as e:
    raise UnsupportedCheckpoint(f"config.json gives an invalid decoder for model_type "
                                f"{model_type!r}: {e}") from e


# ---- ModelConfig -> config.json ------------------------------------------------------------------
def model_type_of(config: ModelConfig) -> str:
  """The Hugging Face family a ModelConfig exports as."""
  if config.qk_norm:
    if config.qkv_bias:
      raise UnsupportedCheckpoint("a config with both qk_norm and qkv_bias has no Hugging Face "
                                  "family (Qwen3 has q/k norms, Qwen2 q/k/v biases)")
    return "qwen3"
  return "qwen2" if config.qkv_bias else "llama"


def rope_scaling_to_hf(scaling) -> dict | None:
  """The rope_scaling dict (4.x layout, without rope_theta) of a RoPE scaling, or None."""
  if scaling is None:
    return None
  if isinstance(scaling, LinearRopeScaling):
    return {"rope_type": "linear", "factor": scaling.factor}
  if isinstance(scaling, RopeScaling):
    return {"rope_type": "llama3", "factor": scaling.factor,
            "low_freq_factor": scaling.low_freq_factor,
            "high_freq_factor": scaling.high_freq_factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings}
  out = {"rope_type": "yarn", "factor": scaling.factor,
         "original_max_position_embeddings": scaling.original_max_position_embeddings,
         "beta_fast": scaling.beta_fast, "beta_slow": scaling.beta_slow,
         "attention_factor": scaling.attention_factor}
  if not scaling.truncate:
    out["truncate"] = False
  return out


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
  """RoPE in both layouts, equal in content: rope_theta and rope_scaling (4.x), and
  rope_parameters (5.x: theta, type and scaling keys in one dict)."""
  scaling = rope_scaling_to_hf(config.rope_scaling)
  parameters = {"rope_theta": config.rope_theta, **(scaling or {"rope_type": "default"})}
  return {"rope_theta": config.rope_theta, "rope_scaling": scaling,
          "rope_parameters": parameters}


def config_to_hf(config: ModelConfig, *, torch_dtype: str, base: dict | None = None,
                 model_type: str | None = None) -> dict[str, Any]:
  """A config.json (dict) for `config` that transformers 4.x and 5.x both read as `config`;
  fields of `base` (the source checkpoint's config.json) that the decoder does not own (token
  ids, max_position_embeddings, ...) are kept."""
  model_type = model_type or (base or {}).get("model_type") or model_type_of(config)
  if model_type not in ARCHITECTURES:
    raise UnsupportedCheckpoint(f"model_type={model_type!r}; supported: {sorted(ARCHITECTURES)}")
  if torch_dtype not in DTYPES:
    raise ValueError(f"torch_dtype must be one of {DTYPES}, got {torch_dtype!r}")
  out = dict(base or {})
  out.update({
      "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
      "vocab_size": config.vocab_size, "hidden_size": config.d_model,
      "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
      "num_key_value_heads": config.n_kv_heads, "intermediate_size": config.d_ff,
      "head_dim": config.resolved_head_dim, "rms_norm_eps": config.norm_eps,
      "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu",
      "torch_dtype": HF_DTYPES[torch_dtype], "dtype": HF_DTYPES[torch_dtype],
      **rope_to_hf(config),
  })
  out.setdefault("max_position_embeddings", config.max_seq_len)
  if model_type in ("llama", "qwen3"):
    out.setdefault("attention_bias", False)
  if "layer_types" in out:  # one per layer, as 5.x writes them for Qwen
    out["layer_types"] = ["full_attention"] * config.n_layers
  return out
