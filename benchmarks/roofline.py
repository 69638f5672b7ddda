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

import collections
import dataclasses
import math
import os
import re
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



# ---- the machine's limits at a program's own shapes -------------------------------------------
# The bound above prices every FLOP at the peak of a 2048-square matmul. A small program's
# matmuls cannot reach it, and XLA:CPU pays a cost per executed op however small. Two measured
# limits say how far: each dot_general of the program timed alone at its own shapes
# (`dots_alone`), and the same program compiled where FLOPs and bytes vanish (an op floor,
# timed by the benchmark that builds the phase).
@dataclasses.dataclass(frozen=True)
class Dot:
  """One dot_general as a program runs it: operand shapes, dimension numbers, dtypes."""

  lhs: tuple[int, ...]
  rhs: tuple[int, ...]
  dimension_numbers: tuple  # ((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))
  lhs_dtype: str
  rhs_dtype: str
  out_dtype: str

  @property
  def flops(self) -> int:
    """2 x lhs elements x rhs elements neither contracted nor batched."""
    (_, rhs_contract), (_, rhs_batch) = self.dimension_numbers
    free = math.prod(n for i, n in enumerate(self.rhs) if i not in (*rhs_contract, *rhs_batch))
    return 2 * math.prod(self.lhs) * free


def _sub_jaxprs(params):
  for param in params.values():
    for sub in param if isinstance(param, (tuple, list)) else (param,):
      if isinstance(sub, jax.extend.core.ClosedJaxpr):
        yield sub.jaxpr
      elif isinstance(sub, jax.extend.core.Jaxpr):
        yield sub


def program_dots(jaxpr, times: int = 1) -> collections.Counter:
  """{Dot: how many times the program runs it} over a traced jaxpr and its sub-jaxprs. A scan's
  body counts `length` times; any other sub-jaxpr (pjit, custom_vjp, remat, a cond's branches, a
  while's body) once each, so a while loop counts one trip and a cond every branch."""
  counts = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      lhs, rhs = (v.aval for v in eqn.invars[:2])
      out = eqn.params.get("preferred_element_type") or eqn.outvars[0].aval.dtype
      (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
      numbers = ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))
      counts[Dot(tuple(lhs.shape), tuple(rhs.shape), numbers, str(lhs.dtype), str(rhs.dtype),
                 str(jnp.dtype(out)))] += times
    inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
    for sub in _sub_jaxprs(eqn.params):
      counts.update(program_dots(sub, inner))
  return counts


def _dot_chain(dot: Dot, copies: int):
  """A jitted program running `dot` on `copies` distinct left operands one after the other (an
  optimization barrier orders each after the last), and its arguments."""
  lhs = [jnp.full(dot.lhs, 1.0 + i, dot.lhs_dtype) for i in range(copies)]
  rhs, out_dtype = jnp.ones(dot.rhs, dot.rhs_dtype), jnp.dtype(dot.out_dtype)

  def chain(lhs, rhs):
    outs = []
    for x in lhs:
      if outs:
        x, _ = jax.lax.optimization_barrier((x, outs[-1]))
      outs.append(jax.lax.dot_general(x, rhs, dot.dimension_numbers,
                                      preferred_element_type=out_dtype))
    return outs

  return jax.jit(chain), lhs, rhs


def time_dot(dot: Dot, repeats: int = 20, copies: int = 8) -> dict:
  """A dot's time alone, in microseconds, two ways, each the best of `repeats`:
  `in_program_us`, what one more copy of it adds to a program that runs `copies` of them back
  to back ((t(copies) - t(1)) / (copies - 1): no call, as inside the phase's program), and
  `alone_us`, a jitted program of the one dot called from Python, beside `call_us`, a trivial
  program called on the same operands."""
  times = {}
  for n in (copies, 1):
    fn, lhs, rhs = _dot_chain(dot, n)
    times[n] = _best_seconds(fn, lhs, rhs, repeats=repeats)
  trivial = jax.jit(lambda x, y: x[0].reshape(-1)[:1] + y.reshape(-1)[:1].astype(x[0].dtype))
  return {"in_program_us": round(1e6 * (times[copies] - times[1]) / (copies - 1), 2),
          "alone_us": round(1e6 * times[1], 2),
          "call_us": round(1e6 * _best_seconds(trivial, lhs, rhs, repeats=repeats), 2)}


def dots_alone(counts: collections.Counter, repeats: int = 20) -> dict:
  """The program's dots (`program_dots`) each timed alone (`time_dot`), summed over their counts
  by `summarize_dots`."""
  return summarize_dots([
      {"lhs": list(dot.lhs), "rhs": list(dot.rhs), "dtype": dot.lhs_dtype, "count": count,
       "mflop": round(dot.flops / 1e6, 4), **time_dot(dot, repeats)}
      for dot, count in sorted(counts.items(), key=lambda item: -item[0].flops * item[1])])


def summarize_dots(rows: list[dict]) -> dict:
  """Sums over `dots_alone`'s rows of count x a dot's time: `dots_in_program_s` with
  in_program_us, `dots_alone_called_s` with alone_us - call_us (its own call, less the cost of
  a call), and `dots_alone_s`, the limit, with the smaller of the two (each is the dot at its
  own shapes; the faster way is what this machine can do). Negative times (noise on a dot
  cheaper than the noise) count as zero."""
  def total(key):
    return sum(r["count"] * max(key(r), 0.0) for r in rows) / 1e6

  called = {id(r): r["alone_us"] - r["call_us"] for r in rows}
  seconds = total(lambda r: min(r["in_program_us"], called[id(r)]))
  gflop = sum(r["count"] * r["mflop"] for r in rows) / 1e3
  return {"dots_alone_s": round(seconds, 6),
          "dots_in_program_s": round(total(lambda r: r["in_program_us"]), 6),
          "dots_alone_called_s": round(total(lambda r: called[id(r)]), 6),
          "dots": sum(r["count"] for r in rows), "distinct_dots": len(rows),
          "dots_gflop": round(gflop, 4),
          "dots_alone_gflops": round(gflop / seconds, 2) if seconds > 0 else None,
          "per_dot": rows}


# Instructions of an optimized HLO computation that the runtime does not execute as work.
_FREE_OPS = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "bitcast"})


def count_executed_ops(hlo_text: str) -> collections.Counter:
  """{opcode: count} of the ops an optimized HLO module executes: its entry computation and the
  bodies and conditions of its while loops, each as many times as the loop's known trip count
  (once where XLA knows none), leaving out parameters, constants, tuples and bitcasts; a fusion
  counts once however many ops it holds."""
  computations, current, entry = {}, None, None
  for line in hlo_text.splitlines():
    header = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif line.strip() == "}":
      current = None
    elif current is not None and "=" in line:
      computations[current].append(line)
  counts = collections.Counter()

  def visit(name, times):
    for line in computations.get(name, ()):
      rhs = line.split("=", 1)[1]
      opcode = re.search(r"\s([a-z][\w\-]*)\(", " " + rhs)
      if opcode is None or opcode.group(1) in _FREE_OPS:
        continue
      counts[opcode.group(1)] += times
      if opcode.group(1) == "while":
        trips = re.search(r'known_trip_count":\{"n":"(\d+)"', rhs)
        trips = int(trips.group(1)) if trips else 1
        for attribute, extra in (("condition", 1), ("body", 0)):
          called = re.search(attribute + r"=%?([\w.\-]+)", rhs)
          if called:
            visit(called.group(1), times * (trips + extra))

  visit(entry, 1)
  return counts


def measure_per_op_s(steps: int = 128, repeats: int = 200) -> float:
  """Seconds XLA:CPU takes per executed op where the op does next to nothing: a program of
  `steps` dependent steps on 64 floats, each a max and a multiply-add (which XLA cannot fuse
  into one), against the same program of one step, over the difference of their executed ops
  (`count_executed_ops`); each program the best of `repeats` calls."""
  def program(n):
    def chain(x):
      for _ in range(n):
        x = x * 0.5 + jnp.max(x) * 1e-3
      return x

    fn, x = jax.jit(chain), jnp.ones((64,), jnp.float32)
    ops = sum(count_executed_ops(fn.lower(x).compile().as_text()).values())
    return _best_seconds(fn, x, repeats=repeats), ops

  (short_s, short_ops), (long_s, long_ops) = program(1), program(1 + steps)
  return max(long_s - short_s, 0.0) / (long_ops - short_ops)


def op_floor(ops: int, floor_s: float, floor_ops: int, per_op_s: float) -> dict:
  """The runtime's floor for a phase whose compiled program executes `ops` ops
  (`count_executed_ops`): the same phase at negligible sizes (`floor_ops` ops in `floor_s`,
  called the same way, so with the same cost of a call), plus `per_op_s` (`measure_per_op_s`)
  for each op the real program executes beyond the floor program's (XLA compiles tiny shapes
  into fewer ops)."""
  return {"ops": ops, "floor_program_s": round(floor_s, 6), "floor_program_ops": floor_ops,
          "per_op_us": round(1e6 * per_op_s, 3),
          "op_floor_s": round(floor_s + max(ops - floor_ops, 0) * per_op_s, 6)}


def machine_limits(bound_s: float, measured_s: float, dots_alone_s: float,
                   op_floor_s: float) -> dict:
  """The phase against the measured limits of this machine at its own shapes.

  `machine_limit_s` = max(bound, dots alone, op floor): each is a time the phase cannot beat
  here (its FLOPs and bytes at the peaks; its matmuls at the speed they reach alone; its op
  count at the runtime's cost per op), so their max is too. `dots_and_floor_s` = dots alone +
  op floor: an estimate of what the program could take if nothing but its dots and the cost of
  running its ops remained; not a bound (the dots' own cost per op is in both terms).
  """
  limit = max(bound_s, dots_alone_s, op_floor_s)
  both = dots_alone_s + op_floor_s
  return {"dots_alone_s": round(dots_alone_s, 6), "op_floor_s": round(op_floor_s, 6),
          "machine_limit_s": round(limit, 6),
          "fraction_of_dots_alone": round(dots_alone_s / measured_s, 4),
          "fraction_of_op_floor": round(op_floor_s / measured_s, 4),
          "fraction_of_machine_limit": round(limit / measured_s, 4),
          "dots_and_floor_s": round(both, 6),
          "fraction_of_dots_and_floor": round(both / measured_s, 4)}


if __name__ == "__main__":
  from benchmarks.common import emit_json_line
  emit_json_line({"benchmark": "roofline", **measure()})
