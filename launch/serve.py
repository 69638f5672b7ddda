"""Serve a run's policy over gRPC with JetStream's protocol (`jetstream_proto.Orchestrator`).

    jaxrl-async serve --checkpoint runs/sync                  # latest checkpoint, 127.0.0.1:9000
    jaxrl-async serve --checkpoint runs/sync/checkpoints --step 50 --port 0 --temperature 0
    jaxrl-async serve --hf_model path/to/Qwen2.5-0.5B --max_seq_len 2048 --temperature 0
    jaxrl-async serve --checkpoint runs/sync --port 0 --eval_size 256    # accuracy via gRPC

`--eval_size N` instead evaluates held-out accuracy through the server (N problems of the run's
task, one streamed request each, as a client would), prints one JSON line and stops.

The run's `config.gin` says which model and task the checkpoint belongs to; a Hugging Face
directory (config.json, safetensors, tokenizer.json; the `hf` extra) brings its own. Without
tokenizer.json it is served for prompts sent as token ids (text prompts are refused), ending
responses at generation_config.json's eos_token_id. The server prints `serving <what> on
<host>:<port>` once it takes requests, and stops on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util  # noqa: F401  (gin-config 0.5 needs it loaded to resolve file paths)
import json
import os
import signal
import sys
import threading

import gin
from jaxrl_async import config as config_lib
from launch.train import load_config


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="jaxrl-async serve", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--checkpoint", help="a run directory, or its checkpoints/ folder")
  source.add_argument("--hf_model", help="a Hugging Face model directory (without "
                      "tokenizer.json: prompts as token ids only)")
  parser.add_argument("--max_seq_len", type=int, default=None,
                      help="--hf_model: KV cache length (default max_position_embeddings)")
  parser.add_argument("--max_prompt_len", type=int, default=None,
                      help="--hf_model: longest prompt (default half of max_seq_len)")
  parser.add_argument("--step", type=int, default=None, help="policy version (default: latest)")
  parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
  parser.add_argument("--port", type=int, default=9000, help="0 picks a free port")
  parser.add_argument("--max_concurrent_decodes", type=int, default=32)
  parser.add_argument("--decode_steps_per_call", type=int, default=1)
  parser.add_argument("--temperature", type=float, default=None,
                      help="sampling temperature (default: the run's; 0 = greedy)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the sampling keys")
  parser.add_argument("--eval_size", type=int, default=0,
                      help="with --checkpoint: evaluate this many held-out problems through the "
                           "server, print the metrics, stop")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  from jaxrl_async.rollout.sampling import SamplingConfig
  from jaxrl_async.serve import policy as policy_lib
  from jaxrl_async.serve.server import PolicyServer
  from jaxrl_async.tasks.reverse import DigitReverseTask
  task = None
  try:
    if args.eval_size < 0 or (args.eval_size and args.hf_model):
      raise ValueError(f"--eval_size must be >= 0 and needs --checkpoint (a run's task), got "
                       f"{args.eval_size}")
    if args.hf_model:
      sampling = SamplingConfig()
      policy = policy_lib.policy_from_hf(args.hf_model, max_seq_len=args.max_seq_len,
                                         max_prompt_len=args.max_prompt_len)
    else:
      run_dir = policy_lib.run_dir_of(args.checkpoint)
      load_config([os.path.join(run_dir, "config.gin")], [])
      config = gin.get_configurable(config_lib.RunConfig)()
      sampling = config.sampling
      policy = policy_lib.policy_from_checkpoint(config, args.checkpoint, args.step)
      task = config.task if config.task is not None else DigitReverseTask(config.seed)
    if args.temperature is not None:
      sampling = dataclasses.replace(sampling, temperature=args.temperature)
    server = PolicyServer(policy, host=args.host, port=args.port,
                          max_concurrent_decodes=args.max_concurrent_decodes, sampling=sampling,
                          seed=args.seed, steps_per_call=args.decode_steps_per_call)
  except (ValueError, TypeError, FileNotFoundError, OSError) as error:
    print(f"jaxrl-async serve: {error}", file=sys.stderr)
    return 2
  finally:
    gin.clear_config()
  if args.eval_size:
    return _evaluate(server, task, args.eval_size)
  stopping = threading.Event()
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, lambda *_: stopping.set())
  server.start()
  print(f"serving {policy.description} on {server.address}", flush=True)
  try:
    while not stopping.wait(timeout=1.0):
      if not server.driver.alive:
        print(f"jaxrl-async serve: the decode driver stopped: {server.driver.error!r}",
              file=sys.stderr)
        return 1
  finally:
    server.stop()
  return 0


def _evaluate(server, task, eval_size: int) -> int:
  import grpc

  from jaxrl_async.serve.client import evaluate_through_server
  with server:
    print(f"evaluating {eval_size} held-out problems through {server.address}", flush=True)
    with grpc.insecure_channel(server.address) as channel:
      metrics = evaluate_through_server(channel, task, task.eval_set(eval_size))
  print(json.dumps({"policy_version": server.policy.version, **metrics}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
