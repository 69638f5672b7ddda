"""The learner's control flow, written once: a generator of effects that a driver performs.

`learner_schedule` decides what the learner does and in which order: which groups each update
trains on, when a version is done, when the next update's groups are taken and when a version is
published. It does nothing itself: it yields an effect, the driver performs it and sends back
the result. `LearnerRole.run` (learner/learner.py) performs the effects against the real buffer,
update and weight channel; the simulator's learner performs them on its virtual clock. So both
follow one control flow, and the simulator models only how long each effect takes.

A driver stops the schedule by answering `Take` (or `TakeReady`) with None: the schedule then
ends at once, or, for `TakeReady`, goes on without groups. Groups already in hand (`taken`, or a
`TakeReady` result) are always trained first: they have left the buffer (counted as consumed),
so a stop must not lose them.

No threads, clocks or buffer calls here: the module is pure and imports nothing of the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator


@dataclasses.dataclass(frozen=True)
class Publish:
  """Publish the learner's weights as `version`. `start`: the run's first version, published
  before any update because the weight channel did not hold it yet; otherwise a version window
  just ended (and its next groups, if any, were taken)."""
  version: int
  start: bool = False


@dataclasses.dataclass(frozen=True)
class Take:
  """Wait for one update's groups at learner version `version`. Result: the groups, or None
  when the role stops (the schedule then ends)."""
  version: int


@dataclasses.dataclass(frozen=True)
class Update:
  """Check `groups` against the staleness bound and make one local update on them. `local` is
  the update's index in its version window: 0 opens the window (the driver snapshots the
  window's params and starts its metric sums then)."""
  groups: list
  version: int
  local: int


@dataclasses.dataclass(frozen=True)
class Trained:
  """The window's updates are done: the learner's version is `version` now (not published
  yet)."""
  version: int


@dataclasses.dataclass(frozen=True)
class TakeReady:
  """Take the next update's groups if they are already queued, judged at the new `version`,
  never waiting. Taking them before the version is announced keeps the rollouter's new
  admission window from counting them as carried over. Result: the groups or None."""
  version: int


@dataclasses.dataclass(frozen=True)
class VersionDone:
  """Version `version` is published; `consumed`: the groups its window trained on, in order."""
  version: int
  consumed: list


Effect = Publish | Take | Update | Trained | TakeReady | VersionDone


def learner_schedule(*, start_version: int, num_versions: int, trigger: int,
                     taken: list | None = None, published: int = -1
                     ) -> Generator[Effect, list | None, None]:
  """From `start_version` up to `num_versions`, `trigger` updates per version.

  `taken`: groups already taken for the first update (a restored run's); `published`: the
  newest version the weight channel holds (the start version is published if it is newer).
  """
  version = start_version
  if published < version:
    yield Publish(version, start=True)
  while version < num_versions:
    consumed: list = []
    for local in range(trigger):
      groups = taken if taken is not None else (yield Take(version))
      taken = None
      if groups is None:
        return
      yield Update(groups, version, local)
      consumed.extend(groups)
    version += 1
    yield Trained(version)
    if version < num_versions:
      taken = yield TakeReady(version)
    yield Publish(version)
    yield VersionDone(version, consumed)


def drive(schedule: Generator, perform: Callable) -> None:
  """Runs `schedule` to its end: performs each effect it yields with `perform(effect)` and
  sends the result back."""
  result = None
  while True:
    try:
      effect = schedule.send(result)
    except StopIteration:
      return
    result = perform(effect)
