"""The Rollouter role: keeps the decode slots full and streams finished samples out.

One thread owns the engine's `ContinuousBatcher`. Each turn of its loop it
1. takes new weights from the weight channel when a newer version is there: with
   `partial_rollout` off it stops starting samples, lets the ones in flight finish on the old
   weights, then swaps; with it on it swaps at the next decode-step boundary and resumes the
   interrupted samples by `partial_strategy`;
2. admits new GRPO groups through the buffer's admission (`staleness_threshold`) while the slots
   have room, and submits their samples;
3. runs one decode step and hands every finished sample to the reward pool, whose workers put it
   into the buffer.
Whether to swap, drain, admit or step is decided by `rollout/decisions.py`, the same functions
the simulator's rollouter calls.

`pause()` stops it at a step boundary with no sample between roles (in the reward pool), so a
checkpoint can capture the buffer and the prompts in flight consistently.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from jaxrl_async.buffer import BufferClosed, BufferTimeout, VersionedBuffer
from jaxrl_async.metrics import RoleTimer
from jaxrl_async.roles import RoleThread
from jaxrl_async.rollout.decisions import (
  DRAIN,
  KEEP,
  admit_first,
  may_admit,
  on_new_version,
  resume_strategy,
  should_step,
)
from jaxrl_async.rollout.generation import ContinuousBatcher
from jaxrl_async.rollout.rewards import RewardPool
from jaxrl_async.sync.channel import WeightChannel
from jaxrl_async.tasks.base import Problem


class Rollouter(RoleThread):

  def __init__(self, *, batcher: ContinuousBatcher, prompts, rewards: RewardPool,
               buffer: VersionedBuffer, channel: WeightChannel, timer: RoleTimer,
               make_requests, group_size: int, partial_rollout: bool, partial_strategy: str,
               next_group_id: int = 0, reissue: list[dict] | None = None,
               put_timeout_s: float = 60.0, poll_s: float = 0.02):
    super().__init__("rollouter")
    self.batcher = batcher
    self.prompts = prompts
    self.rewards = rewards
    self.buffer = buffer
    self.channel = channel
    self.timer = timer
    self.make_requests = make_requests  # (problem, group_id, member indices) -> requests
    self.group_size = group_size
    self.partial_rollout = partial_rollout
    self.partial_strategy = partial_strategy
    self.next_group_id = next_group_id
    self.put_timeout_s = put_timeout_s
    self.poll_s = poll_s
    # Groups re-issued after a restore: (problem dict, group id, missing member indices).
    self._reissue = list(reissue or [])
    self._inflight: dict[int, dict[str, Any]] = {}  # group id -> problem + missing members
    self._lock = threading.Lock()
    # Pause handshake, one condition for both flags so a pause right after a resume is safe.
    self._pause_cv = threading.Condition()
    self._pause_requested = False
    self._paused = False
    self._rewarding = 0  # samples in the reward pool
    self._rewarding_cv = threading.Condition(self._lock)
    self.counts = {"interrupted": 0, "swaps": 0, "shutdown": 0, "groups_started": 0,
                   "swap_fetch_s": 0.0, "swap_load_s": 0.0}
    self._draining = False
    self._drop_log: list[tuple[str, list[tuple[int, int]]]] = []  # for the run's ledger

  # ---- pause / snapshot (for checkpoints and evaluation) -------------------------------------
  def pause(self, timeout: float = 60.0) -> None:
    """Stop at a step boundary and wait until no sample is in the reward pool."""
    with self._pause_cv:
      self._pause_requested = True
      self._pause_cv.notify_all()
      if not self._pause_cv.wait_for(lambda: self._paused, timeout):
        raise TimeoutError(f"rollouter did not pause within {timeout} s")
    with self._rewarding_cv:
      if not self._rewarding_cv.wait_for(lambda: self._rewarding == 0, timeout):
        raise TimeoutError(f"reward pool did not drain within {timeout} s")

  def resume(self) -> None:
    with self._pause_cv:
      self._pause_requested = False
      self._pause_cv.notify_all()

  def _honor_pause(self) -> None:
    with self._pause_cv:
      if not self._pause_requested:
        return
      self._paused = True
      self._pause_cv.notify_all()
      while self._pause_requested and not self._stop.is_set():
        self._pause_cv.wait(self.poll_s)
      self._paused = False

  def _mark_stopped(self) -> None:
    with self._pause_cv:
      self._paused = True  # a stopped rollouter is as good as paused for a snapshot
      self._pause_cv.notify_all()

  def snapshot(self) -> dict[str, Any]:
    """While paused: the groups in flight (to re-issue on restore) and the next group id."""
    with self._pause_cv:
      if not self._paused:
        raise RuntimeError("snapshot() needs pause() first")
    with self._lock:
      inflight = [{"problem": entry["problem"], "group_id": gid,
                   "missing": sorted(entry["missing"])}
                  for gid, entry in sorted(self._inflight.items())]
    return {"next_group_id": self.next_group_id, "inflight": inflight + self._reissue}

  # ---- the loop ------------------------------------------------------------------------------
  def run(self) -> None:
    self._wait_for_first_weights()
    while not self._stop.is_set():
      self._honor_pause()
      swapped = self._maybe_swap()
      if admit_first(swapped=swapped, active=self.batcher.num_active):
        self._admit()
      if should_step(active=self.batcher.num_active, pending=self.batcher.num_pending,
                     draining=self._draining):
        with self.timer.busy("rollout"):
          finished = self.batcher.step(admit=not self._draining)
        if finished:
          self._to_reward(finished)
      else:
        self._wait_for_work()

  def finish(self) -> None:
    try:
      self._shutdown_accounting()
    finally:
      self._mark_stopped()

  def _wait_for_first_weights(self) -> None:
    while not self._stop.is_set():
      if self.channel.wait_for_version(-1, timeout=self.poll_s) >= 0:
        version, params = self.channel.fetch()
        self.batcher.set_params(params, version)
        self.buffer.publish_version(version)
        return

  def _maybe_swap(self) -> bool:
    """Swaps to a newer version if the decisions say so; whether it did."""
    decision = on_new_version(self.channel.latest_version(), self.batcher.version,
                              partial_rollout=self.partial_rollout,
                              in_flight=self.batcher.num_active > 0)
    if decision == KEEP:
      return False
    if decision == DRAIN:
      self._draining = True  # finish in-flight samples on the old weights first
      return False
    began = time.perf_counter()
    version, params = self.channel.fetch()
    if version <= self.batcher.version:  # the load failed (counted by the channel): go on
      self._draining = False
      return False
    fetched = time.perf_counter()
    with self.timer.busy("rollout"):
      interrupted = self.batcher.set_params(
          params, version,
          partial_strategy=resume_strategy(self.partial_rollout, self.partial_strategy))
    self.counts["interrupted"] += interrupted
    self.counts["swaps"] += 1
    self.counts["swap_fetch_s"] += fetched - began  # the channel's copy onto this side
    self.counts["swap_load_s"] += time.perf_counter() - fetched  # load, resume in-flight samples
    self._draining = False
    self._hold_version(version)
    return True

  def _hold_version(self, version: int) -> None:
    """Tells the buffer this role now generates with `version` (opens its window)."""
    self.buffer.publish_version(version)

  def _admit(self) -> None:
    slots = self.batcher.engine.max_concurrent_decodes
    while may_admit(draining=self._draining, slots=slots, group_size=self.group_size,
                    load=self.batcher.num_active + self.batcher.num_pending):
      if not self._reissue and self.buffer.available_slots <= 0:
        return
      if self._reissue and self._reissue[0]["missing"] != list(range(self.group_size)):
        entry = self._reissue.pop(0)  # a partial group already holds its admission
      else:
        group_id = self._reissue[0]["group_id"] if self._reissue else self.next_group_id
        try:
          self.buffer.acquire_group_slot(timeout=1e-3, group_id=group_id)
        except BufferTimeout:
          return
        entry = self._reissue.pop(0) if self._reissue else None
      self._start_group(entry)

  def _start_group(self, entry: dict | None) -> None:
    if entry is None:
      problem = next(self.prompts)
      group_id, members = self.next_group_id, list(range(self.group_size))
      self.next_group_id += 1
    else:
      problem = Problem.from_dict(entry["problem"])
      group_id, members = entry["group_id"], list(entry["missing"])
    with self._lock:
      self._inflight[group_id] = {"problem": problem.to_dict(), "missing": set(members)}
    self.counts["groups_started"] += 1
    self.batcher.submit(self.make_requests(problem, group_id, members))

  def _wait_for_work(self) -> None:
    """Nothing to generate: block on admission or a new version, at most poll_s."""
    if self.buffer.available_slots > 0 or self._reissue:
      return
    self.channel.wait_for_version(self.batcher.version, timeout=self.poll_s)

  # ---- reward and hand-off -------------------------------------------------------------------
  def _to_reward(self, samples) -> None:
    """The samples finished by one step, scored in batches spread over the reward workers,
    then put into the buffer together (one put per step)."""
    samples = list(samples)
    with self._lock:
      self._rewarding += len(samples)
    self.rewards.submit_spread(samples).add_done_callback(
        lambda future: self._on_rewarded(future, samples))

  def _on_rewarded(self, future, samples) -> None:
    try:
      self._put_scored(future.result())
    except BaseException as error:  # the reward pool itself failed (shut down under us)
      if self._stop.is_set():
        self._count_shutdown(samples)
      else:
        self._fail(error)
    finally:
      with self._rewarding_cv:
        self._rewarding -= len(samples)
        self._rewarding_cv.notify_all()

  def _put_scored(self, samples) -> None:
    """Hands a scored batch to the buffer (here one call per sample)."""
    for sample in samples:
      self._put(sample)

  def _count_shutdown(self, samples) -> None:
    with self._lock:
      self.counts["shutdown"] += len(samples)
      self._drop_log.append(("shutdown", [sample.uid for sample in samples]))

  @property
  def rewarding(self) -> int:
    """How many samples are in the reward pool now."""
    with self._lock:
      return self._rewarding

  def wait_rewards(self, timeout: float) -> bool:
    """Waits until no sample is in the reward pool; False if some still are after `timeout`."""
    with self._rewarding_cv:
      return self._rewarding_cv.wait_for(lambda: self._rewarding == 0, timeout)

  def take_drop_log(self) -> list[tuple[str, list[tuple[int, int]]]]:
    """Samples this role dropped since the last call, as (reason, sample uids)."""
    with self._lock:
      log, self._drop_log = self._drop_log, []
    return log

  def _put(self, sample) -> None:
    try:
      self.buffer.put(sample, timeout=self.put_timeout_s)
      with self._lock:
        entry = self._inflight.get(sample.group_id)
        if entry is not None:
          entry["missing"].discard(int(sample.meta["index_in_group"]))
          if not entry["missing"]:
            del self._inflight[sample.group_id]
    except BufferClosed:
      self._count_shutdown([sample])
    except BaseException as error:  # a full buffer past its timeout is a role failure
      self._fail(error)

  def _fail(self, error: BaseException) -> None:
    if self.error is None:
      self.error = error
    self._stop.set()

  def _shutdown_accounting(self) -> None:
    """At the end: samples in the slots, waiting for a slot, or never re-issued are dropped
    under 'shutdown' (the prompts were produced, so the ledger must say where they went). The
    groups stay in `snapshot()`: a checkpoint after a stop re-issues them instead, and then the
    controller discards this log."""
    aborted = self.batcher.abort_active() + [r.sample for r in self.batcher.take_pending()]
    uids = [sample.uid for sample in aborted]
    uids += [(entry["group_id"], index) for entry in self._reissue for index in entry["missing"]]
    with self._lock:
      self.counts["shutdown"] += len(uids)
      if uids:
        self._drop_log.append(("shutdown", uids))
