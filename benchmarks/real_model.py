"""One RL step of a Qwen2.5-0.5B-shaped model (random weights) on this machine: decode and learner
throughput, and memory.

The step: 8 prompts x 4 samples, each sample exactly `--response_len` tokens (no end token), drawn
by the Engine (KV cache, continuous batching, `--decode_steps` tokens per call) at temperature 1;
then one learner update (GRPO advantages from random rewards, decoupled PPO loss, AdamW) on the
packed batch. Both are compiled before they are timed. Memory: XLA's own account of each compiled
program (arguments, outputs, temporaries), for the update with and without gradient
checkpointing (only the chosen one runs), and the process's peak resident memory.

    python benchmarks/real_model.py                      # 0.5B shapes, bfloat16, remat on
    python benchmarks/real_model.py --skip_decode --no_remat   # the full update only, no remat
    python benchmarks/real_model.py --logit_chunk_size 0   # full [R, T, V] logits (about 30 GB)
    python benchmarks/real_model.py --model tiny --prompt_len 8 --response_len 8   # smoke test

The learner computes logprobs and entropy from the final hidden states in chunks of
`--logit_chunk_size` positions (`LearnerConfig.logit_chunk_size`), so the [32, 191, 151,936]
float32 logits (3.7 GB, several live at once: about 30 GB with `--logit_chunk_size 0`) never
exist. The update is still skipped (and says so) when XLA's account of it exceeds the memory
available; `--learner_prompts N` then trains the first N prompts' groups only.

Against the roofline (`benchmarks/roofline.py`): the same run measures this machine's matmul
peak (float32 and bfloat16) and memory bandwidth, and reports prefill (one prompt, median), a
decode step (median `generate` call / steps per call) and the update each as a fraction of the
bound their shapes imply (`roofline.fraction`: max(FLOPs / peak, bytes / bandwidth) over the
measured time).

Prints one JSON line (with the machine's load average: timings on a shared machine vary).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

from benchmarks import roofline
from benchmarks.common import emit_json_line
from jaxrl_async import compilation_cache, sharding
from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import pack
from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import ContinuousBatcher
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.run import build as build_lib
from jaxrl_async.tasks.base import Problem


def _memory(compiled) -> dict[str, float]:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return {}
  return {f"{name}_mb": round(getattr(analysis, f"{name}_size_in_bytes") / 2**20, 1)
          for name in ("argument", "output", "temp", "generated_code")}


def _available_mb() -> float:
  """MemAvailable of /proc/meminfo (inf where there is none)."""
  try:
    with open("/proc/meminfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return float("inf")


def _requests(args, vocab_size: int, group_offset: int = 0):
  rng = np.random.default_rng(args.seed)
  requests = []
  for p in range(args.prompts):
    problem = Problem(prompt_id=p, prompt_tokens=rng.integers(0, vocab_size, args.prompt_len))
    requests += build_lib.make_group_requests(problem, group_offset + p, args.samples,
                                               args.seed)
  return requests


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="qwen2.5-0.5b", help="a model preset")
  parser.add_argument("--prompts", type=int, default=8)
  parser.add_argument("--samples", type=int, default=4, help="samples per prompt (group size)")
  parser.add_argument("--prompt_len", type=int, default=64)
  parser.add_argument("--response_len", type=int, default=128)
  parser.add_argument("--decode_steps", type=int, default=8, help="tokens per engine call")
  parser.add_argument("--dtype", default="bfloat16", help="activation dtype")
  parser.add_argument("--param_dtype", default="bfloat16")
  parser.add_argument("--no_remat", action="store_true", help="run without remat")
  parser.add_argument("--learner_prompts", type=int, default=None,
                      help="train on the first N prompts' groups only (default: all); XLA's "
                           "memory account is still reported for the batch trained")
  parser.add_argument("--skip_decode", action="store_true",
                      help="no decode: the learner trains on random responses of the same shape")
  parser.add_argument("--logit_chunk_size", type=int,
                      default=step_lib.LearnerConfig.logit_chunk_size,
                      help="positions per chunk of the learner's logprobs/entropy (0: full logits)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--memory_margin_mb", type=float, default=3072,
                      help="skip the update when XLA's account of it exceeds the machine's "
                           "available memory less this margin (never push a shared machine "
                           "into the OOM killer)")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  compilation_cache.enable()
  load = os.getloadavg()
  machine = roofline.measure()
  print(f"machine: {json.dumps(machine)}", file=sys.stderr)
  seq_len = args.prompt_len + args.response_len
  config = get_config(args.model, max_seq_len=seq_len, dtype=args.dtype,
                      param_dtype=args.param_dtype, remat=not args.no_remat)
  began = time.perf_counter()
  model = init_model(config, seed=args.seed)
  graphdef, params = split_model(model)
  logical_axes = param_logical_axes(model)
  del model
  init_s = time.perf_counter() - began

  # ---- decode --------------------------------------------------------------------------------
  slots = args.prompts * args.samples
  if args.skip_decode:
    samples, decode = _random_responses(args, config.vocab_size), None
  else:
    samples, decode = _decode(args, config, graphdef, params, slots, machine)
  print(f"decode: {json.dumps(decode)}", file=sys.stderr)

  # ---- one learner update ----------------------------------------------------------------------
  return _learn(args, config, params, logical_axes, samples, decode, init_s, load, machine)


def _random_responses(args, vocab_size: int):
  rng = np.random.default_rng(args.seed + 1)
  samples = []
  for request in _requests(args, vocab_size):
    sample = request.sample
    sample.response_tokens = rng.integers(0, vocab_size, args.response_len).astype(np.int32)
    sample.behaviour_logprobs = np.full(args.response_len, -np.log(vocab_size), np.float32)
    sample.token_versions = np.zeros(args.response_len, np.int32)
    samples.append(sample)
  return samples


class _TimedGenerate:
  """The engine, with the wall time of each `generate` call (tokens on the host) recorded."""

  def __init__(self, engine: Engine):
    self._engine = engine
    self.seconds: list[float] = []

  def __getattr__(self, name):
    return getattr(self._engine, name)

  def generate(self, params, decode_state):
    began = time.perf_counter()
    out = self._engine.generate(params, decode_state)
    self.seconds.append(time.perf_counter() - began)
    return out


def _fraction(work, seconds, machine):
  return roofline.fraction(work, seconds, machine["matmul_peak_gflops"], machine["bandwidth_gbs"])


def _decode(args, config, graphdef, params, slots, machine):
  engine = Engine(graphdef, config, max_concurrent_decodes=slots,
                  max_prefill_length=args.prompt_len, sampling=SamplingConfig(temperature=1.0),
                  cache_length=config.max_seq_len, steps_per_call=args.decode_steps)
  began = time.perf_counter()
  warm = ContinuousBatcher(engine, eos_id=-1, max_response_len=args.decode_steps)
  warm.set_params(params, 0)
  warm.run_to_completion(_requests(args, config.vocab_size, group_offset=1000))
  decode_compile_s = time.perf_counter() - began
  timed = _TimedGenerate(engine)
  batcher = ContinuousBatcher(timed, eos_id=-1, max_response_len=args.response_len)
  batcher.set_params(params, 0)
  requests = _requests(args, config.vocab_size)
  began = time.perf_counter()
  samples = batcher.run_to_completion(requests)
  decode_s = time.perf_counter() - began
  decode_tokens = sum(len(s.response_tokens) for s in samples)
  assert decode_tokens == slots * args.response_len, decode_tokens
  step_s = statistics.median(timed.seconds) / args.decode_steps
  prefill_s = []
  for request in requests[::args.samples]:  # one prefill per prompt, as the batcher does
    tokens = engine.pad_to_bucket(np.asarray(request.sample.prompt_tokens, np.int32))
    began = time.perf_counter()
    jax.block_until_ready(engine.prefill(params=params, padded_tokens=tokens,
                                         true_length=len(request.sample.prompt_tokens)))
    prefill_s.append(time.perf_counter() - began)
  bucket = len(engine.pad_to_bucket(np.zeros(args.prompt_len, np.int32)))
  return samples, {"tokens": decode_tokens, "seconds": round(decode_s, 2),
                   "tokens_per_s": round(decode_tokens / decode_s, 2),
                   "compile_and_warmup_s": round(decode_compile_s, 1),
                   "step_s": round(step_s, 4),
                   "step_roofline": _fraction(
                       roofline.decode_step_work(config, slots, engine.cache_length), step_s,
                       machine),
                   "prefill_s": round(statistics.median(prefill_s), 4),
                   "prefill_roofline": _fraction(roofline.prefill_work(config, bucket),
                                                 statistics.median(prefill_s), machine)}


def _update_fraction(config, batch, update_s, args, machine):
  if not np.isfinite(update_s):
    return None
  rows, row_length = batch.tokens.shape
  work = roofline.update_work(config, rows, row_length,
                              head_recompute=args.logit_chunk_size > 0)
  account = _fraction(work, update_s, machine)
  model_flops = roofline.model_flops_per_update(config, rows, row_length)
  account["model_flops_fraction_of_peak"] = round(
      model_flops / update_s / 1e9 / machine["matmul_peak_gflops"][config.dtype], 4)
  return account


def _learn(args, config, params, logical_axes, samples, decode, init_s, load, machine):
  rng = np.random.default_rng(args.seed)
  groups = {}
  for sample in samples:
    sample.reward = float(rng.integers(0, 2))
    groups.setdefault(sample.group_id, []).append(sample)
  groups = [sorted(g, key=lambda s: s.meta["index_in_group"]) for _, g in sorted(groups.items())]
  groups = groups[:args.learner_prompts or len(groups)]
  learner_config = step_lib.LearnerConfig(logit_chunk_size=args.logit_chunk_size)
  mesh = sharding.make_mesh(sharding.MeshShape(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  state = step_lib.init_train_state(params, learner_config.optimizer(), mesh, logical_axes)
  del params
  batch = step_lib.shard_batch(pack(groups, config.max_seq_len, num_groups=len(groups), row_multiple=1),
                               mesh)
  learner_tokens = int(np.asarray(batch.segment_ids > 0).sum())
  update_args = (state, batch, None, np.float32(0), np.float32(0))
  memory = {}
  for remat in (True, False):  # XLA's account of both; only the chosen one runs
    variant = dataclasses.replace(config, remat=remat)
    variant_graphdef, _ = split_model(jax.eval_shape(lambda c=variant: init_model(c)))
    fn = step_lib.make_update_fn(variant_graphdef, learner_config, args.samples,
                                 step_lib.state_shardings(state))
    began = time.perf_counter()
    compiled = fn.lower(*update_args).compile()
    memory["update_remat" if remat else "update_no_remat"] = {
        **_memory(compiled), "compile_s": round(time.perf_counter() - began, 1)}
    if remat == config.remat:
      chosen = compiled
  chosen_memory = memory["update_remat" if config.remat else "update_no_remat"]
  needed_mb = sum(chosen_memory.get(f"{k}_mb", 0.0) for k in ("temp", "output"))
  available_mb = _available_mb()
  update_s = float("nan")
  if needed_mb <= available_mb - args.memory_margin_mb:
    began = time.perf_counter()
    state, metrics = chosen(*update_args)
    jax.block_until_ready((state, metrics))
    update_s = time.perf_counter() - began
    assert np.isfinite(float(metrics["loss"]))
  else:
    print(f"skipping the update: it needs {needed_mb:.0f} MB beyond its arguments, "
          f"{available_mb:.0f} MB are available", file=sys.stderr)

  record = {
      "benchmark": "real_model", "model": args.model, "num_params": config.num_params(),
      "dtype": config.dtype, "param_dtype": config.param_dtype, "remat": config.remat,
      "prompts": args.prompts, "samples_per_prompt": args.samples,
      "prompt_len": args.prompt_len, "response_len": args.response_len,
      "decode_steps_per_call": args.decode_steps, "devices": str(jax.devices()[0].platform),
      "init_s": round(init_s, 2),
      "decode": decode,
      "learner": {"logit_chunk_size": args.logit_chunk_size, "groups": len(groups), "tokens": learner_tokens, "rows": int(batch.tokens.shape[0]),
                  "seconds": round(update_s, 2), "ran": bool(np.isfinite(update_s)),
                  "tokens_per_s": round(learner_tokens / update_s, 2),
                  "roofline": _update_fraction(config, batch, update_s, args, machine)},
      "machine": machine,
      "memory": {**memory,
                 "params_mb": round(sum(x.nbytes for x in jax.tree.leaves(state.params))
                                    / 2**20, 1),
                 "opt_state_mb": round(sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
                                       / 2**20, 1),
                 "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                      1)},
      "load_average_1_5_15": [round(x, 2) for x in load],
      "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
  }
  emit_json_line(record, args.out)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
