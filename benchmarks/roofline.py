"""The roofline of this machine and of our decoder's work: what prefill, decode and the learner
update could take at best, so that benchmarks report a fraction of it.

Two parts:
- pure counts: the FLOPs and bytes of the decoder (`jaxrl_async.model.decoder`) for a
  `ModelConfig` and a shape, as the code runs it (attention over every key it computes: the whole
  static KV cache in decode, the whole row in prefill and in the learner);
- measurements: this machine's matmul peak (GFLOP/s) for a dtype, and its memory bandwidth
  (GB/s), each the best of a few timed runs of one jitted program.

A phase's bound is max(FLOPs / peak, bytes / bandwidth); its fraction of the bound is
bound / measured time (1.0: at the roofline). Counts use 2 FLOPs per multiply-add.

    python benchmarks/roofline.py     # this machine's peaks and bandwidth, one JSON line
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_async.model.config import ModelConfig


# ---- counts: pure functions of a ModelConfig --------------------------------------------------
def layer_matmul_params(config: ModelConfig) -> int:
  """Weights one block multiplies each token by: q, k, v, o and the SwiGLU gate, up, down."""
  d, hd = config.d_model, config.resolved_head_dim
  attention = d * config.n_heads * hd * 2 + d * config.n_kv_heads * hd * 2
  return attention + 3 * d * config.d_ff


def head_params(config: ModelConfig) -> int:
  return config.d_model * config.vocab_size


def forward_flops(config: ModelConfig, tokens: int, keys_per_query: int,
                  with_head: bool = True) -> int:
  """One forward pass over `tokens` tokens, each query attending `keys_per_query` keys.

  Per token: 2 x (block weights) per layer, 2 x 2 x keys x heads x head_dim for the scores and
  the weighted values per layer, and 2 x d_model x vocab for the head (if `with_head`).
  """
  attention = 4 * keys_per_query * config.n_heads * config.resolved_head_dim
  per_token = config.n_layers * (2 * layer_matmul_params(config) + attention)
  if with_head:
    per_token += 2 * head_params(config)
  return tokens * per_token


def param_bytes(config: ModelConfig) -> int:
  return config.num_params() * np.dtype(jnp.dtype(config.param_dtype)).itemsize


def block_param_bytes(config: ModelConfig) -> int:
  """The parameters of the blocks and the final norm: all but the embedding and the head."""
  vocab_tables = 1 if config.tie_embeddings else 2
  count = config.num_params() - vocab_tables * config.vocab_size * config.d_model
  return count * np.dtype(jnp.dtype(config.param_dtype)).itemsize


def kv_cache_bytes(config: ModelConfig, batch: int, length: int) -> int:
  """Keys and values of every layer, in the activation dtype (`KVCache.zeros`)."""
  itemsize = np.dtype(jnp.dtype(config.dtype)).itemsize
  return 2 * config.n_layers * batch * length * config.n_kv_heads * config.resolved_head_dim * itemsize


@dataclasses.dataclass(frozen=True)
class Work:
  """What a phase must do at least: FLOPs, bytes moved to or from memory, and which peak the
  FLOPs run at (the dtype of the matmuls)."""

  flops: float
  bytes: float
  dtype: str

  def bound_s(self, peaks_gflops: dict[str, float], bandwidth_gbs: float) -> float:
    return max(self.flops / (peaks_gflops[self.dtype] * 1e9), self.bytes / (bandwidth_gbs * 1e9))


def prefill_work(config: ModelConfig, length: int) -> Work:
  """One prompt padded to `length` (the engine's bucket): every position through every block,
  each attending the whole bucket; no head (the engine's prefill keeps only the cache, so XLA
  drops the logits); the blocks' weights read and the cache written once."""
  flops = forward_flops(config, length, length, with_head=False)
  return Work(flops, block_param_bytes(config) + kv_cache_bytes(config, 1, length),
              config.dtype)


def decode_step_work(config: ModelConfig, slots: int, cache_length: int) -> Work:
  """One decode step of `slots` sequences: one token each, attending the whole static cache of
  `cache_length` positions; every weight and the whole KV cache read once."""
  flops = forward_flops(config, slots, cache_length)
  return Work(flops, param_bytes(config) + kv_cache_bytes(config, slots, cache_length),
              config.dtype)


def update_work(config: ModelConfig, rows: int, row_length: int, *,
                head_recompute: bool = True) -> Work:
  """One learner update on `rows` packed rows of `row_length` tokens (the batch's tokens shape).

  The model runs over row_length - 1 positions per row: a row's last token is only a target
  (`step.sequence_logprobs`). FLOPs: the forward, twice it for the backward, the blocks' forward
  again with `config.remat`, the head's forward again with `head_recompute` (chunked logprobs
  recompute each chunk's logits in the backward pass). Bytes: AdamW reads params, grads and both
  moments and writes params and moments (float32 moments), beside reading the weights for the
  forward and backward.
  """
  positions = row_length - 1
  tokens = rows * positions
  blocks = forward_flops(config, tokens, positions, with_head=False)
  head = forward_flops(config, tokens, 0, with_head=True) - forward_flops(
      config, tokens, 0, with_head=False)
  flops = 3 * (blocks + head) + (blocks if config.remat else 0) + (head if head_recompute else 0)
  weights = param_bytes(config)
  moments = 2 * config.num_params() * 4
  optimizer = 3 * weights + 2 * moments + weights  # read p, g, write p; read+write moments; fwd+bwd
  return Work(flops, optimizer + 2 * weights, config.dtype)


def model_flops_per_update(config: ModelConfig, rows: int, row_length: int) -> float:
  """6 x (matmul params) x tokens plus attention: the usual 'model FLOPs', no recompute, over
  the row_length - 1 positions per row the model runs over (as `update_work`)."""
  positions = row_length - 1
  return 3 * forward_flops(config, rows * positions, positions)


def fraction(work: Work, seconds: float, peaks_gflops: dict[str, float],
             bandwidth_gbs: float) -> dict:
  """A phase's account: its FLOPs and bytes, the bound and the fraction of it achieved."""
  bound = work.bound_s(peaks_gflops, bandwidth_gbs)
  return {"gflop": round(work.flops / 1e9, 4), "gbytes": round(work.bytes / 1e9, 4),
          "dtype": work.dtype,
          "compute_s": round(work.flops / (peaks_gflops[work.dtype] * 1e9), 6),
          "memory_s": round(work.bytes / (bandwidth_gbs * 1e9), 6),
          "bound_s": round(bound, 6), "measured_s": round(seconds, 6),
          "achieved_gflops": round(work.flops / seconds / 1e9, 2),
          "fraction_of_bound": round(bound / seconds, 4)}


# ---- measurements -----------------------------------------------------------------------------
def _best_seconds(fn, *args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm
  best = float("inf")
  for _ in range(repeats):
    began = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - began)
  return best


def measure_matmul_peak(dtype: str, size: int = 2048, repeats: int = 5) -> float:
  """GFLOP/s of a [size, size] x [size, size] matmul in `dtype`, accumulated in float32 (as the
  decoder's `dense` does), best of `repeats`."""
  a = jnp.ones((size, size), dtype)
  b = jnp.ones((size, size), dtype)
  matmul = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32))
  return 2 * size**3 / _best_seconds(matmul, a, b, repeats=repeats) / 1e9


def measure_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
  """GB/s of reading a float32 array of `megabytes` MB (a jitted sum), best of `repeats`."""
  x = jnp.ones((megabytes * 2**20 // 4,), jnp.float32)
  return x.nbytes / _best_seconds(jax.jit(jnp.sum), x, repeats=repeats) / 1e9


def measure(dtypes=("float32", "bfloat16"), repeats: int = 10) -> dict:
  """This machine's peaks (by dtype, GFLOP/s) and bandwidth (GB/s), with the load average."""
  peaks = {dtype: round(measure_matmul_peak(dtype, repeats=repeats), 2) for dtype in dtypes}
  return {"matmul_peak_gflops": peaks,
          "bandwidth_gbs": round(measure_bandwidth(repeats=repeats), 2),
          "platform": jax.devices()[0].platform,
          "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


if __name__ == "__main__":
  from benchmarks.common import emit_json_line
  emit_json_line({"benchmark": "roofline", **measure()})
