"""The rollout side on the virtual clock, against the real `VersionedBuffer`.

- `Process` runs a generator of work and waits on the clock (the learner's and the sync loop's
  drivers, `sim/drivers.py`).
- `ReadyGroups` puts samples into the buffer and says when `get_groups` should find groups.
- `SimRollouter` makes the decisions of `rollout/rollouter.py` with the same functions
  (`rollout/decisions.py`): on a newer published version, with `partial_rollout` off it drains,
  then swaps; with it on it swaps at the next step boundary and resumes the interrupted samples.
  It admits groups through the buffer (`available_slots`, `acquire_group_slot`) while a replica
  has room, and puts every scored sample into the buffer. All replicas swap to a version before
  the buffer is told the rollout side holds it (`publish_version`), so a group admitted in
  window v is generated with weights >= v.

The buffer is called only with non-blocking arguments: admission when `available_slots > 0`,
puts of admitted groups (which never fill it), and `get_groups` with a tiny timeout when the
groups should be ready (`BufferTimeout` otherwise: nothing taken).
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from jaxrl_async.buffer import BufferTimeout, VersionedBuffer
from jaxrl_async.rollout.decisions import (
  DRAIN,
  KEEP,
  admit_first,
  may_admit,
  on_new_version,
  resume_strategy,
  should_step,
)
from jaxrl_async.sim.clock import Clock
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
  def turn(self, replica: Replica, swapped: bool = False) -> None:
    """One pass of the live loop: swap, admit, step. `swapped`: the turn that follows a swap."""
    if self.stopped or replica.device.busy:
      return
    if self._maybe_swap(replica):
      return
    if admit_first(swapped=swapped, active=len(replica.active)):
      self._admit()
    if should_step(active=len(replica.active), pending=len(replica.pending),
                   draining=self.draining):
      self.pool.step(replica, admit=not self.draining)

  def _maybe_swap(self, replica: Replica) -> bool:
    replicas = self.pool.replicas
    decision = on_new_version(self.latest, replica.version, partial_rollout=self.partial_rollout,
                              in_flight=any(r.active for r in replicas))
    if decision == KEEP:
      return False
    if decision == DRAIN:
      self.draining = True  # finish in-flight samples on the old weights first
      return False
    if self.partial_rollout:  # this replica swaps at its step boundary
      behind = [replica]
    else:  # the slots are empty: every idle replica behind swaps now
      behind = [r for r in replicas if r.version < self.latest and not r.device.busy]
    strategy = resume_strategy(self.partial_rollout, self.partial_strategy)
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
    self.turn(replica, swapped=True)

  def _admit(self) -> None:
    pool, buffer = self.pool, self.buffer
    while True:
      replica = pool.least_loaded()
      if not may_admit(draining=self.draining, load=replica.load, slots=pool.slots,
                       group_size=self.group_size) or buffer.available_slots <= 0:
        return
      buffer.acquire_group_slot(timeout=NO_WAIT_S, group_id=self.next_group_id)
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
