"""The learner update on real rollouts: packed rows against one row per sample, side by side.

Generates batches with the default run's base policy and engine (64 samples: 8 GRPO groups of 8,
the long-tailed digit-reverse task), then times `build_lib.learner_update` (layout, transfer,
jitted update, metrics) on the same batches with `pack_sequences` on and off, after every shape
has compiled. Prints one JSON line: ms per update, tokens per batch (real and as laid out).

Against the roofline (`benchmarks/roofline.py`, measured in the same run): the jitted update
alone (`step.make_update_fn`, no host work) on 128 sequences of 16 tokens (8-token prompts, 16
GRPO groups of 8, random tokens and rewards), for the default tiny model and for a 2-layer
d_model-128 model (d_ff 512), as a fraction of max(FLOPs / matmul peak, bytes / bandwidth).
Beside it (`limits`, unless --skip_limits), the update against this machine's measured limits at
its own shapes (`roofline.machine_limits`): every dot_general of its traced program timed alone
(`dots`), and the op floor (`op_floor`): the same update at d_model 8, d_ff 8 on one group of
rows, its time per executed op of its compiled program, times the ops the real one executes.

    python benchmarks/learner_step.py [--batches 30] [--repeats 5] [--out FILE]
    python benchmarks/learner_step.py --roofline_only     # the roofline part alone, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np

import gin
from benchmarks import roofline
from benchmarks.common import emit_json_line
from jaxrl_async import compilation_cache, sharding
from jaxrl_async.config import RunConfig
from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import collate
from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
from jaxrl_async.run import build as build_lib
from jaxrl_async.tasks.base import Problem
from launch.train import DEFAULT_GIN, load_config

# The small shapes of the roofline: (name, model overrides of the tiny preset).
ROOFLINE_MODELS = (("tiny", {}), ("d128", {"d_model": 128, "d_ff": 512}))
ROOFLINE_GROUPS, ROOFLINE_GROUP_SIZE = 16, 8  # 128 sequences
ROOFLINE_PROMPT_LEN, ROOFLINE_RESPONSE_LEN = 8, 8  # 16 tokens each


# The op floor's shapes: the tiny preset's layers at negligible width, one group of rows.
FLOOR_OVERRIDES, FLOOR_GROUPS = {"d_model": 8, "d_ff": 8}, 1


def _random_groups(vocab_size: int, seed: int = 0, num_groups: int = ROOFLINE_GROUPS):
  rng = np.random.default_rng(seed)
  groups = []
  for g in range(num_groups):
    problem = Problem(prompt_id=g,
                      prompt_tokens=rng.integers(0, vocab_size, ROOFLINE_PROMPT_LEN))
    group = []
    for request in build_lib.make_group_requests(problem, g, ROOFLINE_GROUP_SIZE, seed):
      sample = request.sample
      sample.response_tokens = rng.integers(0, vocab_size, ROOFLINE_RESPONSE_LEN).astype(np.int32)
      sample.behaviour_logprobs = np.full(ROOFLINE_RESPONSE_LEN, -np.log(vocab_size), np.float32)
      sample.token_versions = np.zeros(ROOFLINE_RESPONSE_LEN, np.int32)
      sample.reward = float(rng.integers(0, 2))
      group.append(sample)
    groups.append(group)
  return groups


def _build_update(config, learner_config, num_groups: int):
  """(jitted update, its state, a batch of `num_groups` random groups) for a model config."""
  seq_len = ROOFLINE_PROMPT_LEN + ROOFLINE_RESPONSE_LEN
  model = init_model(config)
  graphdef, params = split_model(model)
  mesh = sharding.make_mesh(sharding.MeshShape(data=1, fsdp=1, tensor=1), jax.devices()[:1])
  state = step_lib.init_train_state(params, learner_config.optimizer(), mesh,
                                    param_logical_axes(model))
  batch = step_lib.shard_batch(
      collate(_random_groups(config.vocab_size, num_groups=num_groups), seq_len), mesh)
  update = step_lib.make_update_fn(graphdef, learner_config, ROOFLINE_GROUP_SIZE,
                                   step_lib.state_shardings(state))
  return update, state, batch


def _time_updates(update, state, batch, repeats: int):
  """(seconds of `repeats` updates after two warm-up calls, the compiled program's text)."""
  hlo = update.lower(state, batch, None, np.float32(0), np.float32(0)).compile().as_text()
  seconds = []
  for i in range(repeats + 2):  # two warm-up calls: compile, then first run
    began = time.perf_counter()
    state, metrics = update(state, batch, None, np.float32(0), np.float32(0))
    jax.block_until_ready((state, metrics))
    if i >= 2:
      seconds.append(time.perf_counter() - began)
  return seconds, hlo


def update_op_floor(repeats: int, learner_config) -> tuple[float, int]:
  """(median seconds, executed ops) of the update at the floor's negligible shapes."""
  config = get_config("tiny", max_seq_len=ROOFLINE_PROMPT_LEN + ROOFLINE_RESPONSE_LEN,
                      **FLOOR_OVERRIDES)
  seconds, hlo = _time_updates(*_build_update(config, learner_config, FLOOR_GROUPS), repeats)
  return float(np.median(seconds)), sum(roofline.count_executed_ops(hlo).values())


def roofline_updates(machine: dict, repeats: int = 20, models=ROOFLINE_MODELS,
                     limits: bool = True) -> dict:
  """{name: roofline.fraction of the jitted update (median of `repeats`)} at the small shapes;
  with `limits`, beside it the update against this machine's limits at its own shapes
  (`roofline.machine_limits`: its dots timed alone, and the op floor of its program)."""
  out = {}
  seq_len = ROOFLINE_PROMPT_LEN + ROOFLINE_RESPONSE_LEN
  learner_config = step_lib.LearnerConfig()
  if limits:
    floor_s, floor_ops = update_op_floor(repeats, learner_config)
    per_op_s = roofline.measure_per_op_s()
  for name, overrides in models:
    config = get_config("tiny", max_seq_len=seq_len, **overrides)
    update, state, batch = _build_update(config, learner_config, ROOFLINE_GROUPS)
    if limits:  # traced before the timed calls donate the state
      counts = roofline.program_dots(
          jax.make_jaxpr(update)(state, batch, None, np.float32(0), np.float32(0)).jaxpr)
    seconds, hlo = _time_updates(update, state, batch, repeats)
    rows, row_length = batch.tokens.shape
    update_s = float(np.median(seconds))
    account = roofline.fraction(
        roofline.update_work(config, rows, row_length,
                             head_recompute=learner_config.logit_chunk_size > 0),
        update_s, machine["matmul_peak_gflops"], machine["bandwidth_gbs"])
    model_flops = roofline.model_flops_per_update(config, rows, row_length)
    account.update({
        "rows": int(rows), "row_length": int(row_length), "num_params": config.num_params(),
        "min_s": round(min(seconds), 6),
        "model_flops_fraction_of_peak": round(
            model_flops / update_s / 1e9 / machine["matmul_peak_gflops"][config.dtype], 4)})
    if limits:
      dots = roofline.dots_alone(counts)
      floor = roofline.op_floor(sum(roofline.count_executed_ops(hlo).values()), floor_s,
                                floor_ops, per_op_s)
      account["limits"] = {**roofline.machine_limits(account["bound_s"], update_s,
                                                     dots["dots_alone_s"], floor["op_floor_s"]),
                           "dots": dots, "op_floor": floor}
    out[name] = account
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=30)
  parser.add_argument("--repeats", type=int, default=5, help="passes over the batches")
  parser.add_argument("--out", default=None)
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="bindings on top of the default run's gin file")
  parser.add_argument("--roofline_only", action="store_true",
                      help="only the update at the small shapes against the roofline")
  parser.add_argument("--roofline_repeats", type=int, default=20)
  parser.add_argument("--roofline_models", default=",".join(name for name, _ in ROOFLINE_MODELS),
                      help="comma-separated models of the roofline part "
                           f"({', '.join(name for name, _ in ROOFLINE_MODELS)})")
  parser.add_argument("--skip_limits", action="store_true",
                      help="no dots-alone or op-floor limits beside the roofline")
  parser.add_argument("--machine_repeats", type=int, default=10,
                      help="timed runs of the machine's matmul peak and bandwidth (best kept)")
  args = parser.parse_args(argv)
  models = [(name, overrides) for name, overrides in ROOFLINE_MODELS
            if name in args.roofline_models.split(",")]
  if not models or args.machine_repeats < 1:
    parser.error(f"want --roofline_models among {[name for name, _ in ROOFLINE_MODELS]} and "
                 f"--machine_repeats >= 1, got {args.roofline_models!r} and "
                 f"{args.machine_repeats}")
  compilation_cache.enable()
  machine = roofline.measure(repeats=args.machine_repeats)
  roofline_record = {"machine": machine,
                     "updates": roofline_updates(machine, args.roofline_repeats, models,
                                                 limits=not args.skip_limits)}
  if args.roofline_only:
    emit_json_line({"benchmark": "learner_step", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
                    "roofline": roofline_record,
                    "load_average_at_end": [round(x, 2) for x in os.getloadavg()]}, args.out)
    return 0
  load_config([DEFAULT_GIN], args.gin_bindings)
  parts = build_lib.build(gin.get_configurable(RunConfig)(), log=lambda *a: None)
  cfg = parts.config
  batcher = parts.rollout.new_batcher()
  batcher.set_params(build_lib.copy_params(parts.learner.initial_state.params), 0)
  data = []
  for b in range(args.batches):
    requests = []
    for g in range(cfg.groups_per_update):
      group_id = b * cfg.groups_per_update + g
      requests += build_lib.make_group_requests(next(parts.rollout.prompts), group_id,
                                                 cfg.group_size, cfg.seed)
    samples = parts.rollout.rewards.score_all(batcher.run_to_completion(requests))
    data.append(build_lib.assemble_groups(parts.config, samples))
  parts.rollout.rewards.close()
  real_tokens = [sum(len(s.prompt_tokens) + s.num_response_tokens for g in groups for s in g)
                 for groups in data]

  record = {"benchmark": "learner_step", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "samples_per_batch": cfg.groups_per_update * cfg.group_size,
            "real_tokens_per_batch": float(np.mean(real_tokens))}
  state = parts.learner.initial_state
  for packed in (True, False):
    learner = dataclasses.replace(parts.learner,
                                  config=dataclasses.replace(cfg, pack_sequences=packed))
    laid_out = [int(np.prod(build_lib.make_batch(learner, groups).tokens.shape))
                for groups in data]
    for groups in data:  # compile every shape first
      state, metrics = build_lib.learner_update(learner, state, groups, None, 0, 0)
      jax.device_get(metrics)
    began = time.perf_counter()
    for _ in range(args.repeats):
      for groups in data:
        state, metrics = build_lib.learner_update(learner, state, groups, None, 0, 0)
        jax.device_get(metrics)
    ms = 1e3 * (time.perf_counter() - began) / (args.repeats * len(data))
    name = "packed" if packed else "one_row_per_sample"
    record[name] = {"ms_per_update": ms, "tokens_laid_out_per_batch": float(np.mean(laid_out))}
  record["packed_speedup"] = (record["one_row_per_sample"]["ms_per_update"]
                              / record["packed"]["ms_per_update"])
  record["roofline"] = roofline_record
  record["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
  emit_json_line(record, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
