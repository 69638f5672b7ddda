"""Which keys of a Hugging Face config.json the importer reads, which it knows leave the forward
pass unchanged, which it checks against the one value the decoder implements, and which it
refuses (`UnsupportedCheckpoint`, naming the key, its value and the model type). An allowlist:
a key in none of these tables is refused too. docs/real_model_configs.md lists them.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# model_type -> the architecture class name transformers writes for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}
DEFAULT_ROPE_THETA = 10_000.0

# Transformers' defaults (4.x and 5.x agree) for the read keys a config.json may omit.
FAMILY_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "tie_word_embeddings": False},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "tie_word_embeddings": False},
}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size")
READ_KEYS = frozenset(REQUIRED_KEYS) | {
    "model_type", "architectures", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters"}

# Keys that do not change the forward pass, whatever their value: provenance and dtype on disk
# (the caller picks the compute dtype), token ids, cache and output switches, initialisation,
# the attention kernel, labels of classification heads, and the generation defaults old
# transformers versions wrote into config.json.
NO_EFFECT_KEYS = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "_attn_implementation",
    "attn_implementation", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "use_cache",
    "initializer_range", "output_attentions", "output_hidden_states", "return_dict",
    "torchscript", "use_bfloat16", "tf_legacy_loss", "is_decoder", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
    "task_specific_params", "gradient_checkpointing",
    # generation defaults
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})


@dataclasses.dataclass(frozen=True)
class _Allowed:
  """The values of a key the decoder implements (`ok`), described for the error (`allowed`)."""

  ok: Any
  allowed: str


def allowed_values(*values):
  return lambda v: any(v == x and type(v) is type(x) for x in values)


_FALSE = _Allowed(allowed_values(False), "false")
_ANY = _Allowed(lambda v: True, "any value")
_NO_SLIDING = _Allowed(allowed_values(False), "false (every layer attends to the full context)")
_FULL_LAYERS = _Allowed(  # the number of entries is checked with the shape
    lambda v: isinstance(v, list) and all(t == "full_attention" for t in v),
    '"full_attention" for every layer (every layer attends to the full context)')
# Keys of every family that the decoder fixes to one value.
COMMON_CHECKED = {
    "hidden_act": _Allowed(allowed_values("silu"), '"silu" (the MLP is SwiGLU)'),
    "attention_dropout": _Allowed(allowed_values(0, 0.0), "0 (the decoder has no dropout)"),
    "partial_rotary_factor": _Allowed(allowed_values(1, 1.0), "1.0 (RoPE covers the head)"),
    "is_encoder_decoder": _FALSE, "add_cross_attention": _FALSE, "tie_encoder_decoder": _FALSE,
    "cross_attention_hidden_size": _Allowed(lambda v: v is None, "null"),
    "pruned_heads": _Allowed(lambda v: v == {}, "{} (no pruned heads)"),
}
# Keys of one family: checked values, or no effect once the checked ones hold (a sliding window
# size with no sliding layer; pretraining_tp only slices transformers 4.x's matmuls).
FAMILY_CHECKED = {
    "llama": {"attention_bias": _Allowed(allowed_values(False), "false (no q/k/v/o biases on Llama)"),
              "mlp_bias": _Allowed(allowed_values(False), "false (the MLP has no biases)"),
              "pretraining_tp": _ANY},
    "qwen2": {"use_sliding_window": _NO_SLIDING, "sliding_window": _ANY,
              "max_window_layers": _ANY, "layer_types": _FULL_LAYERS,
              "use_mrope": _Allowed(allowed_values(False), "false (one position per token)")},
    "qwen3": {"attention_bias": _Allowed(allowed_values(False), "false (Qwen3 has no q/k/v/o biases)"),
              "use_sliding_window": _NO_SLIDING, "sliding_window": _ANY,
              "max_window_layers": _ANY, "layer_types": _FULL_LAYERS},
}
# Known keys that always change the computation in a way the decoder does not implement.
UNSUPPORTED_KEYS = {
    "quantization_config": "quantized weights are not read",
    "auto_map": "custom modeling code is not run",
    "original_max_position_embeddings": "set it inside the RoPE scaling instead",
}

# RoPE: the scaling keys of each rope_type (beside rope_type / type, rope_theta and
# partial_rotary_factor); `None` marks the required ones.
ROPE_KEYS = {
    "default": {},
    "linear": {"factor": None},
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None,
               "original_max_position_embeddings": "max_position_embeddings"},
    "yarn": {"factor": None, "original_max_position_embeddings": "max_position_embeddings",
             "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": "0.1 ln(factor) + 1",
             "truncate": True},
}


class UnsupportedCheckpoint(ValueError):
  """A checkpoint whose architecture or settings the decoder does not implement."""


def show(value) -> str:
  return json.dumps(value, sort_keys=True)


def problem(key: str, value, why: str) -> str:
  return f"{key}={show(value)} ({why})"


def refuse(problems: list[str], model_type: str) -> None:
  raise UnsupportedCheckpoint(
      f"config.json is not supported for model_type {model_type!r}: " + "; ".join(problems))


# ---- which keys ----------------------------------------------------------------------------------
def model_type_of_hf(hf: dict) -> str:
  model_type = hf.get("model_type")
  if model_type not in ARCHITECTURES:
    raise UnsupportedCheckpoint(
        f"config.json model_type={model_type!r} (architectures {hf.get('architectures')}) is not "
        f"supported; supported model_type values: {sorted(ARCHITECTURES)}")
  return model_type


def key_problems(hf: dict, model_type: str) -> list[str]:
  """One line per key of `hf` that the decoder cannot honour (empty when all are fine)."""
  checked = {**COMMON_CHECKED, **FAMILY_CHECKED[model_type]}
  problems = []
  for key in sorted(hf):
    value = hf[key]
    if key in READ_KEYS or key in NO_EFFECT_KEYS:
      continue
    if key in checked:
      if not checked[key].ok(value):
        problems.append(problem(key, value, f"allowed: {checked[key].allowed}"))
    elif key in UNSUPPORTED_KEYS:
      problems.append(problem(key, value, UNSUPPORTED_KEYS[key]))
    else:
      problems.append(problem(key, value, f"not a {model_type} setting the decoder implements "
                               "or knows to leave the forward pass unchanged"))
  architectures = hf.get("architectures") or [ARCHITECTURES[model_type]]
  if architectures != [ARCHITECTURES[model_type]]:
    problems.insert(0, problem("architectures", architectures,
                                f"allowed: [{ARCHITECTURES[model_type]!r}]"))
  return problems
