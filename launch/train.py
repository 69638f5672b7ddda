"""Train: parse gin files and bindings, write the operative config, run one experiment.

    jaxrl-async train --gin_file gin/modes/async_partial.gin --run_dir runs/demo
    python -m launch.train --gin_file gin/modes/sync.gin --gin_bindings 'RunConfig.seed = 1'

A learner over several processes (`jax.distributed`, one process per host): every process runs
the same command; the coordinator, the process count and this process's id come from
--coordinator_address / --num_processes / --process_id, else JAX_COORDINATOR_ADDRESS /
JAX_NUM_PROCESSES / JAX_PROCESS_ID, SLURM or a Cloud TPU slice (`jaxrl_async/distributed.py`).
Process 0 runs the run; the others join its learner mesh (`jaxrl_async/run/multihost.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.util  # noqa: F401  (gin-config 0.5 needs it loaded to resolve file paths)
import json
import os
import pathlib
import signal
import sys
import time

import gin
from jaxrl_async import compilation_cache, distributed
from jaxrl_async import config as config_lib
from jaxrl_async.checkpoint import CheckpointError, check_run_dir
from jaxrl_async.run import api
from jaxrl_async.run import build as build_lib
from jaxrl_async.run.services import task_services
from launch import train_multiprocess as multiprocess

GIN_DIR = pathlib.Path(__file__).resolve().parent.parent / "gin"
DEFAULT_GIN = "gin/modes/async_partial.gin"


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="jaxrl-async train", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gin_file", action="append", default=None,
                      help=f"gin file(s), applied in order (default: {DEFAULT_GIN})")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="extra bindings, e.g. 'RunConfig.total_samples = 4096'")
  parser.add_argument("--run_dir", default=None, help="where metrics, checkpoints, config go")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  parser.add_argument("--no_progress", action="store_true", help="no progress bar")
  parser.add_argument("--coordinator_address", default=None,
                      help="host:port of process 0 (a multi-process learner)")
  parser.add_argument("--num_processes", type=int, default=None)
  parser.add_argument("--process_id", type=int, default=None)
  parser.add_argument("--init_timeout_s", type=int, default=300,
                      help="how long process 0 waits for every process to join")
  parser.add_argument("--heartbeat_timeout_s", type=int, default=100,
                      help="a process silent this long is taken for dead by jax.distributed")
  return parser.parse_args(argv)


def resolve_gin_file(path: str) -> str:
  """A gin file by path, or relative to the repository's gin/ folder."""
  for candidate in (pathlib.Path(path), GIN_DIR.parent / path, GIN_DIR / path):
    if candidate.is_file():
      return str(candidate)
  raise FileNotFoundError(f"gin file {path!r} not found (looked in ., {GIN_DIR.parent}, {GIN_DIR})")


def load_config(gin_files, bindings) -> None:
  gin.clear_config()
  gin.add_config_file_search_path(str(GIN_DIR.parent))
  gin.add_config_file_search_path(str(GIN_DIR))
  # Short names in bindings: 'RunConfig.x = 1' means 'jaxrl_async.config.RunConfig.x = 1'.
  bindings = [_qualify(binding) for binding in bindings]
  gin.parse_config_files_and_bindings([resolve_gin_file(f) for f in gin_files], bindings,
                                      finalize_config=False)


_SHORT_NAMES = {
    "RunConfig.": "jaxrl_async.config.RunConfig.",
    "LearnerConfig.": "jaxrl_async.learner.step.LearnerConfig.",
    "WarmStartConfig.": "jaxrl_async.learner.sft.WarmStartConfig.",
    "SamplingConfig.": "jaxrl_async.rollout.sampling.SamplingConfig.",
    "DigitReverseTask.": "jaxrl_async.tasks.reverse.DigitReverseTask.",
    "RLVRReverseTask.": "jaxrl_async.tasks.rlvr.RLVRReverseTask.",
    "VerifierSettings.": "jaxrl_async.tasks.verifier_service.VerifierSettings.",
    "TextTask.": "jaxrl_async.tasks.text_task.TextTask.",
    "Fields.": "jaxrl_async.tasks.datasets.Fields.",
    "MathReward.": "jaxrl_async.tasks.math_rewards.MathReward.",
    "MeshShape.": "jaxrl_async.sharding.MeshShape.",
    "HFCheckpoint.": "jaxrl_async.model.weights.HFCheckpoint.",
}


def _qualify(binding: str) -> str:
  stripped = binding.strip()
  for short, full in _SHORT_NAMES.items():
    if stripped.startswith(short):
      return full + stripped[len(short):]
  return stripped


def main(argv=None) -> int:
  args = parse_args(argv)
  # `kill -USR1 <pid>` prints every thread's stack to stderr (a run that seems stuck).
  # (Not where stderr has no file descriptor, as under a test's captured output.)
  with contextlib.suppress(AttributeError, ValueError, OSError):
    faulthandler.register(signal.SIGUSR1, all_threads=True)
  # SIGINT stops a run with a checkpoint (Ctrl-C, `kill -INT`, a sweep stopping its trials),
  # also where the run was started as a background job of a non-interactive shell, which
  # starts it with SIGINT ignored (then Python installs no handler). Main thread only.
  with contextlib.suppress(ValueError):
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
      signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    spec = distributed.cluster_spec(args.coordinator_address, args.num_processes,
                                    args.process_id)
  except ValueError as error:
    print(f"jaxrl-async train: configuration error: {error}", file=sys.stderr)
    return 2
  compilation_cache.enable()
  if spec.is_distributed:
    return multiprocess.main(args, spec, _train, load_config, DEFAULT_GIN)
  with contextlib.ExitStack() as services:
    return _train(args, services)


def _train(args, services: contextlib.ExitStack, build=build_lib.build) -> int:
  try:
    load_config(args.gin_file or [DEFAULT_GIN], args.gin_bindings)
    # Build the RunConfig and the run's parts now, so a bad setting fails before any training.
    config = gin.get_configurable(config_lib.RunConfig)()
    run_dir = args.run_dir or os.path.join(
        "runs", f"{config.mode}-{time.strftime('%Y%m%d-%H%M%S')}")
    check_run_dir(run_dir, args.resume)
    api.check_backend(config)
    config = services.enter_context(task_services(config))  # e.g. a verifier process
    parts = build(config)
  except SyntaxError as error:  # gin's parser: quote the line, bindings are joined in order
    print(f"jaxrl-async train: configuration error: gin syntax in "
          f"{error.filename or 'the bindings'}, line {error.lineno}: {error.text!r}: "
          f"{error.msg}", file=sys.stderr)
    return 2
  except (ValueError, TypeError, FileNotFoundError, CheckpointError) as error:
    print(f"jaxrl-async train: configuration error: {error}", file=sys.stderr)
    return 2
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "config.gin"), "w", encoding="utf-8") as f:
    f.write(gin.config_str())
  print(f"run_dir: {os.path.abspath(run_dir)} (mode {config.mode}, "
        f"{config.num_versions} policy versions, {config.total_samples} samples)")
  try:
    summary = api.train(parts, run_dir, resume=args.resume,
                        progress=not args.no_progress).summary
  except KeyboardInterrupt:
    print(f"\ninterrupted; resume with --resume --run_dir {run_dir}", file=sys.stderr)
    return 130
  except CheckpointError as error:
    print(f"jaxrl-async train: {error}", file=sys.stderr)
    return 1
  keys = ("mode", "eval/accuracy", "system/samples_per_s", "learner/idle_ratio",
          "rollout/idle_ratio", "system/wall_s")
  print(json.dumps({k: summary[k] for k in keys if k in summary}))
  print(f"metrics:    {os.path.join(os.path.abspath(run_dir), 'metrics.jsonl')}")
  print(f"checkpoint: {summary.get('checkpoint_dir')}")
  print(f"summary:    {os.path.join(os.path.abspath(run_dir), 'summary.json')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
