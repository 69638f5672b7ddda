"""The sync baseline's control flow, written once: a generator of effects that a driver performs.

Each version, in turn: admit the version's groups, generate them all, score them all, train on
them in chunks of `groups_per_update` (one local update each), then publish the next version.
`run/sync_loop.run_sync` performs the effects with the real engine, reward pool, buffer and
update; the simulator's sync loop performs them on its virtual clock, so the simulator models
only how long each stage takes.

After drops a version has fewer groups than it admitted: a short chunk trains as it is, and an
empty one ends the version's updates (it still publishes). No threads, clocks or buffer calls
here: the module is pure and imports nothing of the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator


@dataclasses.dataclass(frozen=True)
class Admit:
  """Start `count` groups for `version` (through the buffer's admission)."""
  version: int
  count: int


@dataclasses.dataclass(frozen=True)
class Generate:
  """Generate every admitted sample with the weights of `version`."""
  version: int


@dataclasses.dataclass(frozen=True)
class Score:
  """Score every generated sample and put it into the buffer."""
  version: int


@dataclasses.dataclass(frozen=True)
class Take:
  """Take up to `count` of the version's whole groups. Result: the groups (fewer after drops;
  none, or None, when no group is left)."""
  version: int
  count: int


@dataclasses.dataclass(frozen=True)
class Train:
  """One local update on `groups` (the `local`-th of the version), at version gap 0."""
  groups: list
  version: int
  local: int


@dataclasses.dataclass(frozen=True)
class Publish:
  """Push the trained weights to the rollout side as `version`; `consumed`: the groups the
  version's updates trained on, in order."""
  version: int
  consumed: list


Effect = Admit | Generate | Score | Take | Train | Publish


def sync_schedule(*, start_version: int, num_versions: int, groups_per_update: int,
                  trigger: int) -> Generator[Effect, list | None, None]:
  """From `start_version` up to `num_versions`; `trigger` chunks of `groups_per_update` groups
  each version (its `groups_per_version` = their product)."""
  for version in range(start_version, num_versions):
    yield Admit(version, groups_per_update * trigger)
    yield Generate(version)
    yield Score(version)
    consumed: list = []
    for local in range(trigger):
      chunk = yield Take(version, groups_per_update)
      if not chunk:
        break
      yield Train(chunk, version, local)
      consumed.extend(chunk)
    yield Publish(version + 1, consumed)


def advance(schedule: Generator, result=None) -> Effect | None:
  """The schedule's next effect after sending `result` back; None once it has ended."""
  try:
    return schedule.send(result)
  except StopIteration:
    return None
