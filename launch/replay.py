"""Replay a recorded async run from its initial state (docs/replay.md).

    jaxrl-async replay runs/demo                          # learner replay: bit-identical checkpoints
    jaxrl-async replay runs/demo --level full             # samples drawn again, then trained
    jaxrl-async replay runs/demo --as_sync --until 50     # the same prompts and keys, on-policy

The run's operative config (RUN_DIR/config.gin) builds the same parts; the report (JSON) is
printed and written to --out (default RUN_DIR/replay-<level>[-as_sync].json). Exit code 0 when
every checkpoint compared is equal bit for bit (or, with --as_sync, when the replay finished),
1 otherwise, 2 for a bad argument or run directory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import gin
from jaxrl_async import compilation_cache
from jaxrl_async import config as config_lib
from jaxrl_async.run import build as build_lib
from jaxrl_async.run.replay import LEVELS, replay
from jaxrl_async.run.schedule_read import ScheduleError
from jaxrl_async.run.services import task_services
from launch.train import load_config


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="jaxrl-async replay", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run_dir", help="a run directory with config.gin and schedule/")
  parser.add_argument("--level", choices=LEVELS, default="learner",
                      help="learner: the recorded batches; full: the samples drawn again too")
  parser.add_argument("--until", type=int, default=None,
                      help="stop once this policy version is made")
  parser.add_argument("--as_sync", action="store_true",
                      help="each version's groups generated on-policy (same prompts and keys)")
  parser.add_argument("--out", default=None, help="where the JSON report goes")
  return parser.parse_args(argv)


def main(argv=None) -> int:
  args = parse_args(argv)
  config_path = os.path.join(args.run_dir, "config.gin")
  if not os.path.isfile(config_path):
    print(f"jaxrl-async replay: {config_path} not found: RUN_DIR must be a run directory "
          "written by `jaxrl-async train`", file=sys.stderr)
    return 2
  compilation_cache.enable()
  try:
    load_config([config_path], [])
    config = gin.get_configurable(config_lib.RunConfig)()
    if not config.is_async:
      raise ValueError(f"the run in {args.run_dir} is mode={config.mode!r}: only async runs "
                       "record a schedule")
    with contextlib.ExitStack() as services:
      config = services.enter_context(task_services(config))
      parts = build_lib.build(config)
      try:
        report = replay(parts, args.run_dir, level=args.level, until=args.until,
                        as_sync=args.as_sync)
      finally:
        parts.rollout.rewards.close()
  except (ValueError, ScheduleError) as error:
    print(f"jaxrl-async replay: {error}", file=sys.stderr)
    return 2
  out = args.out or os.path.join(
      args.run_dir, f"replay-{args.level}{'-as_sync' if args.as_sync else ''}.json")
  with open(out, "w", encoding="utf-8") as f:
    json.dump(report, f, indent=2)
  print(json.dumps({k: report[k] for k in ("level", "as_sync", "versions", "bitwise_equal",
                                           "checkpoints", "schedule") if k in report}))
  if "tokens" in report:
    print(json.dumps({"tokens": report["tokens"]}))
  print(f"report: {out}")
  return 0 if args.as_sync or report["bitwise_equal"] else 1


if __name__ == "__main__":
  sys.exit(main())
