"""Fault injection at named points of a run, for the chaos and hang tests.

A plan is read once from the environment variable `JAXRL_ASYNC_FAULTS`:

    JAXRL_ASYNC_FAULTS="learner.take_publish=kill@3"            # SIGKILL at the 3rd hit
    JAXRL_ASYNC_FAULTS="reward.call=hang@1,rollout.decode_step=delay:0.5@10"
    JAXRL_ASYNC_FAULTS="checkpoint.before_write=raise:ENOSPC@2"  # OSError(ENOSPC) at the 2nd hit

Each entry is `POINT=ACTION[:ARG][@HIT]` (HIT defaults to 1; the fault fires once, at that hit):
  kill         SIGKILL of this process (no cleanup, as a crash or an OOM kill)
  raise[:ERR]  raises FaultInjected, or OSError(errno.ERR) when ERR is an errno name
  hang         blocks the calling thread for good (a stuck verifier, a dead collective)
  delay:SEC    sleeps SEC seconds, then goes on

With no plan, `point(name)` returns after one global read: the hooks cost nothing in normal
runs. An unknown point or action in the plan is an error at start, naming it, so a typo never
silently disables a chaos test.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import signal
import sys
import threading
import time

ENV = "JAXRL_ASYNC_FAULTS"

POINTS = (
    "checkpoint.before_write",  # the learner is about to write a periodic checkpoint
    "checkpoint.after_write",  # the checkpoint is written and finalized
    "buffer.get_groups",  # the learner asks the buffer for an update's groups, and they are ready
    "learner.trained",  # a version's updates done, the next update's groups not taken yet
    "learner.take_publish",  # next groups taken from the buffer, new version not published
    "reward.call",  # a reward function call, in its call thread
    "sync.publish",  # the learner publishes new weights to the rollout side
    "sync.stage",  # weight store: a version is staged and checked, not yet flipped into place
    "sync.load",  # weight store: a rollout server starts loading a version
    "rollout.decode_step",  # the rollout side runs one decode step
    "rollout.stop",  # a rollout server is asked to stop (the run's end or a checkpointed stop)
)
ACTIONS = ("kill", "raise", "hang", "delay")


class FaultInjected(RuntimeError):
  """Raised at a point whose planned action is `raise` (without an errno)."""


@dataclasses.dataclass
class Fault:
  point: str
  action: str
  arg: str | None = None
  hit: int = 1


def parse_plan(spec: str) -> dict[str, Fault]:
  """`POINT=ACTION[:ARG][@HIT],...` -> {point: Fault}; ValueError names a bad entry."""
  plan: dict[str, Fault] = {}
  for entry in filter(None, (part.strip() for part in spec.split(","))):
    point, sep, rest = entry.partition("=")
    if not sep or point not in POINTS:
      raise ValueError(f"{ENV}: entry {entry!r} must be POINT=ACTION[:ARG][@HIT] with POINT one "
                       f"of {list(POINTS)}")
    rest, _, hit = rest.partition("@")
    action, _, arg = rest.partition(":")
    if action not in ACTIONS:
      raise ValueError(f"{ENV}: entry {entry!r}: action {action!r} is not one of {list(ACTIONS)}")
    if hit and not (hit.isdigit() and int(hit) >= 1):
      raise ValueError(f"{ENV}: entry {entry!r}: HIT must be an int >= 1, got {hit!r}")
    if action == "delay":
      try:
        float(arg)
      except ValueError:
        raise ValueError(f"{ENV}: entry {entry!r}: delay needs seconds, e.g. delay:0.5") from None
    if action == "raise" and arg and not hasattr(errno, arg):
      raise ValueError(f"{ENV}: entry {entry!r}: {arg!r} is not an errno name (e.g. ENOSPC)")
    plan[point] = Fault(point, action, arg or None, int(hit or 1))
  return plan


_plan: dict[str, Fault] | None = None
_hits: dict[str, int] = {}
_lock = threading.Lock()
hanging: set[str] = set()  # points where a thread is blocked by a `hang` fault (for watchdogs)


def configure(spec: str | None) -> None:
  """Installs a plan (None or '' removes it) and resets the hit counts."""
  global _plan
  plan = parse_plan(spec) if spec else None
  with _lock:
    _plan = plan or None
    _hits.clear()


def planned(name: str) -> bool:
  """Whether the plan names the point (for a point whose placement costs something)."""
  return _plan is not None and name in _plan


def point(name: str) -> None:
  """A named fault point: does nothing unless the plan names it and this is its planned hit."""
  if _plan is None:
    return
  fault = _plan.get(name)
  if fault is None:
    return
  with _lock:
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] != fault.hit:
      return
  _fire(fault)


def _fire(fault: Fault) -> None:
  where = f"fault point {fault.point} (hit {fault.hit})"
  print(f"jaxrl_async.faults: {fault.action} at {where}", file=sys.stderr, flush=True)
  if fault.action == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the signal is delivered asynchronously; never run on past it
  elif fault.action == "raise":
    if fault.arg:
      code = getattr(errno, fault.arg)
      raise OSError(code, f"{os.strerror(code)} (injected at {where})")
    raise FaultInjected(f"injected at {where}")
  elif fault.action == "hang":
    hanging.add(fault.point)
    while True:
      time.sleep(3600)
  else:
    time.sleep(float(fault.arg))


configure(os.environ.get(ENV))
