"""Decoder configurations, from the tiny CPU default up to Llama 3 / Qwen2 / Qwen3 sizes."""

from __future__ import annotations

import dataclasses
import math

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Llama 3.x frequency scaling of RoPE ('llama3' in Hugging Face configs).

  Wavelengths shorter than original_max_position_embeddings / high_freq_factor keep their
  frequency, longer than original_max_position_embeddings / low_freq_factor are divided by
  `factor`, and those between are interpolated smoothly (Meta's Llama 3.1 release).
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if not self.factor >= 1.0:
      raise ValueError(f"RopeScaling.factor must be >= 1, got {self.factor}")
    if not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(
          f"RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
          f"{self.low_freq_factor}, {self.high_freq_factor}")
    if self.original_max_position_embeddings < 1:
      raise ValueError(f"RopeScaling.original_max_position_embeddings must be >= 1, got "
                       f"{self.original_max_position_embeddings}")

  def scale_frequencies(self, inv_freq):
    """inv_freq: [D/2] angular frequencies (numpy or jax) -> the scaled frequencies."""
    low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
    high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = ((self.original_max_position_embeddings / wavelen - self.low_freq_factor)
              / (self.high_freq_factor - self.low_freq_factor))
    scaled = inv_freq / self.factor
    interpolated = (1 - smooth) * scaled + smooth * inv_freq
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    out = (wavelen > low_wavelen) * scaled + (wavelen < high_wavelen) * inv_freq
    return out + medium * interpolated


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama / Qwen2 / Qwen3-family decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

  Family switches: `qkv_bias` and `tie_embeddings` (Qwen2), `qk_norm` (Qwen3: RMSNorm over
  head_dim on every query and key head before RoPE), `rope_scaling` (Llama 3.x). `dtype` is the
  activation dtype, `param_dtype` the dtype parameters are stored in; `remat` recomputes each
  block's activations in the backward pass of a forward without a KV cache (the learner's).
  """

  vocab_size: int = 16
  d_model: int = 64
  n_layers: int = 2
  n_heads: int = 4
  n_kv_heads: int = 2
  d_ff: int = 192
  max_seq_len: int = 64
  head_dim: int | None = None  # default d_model // n_heads
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  qkv_bias: bool = False  # Qwen2 uses biases on q, k, v
  tie_embeddings: bool = False
  dtype: str = "float32"  # activation dtype
  param_dtype: str = "float32"
  qk_norm: bool = False  # Qwen3
  rope_scaling: RopeScaling | None = None  # Llama 3.x
  remat: bool = False  # gradient checkpointing of each block (forward without a cache)

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
                 "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(
          f"ModelConfig.n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
    if self.head_dim is None and self.d_model % self.n_heads:
      raise ValueError(
          f"ModelConfig.d_model={self.d_model} must be divisible by n_heads={self.n_heads} "
          "(or set head_dim)")
    if self.resolved_head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {self.resolved_head_dim}")
    if self.dtype not in DTYPES:
      raise ValueError(f"ModelConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
    if self.param_dtype not in DTYPES:
      raise ValueError(f"ModelConfig.param_dtype must be one of {DTYPES}, got "
                       f"{self.param_dtype!r}")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling or None, got "
                       f"{self.rope_scaling!r}")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  def num_params(self) -> int:
    hd = self.resolved_head_dim
    attn = self.d_model * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += hd * (self.n_heads + 2 * self.n_kv_heads)
    mlp = 3 * self.d_model * self.d_ff
    per_layer = attn + mlp + 2 * self.d_model + (2 * hd if self.qk_norm else 0)
    head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
    return self.vocab_size * self.d_model + self.n_layers * per_layer + self.d_model + head


PRESETS: dict[str, ModelConfig] = {
    # The embedded default: trains on a 2-core CPU in minutes.
    "tiny": ModelConfig(),
    # About 100x the tiny model's parameters, for sync and throughput benchmarks.
    "small": ModelConfig(d_model=320, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1024,
                         max_seq_len=128),
    # Published shapes. Real weights come from a Hugging Face directory (model/weights.py reads
    # its config.json); these presets give the shapes for benchmarks with random weights.
    "qwen2-0.5b": ModelConfig(vocab_size=151_936, d_model=896, n_layers=24, n_heads=14,
                              n_kv_heads=2, d_ff=4864, max_seq_len=4096, rope_theta=1_000_000.0,
                              qkv_bias=True, tie_embeddings=True, dtype="bfloat16"),
    "qwen3-0.6b": ModelConfig(vocab_size=151_936, d_model=1024, n_layers=28, n_heads=16,
                              n_kv_heads=8, head_dim=128, d_ff=3072, max_seq_len=4096,
                              rope_theta=1_000_000.0, qk_norm=True, tie_embeddings=True,
                              dtype="bfloat16"),
    "llama3.2-1b": ModelConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32,
                               n_kv_heads=8, d_ff=8192, max_seq_len=4096, rope_theta=500_000.0,
                               norm_eps=1e-5, tie_embeddings=True, dtype="bfloat16",
                               rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0,
                                                        high_freq_factor=4.0,
                                                        original_max_position_embeddings=8192)),
}
PRESETS["qwen2.5-0.5b"] = PRESETS["qwen2-0.5b"]  # same architecture and shapes


def get_config(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)
