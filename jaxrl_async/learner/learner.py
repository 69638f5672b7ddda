"""The Learner role: consume groups from the buffer, update, publish a version every
`trigger_parameter_sync_step` local updates. The order of these steps is `learner_schedule`'s
(learner/schedule.py), shared with the simulator; this role performs them.

Every consumed batch is checked against the staleness bound before it is trained on: with
`staleness_threshold` = 0 every token's version gap must be 0, and no gap may exceed
`max_version_gap` (the buffer drops such groups; a violation here is a bug and stops the run).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import jax

from jaxrl_async import faults
from jaxrl_async.buffer import BufferClosed, BufferTimeout, VersionedBuffer
from jaxrl_async.learner.schedule import (
  Publish,
  Take,
  TakeReady,
  Trained,
  Update,
  VersionDone,
  drive,
  learner_schedule,
)
from jaxrl_async.metrics import RoleTimer, staleness_and_gaps, staleness_metrics, sum_pairs
from jaxrl_async.roles import RoleThread
from jaxrl_async.sync.channel import WeightChannel


class StalenessViolation(AssertionError):
  """A consumed token is older than the mode allows."""


def check_staleness(groups, learner_version: int, *, on_policy: bool,
                    max_version_gap: int | None) -> dict[str, float]:
  stats, gaps = staleness_and_gaps(groups, learner_version)
  gap = stats["algo/version_gap_max"]
  if on_policy and gap != 0:
    raise StalenessViolation(
        f"on-policy mode consumed a token with version gap {gap} at version {learner_version}")
  if max_version_gap is not None and gap > max_version_gap:
    raise StalenessViolation(
        f"consumed a token with version gap {gap} > max_version_gap={max_version_gap}")
  newest = learner_version - int(gaps.min()) if gaps.size else -1  # the newest token's version
  if newest > learner_version:
    raise StalenessViolation(
        f"consumed a token from version {newest}, newer than the learner's {learner_version}")
  return stats


class LearnerRole(RoleThread):
  """Runs in its own thread; `update_fn(state, groups, window_params, version, local)`."""

  def __init__(self, *, state, buffer: VersionedBuffer, channel: WeightChannel, timer: RoleTimer,
               update_fn: Callable, copy_params: Callable, groups_per_update: int,
               trigger_parameter_sync_step: int, num_versions: int, start_version: int,
               on_policy: bool, max_version_gap: int | None, needs_window_params: bool,
               on_version: Callable[[int, object, list, dict, dict], None],
               debug_checks: bool = True, poll_s: float = 0.05, taken: list | None = None):
    super().__init__("learner")
    self.state = state
    self.buffer = buffer
    self.channel = channel
    self.timer = timer
    self.update_fn = update_fn
    self.copy_params = copy_params
    self.groups_per_update = groups_per_update
    self.trigger = trigger_parameter_sync_step
    self.num_versions = num_versions
    self.version = start_version
    self.on_policy = on_policy
    self.max_version_gap = max_version_gap
    self.needs_window_params = needs_window_params
    self.on_version = on_version  # (version, state, groups, metrics, staleness) after publish
    self.debug_checks = debug_checks
    self.poll_s = poll_s
    self.wait_s = 0.0  # time blocked on the buffer
    self.published_at: dict[int, float] = {}  # version -> when its publish began
    self.done = threading.Event()
    # Groups taken from the buffer and not trained on yet (the next update's, taken before a
    # version is published). They have left the buffer, so a checkpoint must save them: see
    # `taken_groups`. A restored run passes them back here; they are trained first.
    self.taken: list | None = list(taken) if taken else None
    self.window_groups: list = []  # trained in the current, unfinished version window
    self._window_params = None  # the params at the start of the version window, if needed
    self._accumulated: dict = {}  # the window's metric sums

  def _get_groups(self):
    began = time.perf_counter()
    try:
      while not self._stop.is_set():
        try:
          return self.buffer.get_groups(self.groups_per_update, self.version,
                                        timeout=self.poll_s)
        except BufferTimeout:
          continue
      return None
    finally:
      self.wait_s += time.perf_counter() - began

  def finish(self) -> None:
    self.done.set()

  def _take_ready_groups(self):
    """The next update's groups if they are already queued (never blocks, never raises for a
    closed buffer: the version just trained must still be published and recorded)."""
    try:
      return self.buffer.get_groups(self.groups_per_update, self.version, timeout=1e-6)
    except (BufferTimeout, BufferClosed):
      return None

  @property
  def stopping(self) -> bool:
    return self._stop.is_set()

  def _publish(self, version: int) -> None:
    faults.point("sync.publish")
    began = time.time()  # wall clock: samples carry wall-clock stamps
    with self.timer.busy("sync"):
      self.channel.publish(version, self.state.params)
    self.published_at[version] = began

  def run(self) -> None:
    """Performs `learner_schedule`'s effects: the control flow lives there, the buffer,
    update, channel, stop handling and fault points here."""
    drive(learner_schedule(start_version=self.version, num_versions=self.num_versions,
                           trigger=self.trigger, taken=self.taken,
                           published=self.channel.latest_version()), self._perform)

  def _perform(self, effect):
    match effect:
      case Take():
        return self._get_groups()
      case Update(groups=groups, version=version, local=local):
        self._update(groups, version, local)
      case Trained(version=version):
        self.version = version
        self._window_params = None  # the window's updates are done: free the copy
        faults.point("learner.trained")
        self.window_groups = []
      case TakeReady():
        # A stop takes nothing more; the version just trained is still published.
        self.taken = None if self._stop.is_set() else self._take_ready_groups()
        return self.taken
      case Publish(version=version, start=start):
        if not start:
          faults.point("learner.take_publish")
        self._publish(version)
      case VersionDone(version=version, consumed=consumed):
        self.on_version(version, self.state, consumed, self._accumulated,
                        staleness_metrics(consumed, version - 1))
    return None

  def _update(self, groups, version: int, local: int) -> None:
    if local == 0:  # a version window opens
      self._window_params = (self.copy_params(self.state.params) if self.needs_window_params
                             else None)
      self._accumulated = {}
      self.window_groups = []
    if self.debug_checks:
      check_staleness(groups, version, on_policy=self.on_policy,
                      max_version_gap=self.max_version_gap)
    with self.timer.busy("learner"):
      self.state, metrics = self.update_fn(self.state, groups, self._window_params, version,
                                           local)
      self._accumulated = sum_pairs(self._accumulated, jax.device_get(metrics))
    self.taken = None  # trained: the state now holds them
    self.window_groups.extend(groups)
