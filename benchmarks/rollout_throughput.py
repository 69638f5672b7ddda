"""Decode throughput of the rollout Engine against a generator without KV cache; one JSON line.

  python benchmarks/rollout_throughput.py [--model tiny|d128|small] [--slots 64] [--tokens 24]
                                          [--repeats 5] [--out PATH]

(d128: the tiny preset at d_model 128, d_ff 512.)

Both sides use the same model (random init, seed 0, max_seq_len = task.max_sequence_len), the
same S prompts (DigitReverseTask(0).problem(i), i < S), the same sampling (temperature 1) and the
same per-sample keys (`sample_key(0, i, 0)`, folded with the index of each token as the engine
does), and both draw exactly `--tokens` tokens per prompt with EOS ignored, so every one of the S
rows is busy for every step and both sides do the same number of useful tokens. Since the key
schedule is the same, both should draw the same tokens; the share that agree is reported as a
check (`tokens_match_fraction`; it can fall short of 1 only through float differences between the
cached and uncached attention).

Engine: the S prompts are prefilled and inserted into the S slots (not timed), then
ceil(tokens / steps_per_call) `generate` calls are timed; each returns its tokens on the host.
Reported for steps_per_call 1 and 4 (`engine_tokens_per_s`,
`engine_steps_per_call_4_tokens_per_s`), plus steps_per_call 1 with prefill and insert inside
the timed region (`engine_with_prefill_tokens_per_s`).

Naive: the S prompts right-padded into one [S, max prompt + tokens] buffer; each step runs a
jitted full forward of the whole buffer (no cache: every step recomputes every position), takes
the logits at each row's current position and samples one token into the buffer. One compile for
the whole run. Steps are dispatched back to back and the result is fetched once at the end, which
lets the host run ahead of the device: the most favourable setting for the naive side.

Every variant is compiled and run once before timing; then `--repeats` rounds run each variant
once, one after the other in the same process, and the median per variant is reported.

Against the roofline (`benchmarks/roofline.py`, measured in the same run): an engine decode step
(steps_per_call 1) as a fraction of max(FLOPs / matmul peak, bytes / bandwidth) of S tokens over
the whole static cache, and a naive step as a fraction of the compute bound of its full forward.
Beside it (`engine_step_limits`, unless --skip_limits), the engine step against this machine's
measured limits at its own shapes (`roofline.machine_limits`): every dot_general of the traced
decode step timed alone (`dots`), and the op floor (`op_floor`): an engine of the same model at
d_model 8, d_ff 8, head_dim 2 with one slot (`engine_floor`, timed in the same rounds as the
other variants), its time per op executed by its compiled step, times the ops of the real one.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from common import emit_json_line
from roofline import (
  Work,
  count_executed_ops,
  decode_step_work,
  dots_alone,
  forward_flops,
  fraction,
  machine_limits,
  measure,
  measure_per_op_s,
  op_floor,
  param_bytes,
  program_dots,
)

from jaxrl_async.model import apply, get_config, init_model, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import sample_key
from jaxrl_async.rollout.sampling import SamplingConfig, sample_token
from jaxrl_async.tasks.reverse import DigitReverseTask


def make_prompts(task: DigitReverseTask, n: int) -> list[np.ndarray]:
  return [np.asarray(task.problem(i).prompt_tokens, np.int32) for i in range(n)]


def make_keys(n: int) -> np.ndarray:
  return np.stack([sample_key(0, i, 0) for i in range(n)])  # uint32 [n, 2]


# ---- engine -------------------------------------------------------------------------------------
def engine_fill(engine: Engine, params, prompts, keys):
  """A decode state with prompt i prefilled into slot i."""
  state = engine.init_decode_state()
  for slot, prompt in enumerate(prompts):
    prefix = engine.prefill(params=params, padded_tokens=engine.pad_to_bucket(prompt),
                            true_length=len(prompt))
    state = engine.insert(prefix, state, slot, rng=keys[slot])
  return jax.block_until_ready(state)


def engine_run(engine: Engine, params, prompts, keys, tokens: int, *, time_prefill: bool = False):
  """(seconds, tokens [S, calls * steps_per_call]): timed generate calls (and fill if asked)."""
  calls = math.ceil(tokens / engine.steps_per_call)
  if time_prefill:
    start = time.perf_counter()
    state = engine_fill(engine, params, prompts, keys)
  else:
    state = engine_fill(engine, params, prompts, keys)
    start = time.perf_counter()
  out = []
  for _ in range(calls):
    state, result = engine.generate(params, state)  # device_get inside: blocks on the tokens
    out.append(result.tokens)
  elapsed = time.perf_counter() - start
  del state
  return elapsed, np.concatenate(out, axis=1)


# ---- naive (no KV cache) ----------------------------------------------------------------------
def make_naive_step(graphdef, sampling: SamplingConfig):

  @functools.partial(jax.jit, donate_argnums=(1,))
  def step(params, buffer, current, keys, t):
    """buffer [S, L]: right-padded sequences; current [S]: index of each row's last token."""
    logits, _ = apply(graphdef, params, buffer)  # full forward, positions 0..L-1, causal
    last = jnp.take_along_axis(logits, current[:, None, None], axis=1)[:, 0]  # [S, V]
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, t)
    drawn, log_probs = jax.vmap(functools.partial(sample_token, config=sampling))(last,
                                                                                  step_keys)
    buffer = buffer.at[jnp.arange(buffer.shape[0]), current + 1].set(drawn)
    return buffer, current + 1, drawn, log_probs

  return step


def naive_run(step, params, prompts, keys, tokens: int):
  """(seconds, tokens [S, tokens]); the host-to-device copy of the buffer is timed."""
  lengths = np.array([len(p) for p in prompts], np.int32)
  buffer = np.zeros((len(prompts), int(lengths.max()) + tokens), np.int32)
  for row, prompt in enumerate(prompts):
    buffer[row, :len(prompt)] = prompt
  keys = jnp.asarray(keys)
  start = time.perf_counter()
  buffer, current = jnp.asarray(buffer), jnp.asarray(lengths - 1)
  drawn = []
  for t in range(tokens):
    buffer, current, token, _ = step(params, buffer, current, keys, jnp.int32(t))
    drawn.append(token)
  drawn = np.asarray(jax.device_get(jnp.stack(drawn, axis=1)))
  elapsed = time.perf_counter() - start
  return elapsed, drawn


MODELS = {"tiny": ("tiny", {}), "small": ("small", {}),
          "d128": ("tiny", {"d_model": 128, "d_ff": 512})}
FLOOR_OVERRIDES = {"d_model": 8, "d_ff": 8, "head_dim": 2}  # the op floor's negligible widths


def executed_ops(engine: Engine, params) -> int:
  """Ops the compiled decode step (`Engine._generate`) executes (`count_executed_ops`)."""
  state = engine.init_decode_state()
  return sum(count_executed_ops(engine._generate.lower(params, state).compile().as_text())
             .values())


# ---- main -------------------------------------------------------------------------------------
def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="tiny", choices=sorted(MODELS))
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--tokens", type=int, default=24, help="tokens drawn per prompt")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--skip_steps_per_call_4", action="store_true")
  parser.add_argument("--skip_limits", action="store_true",
                      help="no dots-alone or op-floor limits beside the roofline")
  parser.add_argument("--out", default=None, help="also write the JSON line to this file")
  args = parser.parse_args()

  task = DigitReverseTask(0)
  if not 1 <= args.tokens <= task.max_response_len:
    raise ValueError(f"--tokens must be in [1, max_response_len={task.max_response_len}]")
  if args.slots < 1 or args.repeats < 1:
    raise ValueError("--slots and --repeats must be >= 1")
  load_start = os.getloadavg()
  machine = measure()
  preset, overrides = MODELS[args.model]
  config = get_config(preset, max_seq_len=task.max_sequence_len, **overrides)
  graphdef, params = split_model(init_model(config, seed=0))
  num_params = int(sum(np.size(x) for x in jax.tree.leaves(params)))
  sampling = SamplingConfig(temperature=1.0)
  prompts = make_prompts(task, args.slots)
  keys = make_keys(args.slots)

  engines = {1: Engine(graphdef, config, max_concurrent_decodes=args.slots,
                       max_prefill_length=task.max_sequence_len, sampling=sampling)}
  if not args.skip_steps_per_call_4:
    spc4 = Engine(graphdef, config, max_concurrent_decodes=args.slots,
                  max_prefill_length=task.max_sequence_len, sampling=sampling, steps_per_call=4)
    # Extra steps past `tokens` (when not a multiple of 4) must still fit in the cache.
    if max(map(len, prompts)) + math.ceil(args.tokens / 4) * 4 <= spc4.cache_length:
      engines[4] = spc4
  naive_step = make_naive_step(graphdef, sampling)
  if not args.skip_limits:
    floor_config = get_config(preset, max_seq_len=task.max_sequence_len,
                              **{**overrides, **FLOOR_OVERRIDES})
    floor_graphdef, floor_params = split_model(init_model(floor_config, seed=0))
    floor_engine = Engine(floor_graphdef, floor_config, max_concurrent_decodes=1,
                          max_prefill_length=task.max_sequence_len, sampling=sampling)

  variants = {f"engine_spc{spc}": functools.partial(engine_run, engine, params, prompts, keys,
                                                    args.tokens)
              for spc, engine in engines.items()}
  variants["engine_with_prefill"] = functools.partial(engine_run, engines[1], params, prompts,
                                                      keys, args.tokens, time_prefill=True)
  variants["naive"] = functools.partial(naive_run, naive_step, params, prompts, keys, args.tokens)
  if not args.skip_limits:
    variants["engine_floor"] = functools.partial(engine_run, floor_engine, floor_params,
                                                 prompts[:1], keys[:1], args.tokens)

  drawn = {name: fn()[1] for name, fn in variants.items()}  # warm-up: compiles every shape
  times = {name: [] for name in variants}
  for _ in range(args.repeats):
    for name, fn in variants.items():
      times[name].append(fn()[0])
  generated = {name: drawn[name].size for name in variants}  # tokens drawn per run
  rate = {name: generated[name] / statistics.median(times[name]) for name in variants}
  match = float(np.mean(drawn["engine_spc1"][:, :args.tokens] == drawn["naive"]))
  naive_len = int(max(map(len, prompts)) + args.tokens)

  record = {
      "benchmark": "rollout_throughput",
      "model": args.model,
      "slots": args.slots,
      "tokens_per_prompt": args.tokens,
      "stop_at_eos": False,
      "engine_tokens_per_s": round(rate["engine_spc1"], 1),
      "naive_tokens_per_s": round(rate["naive"], 1),
      "speedup": round(rate["engine_spc1"] / rate["naive"], 2),
  }
  if "engine_spc4" in rate:
    record["engine_steps_per_call_4_tokens_per_s"] = round(rate["engine_spc4"], 1)
    record["speedup_steps_per_call_4"] = round(rate["engine_spc4"] / rate["naive"], 2)
  record.update({
      "engine_with_prefill_tokens_per_s": round(rate["engine_with_prefill"], 1),
      "engine_ms_per_step": round(1e3 * statistics.median(times["engine_spc1"])
                                  / (generated["engine_spc1"] / args.slots), 3),
      "naive_ms_per_step": round(1e3 * statistics.median(times["naive"]) / args.tokens, 3),
      "tokens_match_fraction": round(match, 4),
      "machine": machine,
      "engine_step_roofline": fraction(
          decode_step_work(config, args.slots, engines[1].cache_length),
          statistics.median(times["engine_spc1"]) / (generated["engine_spc1"] / args.slots),
          machine["matmul_peak_gflops"], machine["bandwidth_gbs"]),
      "naive_step_roofline": fraction(
          Work(forward_flops(config, args.slots * naive_len, naive_len), param_bytes(config),
               config.dtype),
          statistics.median(times["naive"]) / args.tokens,
          machine["matmul_peak_gflops"], machine["bandwidth_gbs"]),
      "repeats": args.repeats,
  })
  if not args.skip_limits:
    step_s = statistics.median(times["engine_spc1"]) / (generated["engine_spc1"] / args.slots)
    dots = dots_alone(program_dots(jax.make_jaxpr(engines[1]._generate_impl)(
        params, engines[1].init_decode_state()).jaxpr))
    floor = op_floor(executed_ops(engines[1], params),
                     statistics.median(times["engine_floor"]) / generated["engine_floor"],
                     executed_ops(floor_engine, floor_params), measure_per_op_s())
    record["engine_step_limits"] = {
        **machine_limits(record["engine_step_roofline"]["bound_s"], step_s,
                         dots["dots_alone_s"], floor["op_floor_s"]),
        "dots": dots, "op_floor": floor}
  record.update({
      "params": num_params,
      "max_seq_len": config.max_seq_len,
      "naive_buffer_len": naive_len,
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "device": str(jax.devices()[0].device_kind),
      "loadavg_1m_start": round(load_start[0], 2),
      "loadavg_1m_end": round(os.getloadavg()[0], 2),
      "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  })
  emit_json_line(record, args.out)


if __name__ == "__main__":
  main()
