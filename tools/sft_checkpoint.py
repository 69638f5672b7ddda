"""Supervised fine-tuning of a Hugging Face checkpoint on a task's reference answers, written
back as a Hugging Face directory that `RunConfig.checkpoint` can start a run from.

A run starts from a checkpoint as it is. One that never gives an answer the task's reward
accepts (a random one, or one that does not know the answer's format) gives every sample of a
group the same reward, so every GRPO advantage and gradient is 0 and RL learns nothing. This is
the warm start the built-in models get (`learner/sft.py`), applied to a checkpoint:

  python tools/sft_checkpoint.py --checkpoint tests/fixtures/hf/qwen2 --out /tmp/qwen2-sft \\
      --gin_file gin/tasks/gsm8k.gin --gin_bindings "GSM8K_TRAIN = 'train.jsonl'" \\
      --gin_bindings "GSM8K_TEST = None" --gin_bindings "TOKENIZER_DIR = 'tests/fixtures/hf/qwen2'" \\
      --steps 400

The task comes from the gin files (`RunConfig.task`); the model from the checkpoint, trained in
float32 on the learner mesh of the gin files (default: all local devices). The output holds
the new weights (float32 unless `--dtype`), the checkpoint's config.json fields the decoder does
not own, and its tokenizer files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin
from jaxrl_async import config as config_lib
from jaxrl_async import sharding
from jaxrl_async.learner import sft
from jaxrl_async.model import weights
from jaxrl_async.run import build
from launch import train


def parse_args(argv=None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", required=True, help="Hugging Face checkpoint directory")
  parser.add_argument("--out", required=True, help="directory to write the fine-tuned one to")
  parser.add_argument("--gin_file", action="append", default=[], help="gin files naming the task")
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--learning_rate", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--dtype", default=None, help="tensors' dtype on disk (default float32)")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  if os.path.abspath(args.out) == os.path.abspath(args.checkpoint):
    raise SystemExit("sft_checkpoint: --out must differ from --checkpoint")
  if not args.gin_file:
    raise SystemExit("sft_checkpoint: give the task's gin file (--gin_file)")
  train.load_config(args.gin_file, args.gin_bindings)
  config = gin.get_configurable(config_lib.RunConfig)()
  gin.clear_config()
  if config.task is None:
    raise SystemExit("sft_checkpoint: the gin files set no RunConfig.task")
  checkpoint = weights.HFCheckpoint(args.checkpoint, dtype="float32", param_dtype="float32",
                                    remat=False)
  spec = build.model_spec(dataclasses.replace(config, checkpoint=checkpoint))
  mesh = sharding.place_roles(config.learner_mesh, config.rollout_mesh).learner
  params = checkpoint.load(spec.model_config, mesh, spec.logical_axes)
  recipe = sft.WarmStartConfig(steps=args.steps, batch_size=args.batch_size,
                               learning_rate=args.learning_rate, seed=args.seed)
  print(f"sft_checkpoint: {args.checkpoint} -> {args.out}, {args.steps} steps of "
        f"{args.batch_size} rows of {type(config.task).__name__}", flush=True)
  params = sft.warm_start(spec.task, spec.model_config, recipe, mesh, initial_params=params,
                          log=lambda line: print(line, flush=True))
  files = weights.save_params(params, spec.model_config, args.out, base=args.checkpoint,
                              dtype=args.dtype)
  print(f"sft_checkpoint: wrote {len(files)} files to {args.out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
