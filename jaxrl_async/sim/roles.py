"""The roles' control flow on the virtual clock, against the real `VersionedBuffer`.

- `SimRollouter` follows `rollout/rollouter.py`: on a newer published version, with
  `partial_rollout` off it stops starting samples and lets the ones in flight finish, then swaps;
  with it on it swaps at the next step boundary and resumes the interrupted samples. It admits
  groups through the buffer (`available_slots`, `acquire_group_slot`) while a replica has room
  for `slots + group_size` samples, and puts every scored sample into the buffer. All replicas
  swap to a version before the buffer is told the rollout side holds it (`publish_version`), so
  a group admitted in window v is generated with weights >= v.
- `SimLearner.run` follows `LearnerRole.run` step by step: take `groups_per_update` groups,
  check them with the real `check_staleness`, update, and after `trigger_parameter_sync_step`
  updates take the groups already queued at the new version before publishing it.
- `sync_loop` follows `sync_loop.run_sync`: generate one version's groups, score them all,
  update on them chunk by chunk, push the weights; each stage waits for the previous one.

The buffer is called only with non-blocking arguments: admission when `available_slots > 0`,
puts of admitted groups (which never fill it), and `get_groups` with a tiny timeout when the
groups should be ready (`BufferTimeout` otherwise: nothing taken).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from jaxrl_async.buffer import BufferTimeout, VersionedBuffer
from jaxrl_async.learner.learner import check_staleness
from jaxrl_async.sim.clock import Clock, Device
from jaxrl_async.sim.replicas import Replica, ReplicaPool
from jaxrl_async.types import Sample

NO_WAIT_S = 1e-9  # timeouts for calls that must not block (a real wait would be a bug here)


class Process:
  """Drives a generator that yields ('work', device, seconds, role) or ('wait', name)."""

  def __init__(self, clock: Clock, body: Generator):
    self.clock = clock
    self.body = body
    self.waiting: str | None = None
    self.finished = False

  def start(self) -> None:
    self.resume(None)

  def resume(self, value) -> None:
    try:
      command = self.body.send(value)
    except StopIteration:
      self.finished = True
      return
    if command[0] == "work":
      _, device, seconds, role = command
      device.start(seconds, lambda: self.resume(None), role)
    else:
      self.waiting = command[1]

  def wake(self, name: str, value=None) -> bool:
    if self.waiting != name:
      return False
    self.waiting = None
    self.resume(value)
    return True


class ReadyGroups:
  """Which groups should be ready in the buffer: a hint for when to call `get_groups`.

  Groups whose members all arrived without a failure are counted; the buffer may still drop
  some as stale in `get_groups`, so after a timeout the count is re-read from its counters.
  """

  def __init__(self, buffer: VersionedBuffer, group_size: int):
    self.buffer = buffer
    self.group_size = group_size
    self._arrived: dict[int, list] = {}  # group id -> [members arrived, any failure]
    self.completed_ok = 0
    self.estimate = 0
    self.on_refund: Callable[[], None] | None = None
    self._stale_seen = 0

  def put(self, sample: Sample, timeout_s: float) -> int:
    """Puts the sample: 1 if it completed a group that should be ready, -1 if it completed a
    group the buffer drops (a failed member), else 0."""
    self.buffer.put(sample, timeout=timeout_s)
    return self._arrive(sample)

  def put_many(self, samples: list[Sample], timeout_s: float,
               on_ready: Callable[[], None] | None = None) -> bool:
    """Puts the samples in order, as many at a time as the buffer's `put_many` allows: a run
    ends at each sample that completes a group that should be ready, and `on_ready()` is
    called before the next sample is put (as after each `put`). Returns whether any sample
    completed a group the buffer drops."""
    dropped = False
    begin = 0
    for i, sample in enumerate(samples):
      outcome = self._arrive(sample)
      if outcome > 0:
        self.buffer.put_many(samples[begin:i + 1], timeout=timeout_s)
        begin = i + 1
        if on_ready is not None:
          on_ready()
      elif outcome < 0:
        dropped = True
    if begin < len(samples):
      self.buffer.put_many(samples[begin:], timeout=timeout_s)
    return dropped

  def _arrive(self, sample: Sample) -> int:
    entry = self._arrived.get(sample.group_id)
    if entry is None:
      entry = self._arrived[sample.group_id] = [0, False]
    entry[0] += 1
    entry[1] = entry[1] or sample.reward_status != "ok"
    if entry[0] < self.group_size:
      return 0
    del self._arrived[sample.group_id]
    if entry[1]:
      return -1
    self.completed_ok += 1
    self.estimate += 1
    return 1

  def take(self, num_groups: int, learner_version: int):
    """`num_groups` groups if the buffer has them now, else None (nothing taken)."""
    if self.estimate < num_groups:
      return None
    try:
      groups = self.buffer.get_groups(num_groups, learner_version, timeout=NO_WAIT_S)
    except BufferTimeout:
      counts = self.buffer.counts
      self.estimate = (self.completed_ok - counts["consumed_groups"]
                       - counts["dropped_groups"]["stale"])
      return None
    self.estimate -= num_groups
    if self.on_refund is not None:
      stale = self.buffer.counts["dropped_groups"]["stale"]
      if stale > self._stale_seen:
        self._stale_seen = stale
        self.on_refund()  # stale drops refund admissions
    return groups


class SimRollouter:
  def __init__(self, clock: Clock, pool: ReplicaPool, buffer: VersionedBuffer,
               ready: ReadyGroups, *, group_size: int, partial_rollout: bool,
               partial_strategy: str, on_group_ready: Callable[[], None]):
    self.clock = clock
    self.pool = pool
    self.buffer = buffer
    self.ready = ready
    self.group_size = group_size
    self.partial_rollout = partial_rollout
    self.partial_strategy = partial_strategy
    self.on_group_ready = on_group_ready
    self.latest = -1  # newest version the learner published (the weight channel)
    self.draining = False
    self.next_group_id = 0
    self.counts = {"interrupted": 0, "swaps": 0, "groups_started": 0}
    self.stopped = False
    pool.on_turn = self.turn
    pool.on_finished = pool.score
    pool.on_rewarded = self.put_all
    ready.on_refund = self.wake_idle

  # ---- the weight channel ---------------------------------------------------------------------
  def on_publish(self, version: int) -> None:
    first = self.latest < 0
    self.latest = version
    if first:  # _wait_for_first_weights: take them, open the first window
      for replica in self.pool.replicas:
        replica.version = version
      self.buffer.publish_version(version)
    for replica in self.pool.replicas:
      if not replica.device.busy:
        self.clock.at(self.clock.now, self.turn, replica)
      elif self.partial_rollout:
        self.pool.stop_at_boundary(replica)

  # ---- one turn of the loop -------------------------------------------------------------------
  def turn(self, replica: Replica) -> None:
    if self.stopped or replica.device.busy:
      return
    if self._maybe_swap(replica):
      return
    self._admit()
    if replica.active or (replica.pending and not self.draining):
      self.pool.step(replica, admit=not self.draining)

  def _maybe_swap(self, replica: Replica) -> bool:
    if self.latest <= replica.version:
      return False
    replicas = self.pool.replicas
    if not self.partial_rollout:
      if any(r.active for r in replicas):
        self.draining = True  # finish in-flight samples on the old weights first
        return False
      behind = [r for r in replicas if r.version < self.latest and not r.device.busy]
    else:
      behind = [replica]
    strategy = self.partial_strategy if self.partial_rollout else None
    for r in behind:
      self.counts["interrupted"] += self.pool.swap(r, self.latest, strategy,
                                                   lambda r=r: self._swapped(r))
    return True

  def _swapped(self, replica: Replica) -> None:
    version = replica.version
    if (all(r.version >= version for r in self.pool.replicas)
        and version > self.buffer.rollout_version):
      self.counts["swaps"] += 1
      self.draining = False
      self.buffer.publish_version(version)
      for other in self.pool.replicas:
        if other is not replica and not other.device.busy:
          self.clock.at(self.clock.now, self.turn, other)
    self.turn(replica)

  def _admit(self) -> None:
    if self.draining:
      return
    pool, buffer = self.pool, self.buffer
    room = pool.slots + self.group_size
    while True:
      replica = pool.least_loaded()
      if replica.load >= room or buffer.available_slots <= 0:
        return
      buffer.acquire_group_slot(timeout=NO_WAIT_S)
      replica.pending.extend(pool.new_group(self.next_group_id, self.group_size))
      self.next_group_id += 1
      self.counts["groups_started"] += 1
      if not replica.device.busy:
        self.clock.at(self.clock.now, self.turn, replica)
      elif len(replica.active) < pool.slots:
        pool.stop_at_boundary(replica)  # refill the free slots at the next step

  def put_all(self, samples: list[Sample]) -> None:
    if self.ready.put_many(samples, NO_WAIT_S, self.on_group_ready):
      self.wake_idle()

  def wake_idle(self) -> None:
    """A dropped group refunds its admission: an idle rollouter notices at its next poll."""
    if not self.draining and self.buffer.available_slots > 0:
      for replica in self.pool.replicas:
        if not replica.device.busy:
          self.clock.at(self.clock.now, self.turn, replica)


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

  def _get_groups(self, clock: Clock):
    groups = self.ready.take(self.groups_per_update, self.version)
    began = clock.now
    while groups is None:
      yield ("wait", "groups")
      groups = self.ready.take(self.groups_per_update, self.version)
    self.wait_s += clock.now - began
    return groups

  def run(self, clock: Clock):
    if self.latest_published < self.version:
      yield ("work", self.device, self.sync_s, "sync")
      self._publish(self.version)
    ready = None  # groups taken for this version before it was published
    while self.version < self.num_versions:
      consumed = []
      for local in range(self.trigger):
        groups, ready = (ready, None) if ready is not None else (
            (yield from self._get_groups(clock)), None)
        if self.debug_checks:
          check_staleness(groups, self.version, on_policy=self.on_policy,
                          max_version_gap=self.max_version_gap)
        yield ("work", self.device, self.update_s(groups, local), "learner")
        self.updates += 1
        consumed.extend(groups)
      self.version += 1
      # Groups already queued are taken at the new version before it is announced.
      if self.version < self.num_versions:
        ready = self.ready.take(self.groups_per_update, self.version)
      yield ("work", self.device, self.sync_s, "sync")
      self._publish(self.version)
      self.on_version(self.version, consumed, {"learner/wait_s": self.wait_s}, self.sync_s)
      if self.overhead_s and self.version < self.num_versions:
        yield ("work", self.device, self.overhead_s, "host")

  def _publish(self, version: int) -> None:
    self.latest_published = version
    self.publish(version)


def sync_loop(clock: Clock, *, pool: ReplicaPool, buffer: VersionedBuffer, ready: ReadyGroups,
              learner: Device, update_s: Callable[[list, int], float], sync_s: float,
              overhead_s: float, group_size: int, groups_per_update: int,
              trigger_parameter_sync_step: int, num_versions: int, state: dict,
              process: list, debug_checks: bool,
              on_version: Callable[[int, list, dict, float], None]):
  """`sync_loop.run_sync` on the virtual clock: each stage ends before the next begins."""
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

  pool.on_turn, pool.on_finished, pool.on_rewarded = on_turn, finished.extend, on_rewarded
  groups_per_version = groups_per_update * trigger_parameter_sync_step
  version, next_group = 0, 0
  for replica in pool.replicas:
    replica.version = version
  while version < num_versions:
    if overhead_s:
      yield ("work", learner, overhead_s, "host")
    for _ in range(groups_per_version):
      buffer.acquire_group_slot(timeout=NO_WAIT_S)
      pool.least_loaded().pending.extend(pool.new_group(next_group, group_size))
      next_group += 1
    for replica in pool.replicas:
      clock.at(clock.now, on_turn, replica)
    began = clock.now
    yield ("wait", "generated")
    state["generate_s"] = state.get("generate_s", 0.0) + clock.now - began
    pool.score(list(finished))
    yield ("wait", "scored")
    ready.put_many(scored, NO_WAIT_S)
    finished.clear()
    scored.clear()
    consumed = []
    for local in range(trigger_parameter_sync_step):
      # After drops a chunk may be short: it trains as it is.
      count = min(groups_per_update, ready.estimate)
      groups = ready.take(count, version) if count else None
      if not groups:
        break
      if debug_checks:
        check_staleness(groups, version, on_policy=True, max_version_gap=0)
      yield ("work", learner, update_s(groups, local), "learner")
      state["updates"] = state.get("updates", 0) + 1
      consumed.extend(groups)
    yield ("work", learner, sync_s, "sync")
    version += 1
    for replica in pool.replicas:
      replica.version = version
    buffer.publish_version(version)
    on_version(version, consumed, {}, sync_s)
