"""The run's shared schedules performed on the virtual clock, against the real buffer.

`SimLearner` performs `learner_schedule` (learner/schedule.py), the control flow of
`LearnerRole.run`; `sync_loop` performs `sync_schedule` (learner/sync_schedule.py), that of
`run/sync_loop.run_sync`. The order of takes, updates and publishes is thus the live roles' own;
what is modelled here is only how long each effect takes on the learner's device (or how long it
waits for groups), as generators of ('work', device, seconds, role) and ('wait', name) for
`Process`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.learner import sync_schedule as sync
from jaxrl_async.learner.learner import check_staleness
from jaxrl_async.learner.schedule import (
  Publish,
  Take,
  TakeReady,
  Trained,
  Update,
  VersionDone,
  learner_schedule,
)
from jaxrl_async.sim.clock import Clock, Device
from jaxrl_async.sim.replicas import Replica, ReplicaPool
from jaxrl_async.sim.roles import NO_WAIT_S, ReadyGroups
from jaxrl_async.types import Sample


def drive_on_clock(schedule: Generator, perform: Callable[[object], Generator]):
  """A schedule's effects performed on the virtual clock: `perform(effect)` is a generator of
  work and waits (for `Process`) that returns the effect's result."""
  result = None
  while True:
    try:
      effect = schedule.send(result)
    except StopIteration:
      return
    result = yield from perform(effect)


class SimLearner:
  """`LearnerRole.run` on the virtual clock; `update_s(groups, local)` models one update."""

  def __init__(self, *, device: Device, ready: ReadyGroups, publish: Callable[[int], None],
               update_s: Callable[[list, int], float], sync_s: float, overhead_s: float,
               groups_per_update: int,
               trigger_parameter_sync_step: int, num_versions: int, on_policy: bool,
               max_version_gap: int | None, debug_checks: bool,
               on_version: Callable[[int, list, dict, float], None]):
    self.device = device
    self.ready = ready
    self.publish = publish
    self.update_s = update_s
    self.sync_s = sync_s
    self.overhead_s = overhead_s  # host time per version on this thread (the record etc.)
    self.groups_per_update = groups_per_update
    self.trigger = trigger_parameter_sync_step
    self.num_versions = num_versions
    self.on_policy = on_policy
    self.max_version_gap = max_version_gap
    self.on_version = on_version
    self.debug_checks = debug_checks
    self.version = 0
    self.updates = 0
    self.wait_s = 0.0
    self.latest_published = -1
    self.published_at: dict[int, float] = {}  # version -> when its publish began

  def _get_groups(self, clock: Clock):
    groups = self.ready.take(self.groups_per_update, self.version)
    began = clock.now
    while groups is None:
      yield ("wait", "groups")
      groups = self.ready.take(self.groups_per_update, self.version)
    self.wait_s += clock.now - began
    return groups

  def run(self, clock: Clock):
    schedule = learner_schedule(start_version=self.version, num_versions=self.num_versions,
                                trigger=self.trigger, published=self.latest_published)
    yield from drive_on_clock(schedule, lambda effect: self._perform(effect, clock))

  def _perform(self, effect, clock: Clock):
    """Each effect of `learner_schedule` as work on the learner's device, or a wait."""
    match effect:
      case Take():
        return (yield from self._get_groups(clock))
      case Update(groups=groups, version=version, local=local):
        if self.debug_checks:
          check_staleness(groups, version, on_policy=self.on_policy,
                          max_version_gap=self.max_version_gap)
        yield ("work", self.device, self.update_s(groups, local), "learner")
        self.updates += 1
      case Trained(version=version):
        self.version = version
      case TakeReady(version=version):
        return self.ready.take(self.groups_per_update, version)
      case Publish(version=version):
        self.published_at[version] = clock.now
        yield ("work", self.device, self.sync_s, "sync")
        self.latest_published = version
        self.publish(version)
      case VersionDone(version=version, consumed=consumed):
        self.on_version(version, consumed, {"learner/wait_s": self.wait_s}, self.sync_s)
        if self.overhead_s and version < self.num_versions:
          yield ("work", self.device, self.overhead_s, "host")
    return None


def sync_loop(clock: Clock, *, pool: ReplicaPool, buffer: VersionedBuffer, ready: ReadyGroups,
              learner: Device, update_s: Callable[[list, int], float], sync_s: float,
              overhead_s: float, group_size: int, groups_per_update: int,
              trigger_parameter_sync_step: int, num_versions: int, state: dict,
              process: list, debug_checks: bool,
              on_version: Callable[[int, list, dict, float], None]):
  """`sync_loop.run_sync` on the virtual clock: `sync_schedule`'s stages, each ending before
  the next begins."""
  finished: list[Sample] = []
  scored: list[Sample] = []
  # `process`: the caller puts the Process that runs this generator in it, to be woken.

  def on_turn(replica: Replica) -> None:
    if not pool.step(replica, admit=True) and all(
        not r.device.busy and not r.active and not r.pending for r in pool.replicas):
      process[0].wake("generated")

  def on_rewarded(samples: list[Sample]) -> None:
    scored.extend(samples)
    if len(scored) == len(finished):
      process[0].wake("scored")

  next_group = 0

  def perform(effect):
    nonlocal next_group
    match effect:
      case sync.Admit(count=count):
        if overhead_s:
          yield ("work", learner, overhead_s, "host")
        for _ in range(count):
          buffer.acquire_group_slot(timeout=NO_WAIT_S, group_id=next_group)
          pool.least_loaded().pending.extend(pool.new_group(next_group, group_size))
          next_group += 1
      case sync.Generate():
        for replica in pool.replicas:
          clock.at(clock.now, on_turn, replica)
        began = clock.now
        yield ("wait", "generated")
        state["generate_s"] = state.get("generate_s", 0.0) + clock.now - began
      case sync.Score():
        pool.score(list(finished))
        yield ("wait", "scored")
        ready.put_many(scored, NO_WAIT_S)
        finished.clear()
        scored.clear()
      case sync.Take(version=version, count=count):
        count = min(count, ready.estimate)  # after drops the last chunk may be short
        return ready.take(count, version) if count else None
      case sync.Train(groups=groups, version=version, local=local):
        if debug_checks:
          check_staleness(groups, version, on_policy=True, max_version_gap=0)
        yield ("work", learner, update_s(groups, local), "learner")
        state["updates"] = state.get("updates", 0) + 1
      case sync.Publish(version=version, consumed=consumed):
        yield ("work", learner, sync_s, "sync")
        for replica in pool.replicas:
          replica.version = version
        buffer.publish_version(version)
        on_version(version, consumed, {}, sync_s)
    return None

  pool.on_turn, pool.on_finished, pool.on_rewarded = on_turn, finished.extend, on_rewarded
  for replica in pool.replicas:
    replica.version = 0
  yield from drive_on_clock(sync.sync_schedule(
      start_version=0, num_versions=num_versions, groups_per_update=groups_per_update,
      trigger=trigger_parameter_sync_step), perform)
