"""`jaxrl-async train` as one process of a multi-process learner (`jax.distributed`).

Process 0 runs `launch.train`'s run with its learner on the global mesh (`run/multihost.py`'s
Leader); every other process follows it. However process 0 ends, the others end too: a finished
run tells them to stop (then every process leaves `jax.distributed`); a failed one tells them
to abort where it can, and a process that is gone fails the others' next collective or wait.
A failed process exits at once (`os._exit`): leaving `jax.distributed` would wait for a barrier
that a dead process never joins.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import traceback

from jaxrl_async import distributed
from jaxrl_async.run import multihost


def main(args, spec: distributed.ClusterSpec, train, load_config, default_gin) -> int:
  distributed.initialize(spec, timeout_s=args.init_timeout_s,
                         heartbeat_timeout_s=args.heartbeat_timeout_s)
  if spec.process_id == 0:
    return _controller(args, train)
  return _follower(args, spec, load_config, default_gin)


def _exit(code: int):
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(code)


def lost_learner(error: BaseException | None) -> multihost.LearnerLost | None:
  """The LearnerLost behind `error` (itself, or a cause of a role's failure), if any."""
  seen = set()
  while error is not None and id(error) not in seen:
    if isinstance(error, multihost.LearnerLost):
      return error
    seen.add(id(error))
    error = error.__cause__ or error.__context__
  return None


def _controller(args, train) -> int:
  leaders: list[multihost.Leader] = []

  def build(config):
    parts = multihost.build_leader(config)
    leaders.append(parts.learner.multihost)
    return parts

  try:
    with contextlib.ExitStack() as services:
      code = train(args, services, build=build)
  except BaseException as error:
    lost = lost_learner(error)
    if lost is None:
      traceback.print_exc()
      message = f"{type(error).__name__}: {error}"
      if leaders:
        leaders[0].abort(message)
    else:
      message = str(lost)
    print(f"jaxrl-async train: the run stopped: {message}", file=sys.stderr)
    _exit(1)
  if not leaders:  # the build failed: the others may wait in one of its collectives
    _exit(code)
  try:
    leaders[0].stop()
  except multihost.LearnerLost as error:
    print(f"jaxrl-async train: {error}", file=sys.stderr)
    _exit(1)
  distributed.shutdown()
  return code


def _follower(args, spec, load_config, default_gin) -> int:
  import gin
  from jaxrl_async import config as config_lib
  try:
    load_config(args.gin_file or [default_gin], args.gin_bindings)
    config = gin.get_configurable(config_lib.RunConfig)()
    updates = multihost.follow(config)
  except BaseException as error:
    if lost_learner(error) is None:
      traceback.print_exc()
    print(f"jaxrl-async train (learner process {spec.process_id}): {error}", file=sys.stderr)
    _exit(1)
  print(json.dumps({"process_id": spec.process_id, "learner_updates": updates}), flush=True)
  distributed.shutdown()
  return 0
