"""The learner update on real rollouts: packed rows against one row per sample, side by side.

Generates batches with the default run's base policy and engine (64 samples: 8 GRPO groups of 8,
the long-tailed digit-reverse task), then times `build_lib.learner_update` (layout, transfer,
jitted update, metrics) on the same batches with `pack_sequences` on and off, after every shape
has compiled. Prints one JSON line: ms per update, tokens per batch (real and as laid out).

    python benchmarks/learner_step.py [--batches 30] [--repeats 5] [--out FILE]
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
from benchmarks.common import emit_json_line
from jaxrl_async import compilation_cache
from jaxrl_async.config import RunConfig
from jaxrl_async.run import build as build_lib
from launch.train import DEFAULT_GIN, load_config


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, default=30)
  parser.add_argument("--repeats", type=int, default=5, help="passes over the batches")
  parser.add_argument("--out", default=None)
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="bindings on top of the default run's gin file")
  args = parser.parse_args(argv)
  compilation_cache.enable()
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
  emit_json_line(record, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
