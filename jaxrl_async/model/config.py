"""Decoder configurations, from the tiny CPU default up to Llama 3 / Qwen2 / Qwen3 sizes."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import numpy as np

DTYPES = ("float32", "bfloat16", "float16")


def _check_factor(owner: str, factor: float) -> None:
  if not factor >= 1.0:
    raise ValueError(f"{owner}.factor must be >= 1, got {factor}")


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

  rope_type: ClassVar[str] = "llama3"
  attention_factor: ClassVar[float] = 1.0

  def __post_init__(self):
    _check_factor("RopeScaling", self.factor)
    if not 0 < self.low_freq_factor < self.high_freq_factor:
      raise ValueError(
          f"RopeScaling needs 0 < low_freq_factor < high_freq_factor, got "
          f"{self.low_freq_factor}, {self.high_freq_factor}")
    if self.original_max_position_embeddings < 1:
      raise ValueError(f"RopeScaling.original_max_position_embeddings must be >= 1, got "
                       f"{self.original_max_position_embeddings}")

  def scale_frequencies(self, inv_freq, theta: float | None = None):
    """inv_freq: [D/2] angular frequencies (numpy or jax) -> the scaled frequencies."""
    del theta  # the wavelengths alone decide
    return llama3_frequencies(inv_freq, self.factor, self.low_freq_factor,
                              self.high_freq_factor, self.original_max_position_embeddings)


@dataclasses.dataclass(frozen=True)
class LinearRopeScaling:
  """Position interpolation ('linear' in Hugging Face configs): every frequency over `factor`."""

  factor: float = 2.0

  rope_type: ClassVar[str] = "linear"
  attention_factor: ClassVar[float] = 1.0

  def __post_init__(self):
    _check_factor("LinearRopeScaling", self.factor)

  def scale_frequencies(self, inv_freq, theta: float | None = None):
    del theta
    return linear_frequencies(inv_freq, self.factor)


@dataclasses.dataclass(frozen=True)
class YarnRopeScaling:
  """YaRN (Peng et al. 2023, 'yarn' in Hugging Face configs): NTK-by-parts interpolation of the
  frequencies and a temperature on the attention logits.

  Dimensions that turn more than beta_fast times over original_max_position_embeddings keep
  their frequency, those turning fewer than beta_slow times are divided by `factor`, with a
  linear ramp between (over the dimension index, its ends floored and ceiled when `truncate`).
  Rotated queries and keys are both multiplied by attention_factor (default 0.1 ln(factor) + 1),
  so the logits by its square.
  """

  factor: float = 4.0
  original_max_position_embeddings: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None  # None: yarn_attention_factor(factor)
  truncate: bool = True

  rope_type: ClassVar[str] = "yarn"

  def __post_init__(self):
    _check_factor("YarnRopeScaling", self.factor)
    if self.original_max_position_embeddings < 1:
      raise ValueError(f"YarnRopeScaling.original_max_position_embeddings must be >= 1, got "
                       f"{self.original_max_position_embeddings}")
    if not 0 < self.beta_slow < self.beta_fast:
      raise ValueError(f"YarnRopeScaling needs 0 < beta_slow < beta_fast, got "
                       f"{self.beta_slow}, {self.beta_fast}")
    if self.attention_factor is None:
      object.__setattr__(self, "attention_factor", yarn_attention_factor(self.factor))
    if not self.attention_factor > 0:
      raise ValueError(f"YarnRopeScaling.attention_factor must be > 0, got "
                       f"{self.attention_factor}")

  def scale_frequencies(self, inv_freq, theta: float | None = None):
    if theta is None:
      raise ValueError("YarnRopeScaling.scale_frequencies needs theta (the RoPE base)")
    return yarn_frequencies(inv_freq, theta, self.factor, self.original_max_position_embeddings,
                            self.beta_fast, self.beta_slow, self.truncate)


ROPE_SCALINGS = (RopeScaling, LinearRopeScaling, YarnRopeScaling)


# ---- RoPE frequencies: pure functions of numpy or jax arrays ------------------------------------
def rope_inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
  """The [head_dim / 2] angular frequencies theta^(-2i / head_dim) of plain RoPE (float64)."""
  return theta ** (-np.arange(head_dim // 2, dtype=np.float64) * 2 / head_dim)


def linear_frequencies(inv_freq, factor: float):
  """Position interpolation: positions divided by `factor`, i.e. every frequency."""
  return inv_freq / factor


def llama3_frequencies(inv_freq, factor: float, low_freq_factor: float, high_freq_factor: float,
                       original_max_position_embeddings: int):
  """Llama 3.1's scaling: wavelengths 2 pi / f below L / high_freq_factor kept, above
  L / low_freq_factor divided by `factor`, interpolated in L / wavelength between (L: the
  original context length)."""
  length = original_max_position_embeddings
  low_wavelen, high_wavelen = length / low_freq_factor, length / high_freq_factor
  wavelen = 2 * math.pi / inv_freq
  smooth = (length / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  scaled = inv_freq / factor
  interpolated = (1 - smooth) * scaled + smooth * inv_freq
  medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  out = (wavelen > low_wavelen) * scaled + (wavelen < high_wavelen) * inv_freq
  return out + medium * interpolated


def yarn_correction_dim(rotations: float, head_dim: int, theta: float, length: int) -> float:
  """The (fractional) dimension index i whose wavelength 2 pi theta^(2i / head_dim) fits
  `rotations` times into `length` positions."""
  return head_dim * math.log(length / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn_ramp(head_dim: int, theta: float, length: int, beta_fast: float, beta_slow: float,
              truncate: bool = True) -> np.ndarray:
  """[head_dim / 2] weights of the interpolated frequency: 0 up to the dimension turning
  beta_fast times over `length`, 1 from the one turning beta_slow times, linear between."""
  low = yarn_correction_dim(beta_fast, head_dim, theta, length)
  high = yarn_correction_dim(beta_slow, head_dim, theta, length)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # a step, not a division by zero
  index = np.arange(head_dim // 2, dtype=np.float64)
  return np.clip((index - low) / (high - low), 0.0, 1.0)


def yarn_frequencies(inv_freq, theta: float, factor: float, original_max_position_embeddings: int,
                     beta_fast: float = 32.0, beta_slow: float = 1.0, truncate: bool = True):
  """YaRN's NTK-by-parts frequencies: inv_freq / factor where the ramp is 1 (slow dimensions),
  inv_freq where it is 0 (fast ones), their ramp-weighted mean between."""
  head_dim = 2 * inv_freq.shape[-1]
  ramp = np.asarray(yarn_ramp(head_dim, theta, original_max_position_embeddings, beta_fast,
                              beta_slow, truncate), dtype=inv_freq.dtype)
  return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_attention_factor(factor: float) -> float:
  """YaRN's default temperature sqrt(1/t) = 0.1 ln(factor) + 1 (1 when factor <= 1)."""
  return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A Llama / Qwen2 / Qwen3-family decoder: RMSNorm, RoPE, SwiGLU MLP, grouped-query attention.

  Family switches: `qkv_bias` and `tie_embeddings` (Qwen2), `qk_norm` (Qwen3: RMSNorm over
  head_dim on every query and key head before RoPE), `rope_scaling` (RoPE frequency scaling:
  Llama 3.x's, linear or YaRN). `dtype` is the activation dtype, `param_dtype` the dtype
  parameters are stored in; `remat` recomputes each block's activations in the backward pass of
  a forward without a KV cache (the learner's).
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
  # Llama 3.x ('llama3'), position interpolation ('linear') or YaRN ('yarn')
  rope_scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None
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
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, ROPE_SCALINGS):
      raise ValueError(f"ModelConfig.rope_scaling must be a RopeScaling (llama3), "
                       f"LinearRopeScaling, YarnRopeScaling or None, got {self.rope_scaling!r}")

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
