"""Decoder configurations, from the tiny CPU default up to Llama / Qwen2 sizes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama / Qwen2-family decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention."""

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
  dtype: str = "float32"  # activation dtype; parameters stay float32

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
    if self.dtype not in ("float32", "bfloat16", "float16"):
      raise ValueError(f"ModelConfig.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")

  @property
  def resolved_head_dim(self) -> int:
    return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

  def num_params(self) -> int:
    hd = self.resolved_head_dim
    attn = self.d_model * hd * (self.n_heads * 2 + self.n_kv_heads * 2)
    if self.qkv_bias:
      attn += hd * (self.n_heads + 2 * self.n_kv_heads)
    mlp = 3 * self.d_model * self.d_ff
    per_layer = attn + mlp + 2 * self.d_model
    head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
    return self.vocab_size * self.d_model + self.n_layers * per_layer + self.d_model + head


PRESETS: dict[str, ModelConfig] = {
    # The embedded default: trains on a 2-core CPU in minutes.
    "tiny": ModelConfig(),
    # About 100x the tiny model's parameters, for sync and throughput benchmarks.
    "small": ModelConfig(d_model=320, n_layers=8, n_heads=8, n_kv_heads=4, d_ff=1024,
                         max_seq_len=128),
    # Published shapes (weights must be imported; see model/weights.py).
    "qwen2-0.5b": ModelConfig(vocab_size=151_936, d_model=896, n_layers=24, n_heads=14,
                              n_kv_heads=2, d_ff=4864, max_seq_len=4096, rope_theta=1_000_000.0,
                              qkv_bias=True, tie_embeddings=True, dtype="bfloat16"),
    "llama3.2-1b": ModelConfig(vocab_size=128_256, d_model=2048, n_layers=16, n_heads=32,
                               n_kv_heads=8, d_ff=8192, max_seq_len=4096, rope_theta=500_000.0,
                               tie_embeddings=True, dtype="bfloat16"),
}


def get_config(name: str, **overrides) -> ModelConfig:
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  return dataclasses.replace(PRESETS[name], **overrides)
