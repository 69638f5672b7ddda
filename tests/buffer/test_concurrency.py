"""Producer and consumer threads: nothing lost or duplicated, every bound holds (hypothesis)."""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
import time

import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from jaxrl_async.buffer import (
  BufferClosed,
  BufferTimeout,
  VersionedBuffer,
  admission_budget,
  drop_uniform_reward,
)
from jaxrl_async.types import DROP_REASONS, Sample

from .factory import expected_drop_reason, make_sample

JOIN_S = 60.0
STALL_S = 5.0
POLL_S = 0.02
# Thread interleavings do not replay, so shrinking a failing example would only repeat it.
NO_SHRINK = (Phase.explicit, Phase.reuse, Phase.generate)


@dataclasses.dataclass
class StreamConfig:
  seed: int
  num_groups: int
  producers: int
  consumers: int
  group_size: int = 4
  groups_per_version: int = 4
  staleness: float = 1.0
  max_version_gap: int | None = 1
  fail_prob: float = 0.0
  use_filter: bool = False
  drop_truncated: bool = False
  producer_sleep_ms: float = 0.0  # mean of occasional sleeps
  consumer_sleep_ms: float = 0.0
  multi_version_tokens: bool = True  # later tokens take the rollout version at put time
  sync_delay_ms: float = 0.0  # > 0: a sync thread publishes each new version after a delay


@dataclasses.dataclass
class StreamResult:
  put_groups: dict[int, list[Sample]]
  consumed: list[tuple[int, list[list[Sample]]]]  # (learner_version used, groups)
  buffer: VersionedBuffer
  max_outstanding_seen: int
  max_in_flight_seen: int


def _failure(rng: random.Random) -> dict:
  return rng.choice([{"finish_reason": "aborted"}, {"reward_status": "failed"},
                     {"reward_status": "timeout", "reward": float("nan")},
                     {"finish_reason": "length"}])


def run_stream(cfg: StreamConfig) -> StreamResult:
  """Producers acquire, build and put groups; consumers take groups, the learner publishes
  version v + 1 after N consumed groups; a monitor thread checks invariants meanwhile."""
  budget = admission_budget(cfg.staleness, cfg.groups_per_version)
  buffer = VersionedBuffer(
      group_size=cfg.group_size, groups_per_version=cfg.groups_per_version,
      staleness_threshold=cfg.staleness, max_version_gap=cfg.max_version_gap,
      capacity=cfg.group_size * budget,
      group_filter=drop_uniform_reward if cfg.use_filter else None,
      drop_truncated=cfg.drop_truncated)
  next_group = iter(range(cfg.num_groups))
  claim_lock = threading.Lock()
  learner_lock = threading.Lock()
  learner = {"version": 0, "in_version": 0}
  put_groups: dict[int, list[Sample]] = {}
  consumed: list[tuple[int, list[list[Sample]]]] = []
  done = threading.Event()
  errors: list[BaseException] = []
  seen = {"outstanding": 0, "in_flight": 0}
  to_publish: queue.Queue[int] = queue.Queue()

  def producer(worker: int) -> None:
    rng = random.Random(cfg.seed * 1000 + worker)
    while True:
      with claim_lock:
        group_id = next(next_group, None)
      if group_id is None:
        return
      while True:
        if done.is_set():
          return
        try:
          version = buffer.acquire_group_slot(POLL_S * 5)
          break
        except BufferTimeout:
          continue
      rewards = [float(rng.random() < 0.5) for _ in range(cfg.group_size)]
      order = list(range(cfg.group_size))
      rng.shuffle(order)
      samples = []
      for index in order:
        if cfg.producer_sleep_ms and rng.random() < 0.05:
          time.sleep(rng.expovariate(1.0 / cfg.producer_sleep_ms) / 1e3)
        late = buffer.rollout_version if cfg.multi_version_tokens else version
        kwargs = _failure(rng) if rng.random() < cfg.fail_prob else {}
        kwargs.setdefault("reward", rewards[index])
        sample = make_sample(group_id, index, cfg.group_size, (version, version, late), **kwargs)
        samples.append(sample)
        buffer.put(sample, JOIN_S)
      put_groups[group_id] = samples

  def consumer(worker: int) -> None:
    rng = random.Random(cfg.seed * 1000 + 500 + worker)
    while not done.is_set():
      with learner_lock:
        learner_version = learner["version"]
        # Chunks of the N groups of this version (a request beyond them could wait for groups
        # that admission only allows after the next publish).
        num_groups = min(rng.choice([1, 2, 3]), cfg.groups_per_version - learner["in_version"])
      try:
        groups = buffer.get_groups(num_groups, learner_version, POLL_S)
      except BufferTimeout:
        continue
      except BufferClosed:
        return
      consumed.append((learner_version, groups))
      with learner_lock:  # the learner publishes in order, after N consumed groups
        learner["in_version"] += len(groups)
        while learner["in_version"] >= cfg.groups_per_version:
          learner["in_version"] -= cfg.groups_per_version
          learner["version"] += 1
          if cfg.sync_delay_ms:
            to_publish.put(learner["version"])
          else:
            buffer.publish_version(learner["version"])
      if cfg.consumer_sleep_ms and rng.random() < 0.2:
        time.sleep(rng.expovariate(1.0 / cfg.consumer_sleep_ms) / 1e3)

  def sync() -> None:  # the weight transfer lags behind the learner
    rng = random.Random(cfg.seed * 1000 + 900)
    while not done.is_set():
      try:
        version = to_publish.get(timeout=POLL_S)
      except queue.Empty:
        continue
      time.sleep(rng.expovariate(1.0 / cfg.sync_delay_ms) / 1e3)
      try:
        buffer.publish_version(version)
      except BufferClosed:
        return

  def monitor() -> None:
    while not done.is_set():
      buffer.check_invariants()
      counts = buffer.counts
      live = (counts["admitted_groups"] - counts["consumed_groups"]
              - sum(counts["dropped_groups"].values()))
      assert live == counts["outstanding_groups"] <= budget, (live, counts, budget)
      assert counts["in_flight_groups"] <= cfg.producers, counts
      seen["outstanding"] = max(seen["outstanding"], live)
      seen["in_flight"] = max(seen["in_flight"], counts["in_flight_groups"])
      time.sleep(0.001)

  def guarded(fn, *args):
    try:
      fn(*args)
    except BaseException as error:  # surfaced in the main thread
      errors.append(error)
      done.set()

  threads = [threading.Thread(target=guarded, args=(producer, p), name=f"producer-{p}")
             for p in range(cfg.producers)]
  threads += [threading.Thread(target=guarded, args=(consumer, c), name=f"consumer-{c}")
              for c in range(cfg.consumers)]
  threads.append(threading.Thread(target=guarded, args=(monitor,), name="monitor"))
  if cfg.sync_delay_ms:
    threads.append(threading.Thread(target=guarded, args=(sync,), name="sync"))
  for thread in threads:
    thread.start()
  deadline = time.monotonic() + JOIN_S
  progress, progress_at = None, time.monotonic()
  while not done.is_set() and time.monotonic() < deadline:
    counts = buffer.counts
    finished = counts["consumed_groups"] + sum(counts["dropped_groups"].values())
    if finished == cfg.num_groups:
      break
    if (finished, counts["put"]) != progress:
      progress, progress_at = (finished, counts["put"]), time.monotonic()
    elif time.monotonic() - progress_at > STALL_S:
      errors.append(AssertionError(f"no progress for {STALL_S} s (deadlock?): {counts}, "
                                   f"{buffer.metrics()}"))
      break
    time.sleep(POLL_S)
  done.set()
  buffer.close()
  for thread in threads:
    thread.join(max(0.0, deadline - time.monotonic()))
    assert not thread.is_alive(), f"{thread.name} did not finish"
  if errors:
    raise errors[0]
  return StreamResult(put_groups, consumed, buffer, seen["outstanding"], seen["in_flight"])


def check_stream(cfg: StreamConfig, result: StreamResult) -> None:
  buffer = result.buffer
  assert len(result.put_groups) == cfg.num_groups
  consumed_uids = [sample.uid for _, groups in result.consumed for group in groups
                   for sample in group]
  assert len(consumed_uids) == len(set(consumed_uids)), "a sample was consumed twice"
  consumed_groups = set()
  for learner_version, groups in result.consumed:
    for group in groups:
      group_id = group[0].group_id
      assert [s.uid for s in group] == [(group_id, i) for i in range(cfg.group_size)]
      assert all(s is t for s, t in zip(group, sorted(result.put_groups[group_id],
                                                       key=lambda s: s.uid)))
      assert expected_drop_reason(group, cfg.drop_truncated) is None
      if cfg.use_filter:
        assert len({s.reward for s in group}) > 1
      if cfg.max_version_gap is not None:
        oldest = min(int(s.token_versions.min()) for s in group)
        assert learner_version - oldest <= cfg.max_version_gap
      for sample in group:
        assert sample.timestamps["consumed"] >= sample.timestamps["enqueued"]
      consumed_groups.add(group_id)
  # Every group that was not consumed is dropped under the reason the rules give.
  expected = dict.fromkeys(DROP_REASONS, 0)
  for group_id, samples in result.put_groups.items():
    if group_id in consumed_groups:
      continue
    reason = expected_drop_reason(samples, cfg.drop_truncated)
    if reason is None and cfg.use_filter and not drop_uniform_reward(samples):
      reason = "filtered_group"
    expected[reason or "stale"] += len(samples)
  counts = buffer.counts
  assert counts["dropped"] == expected
  assert counts["queued"] == 0 and counts["outstanding_groups"] == 0
  assert counts["put"] == cfg.num_groups * cfg.group_size
  assert counts["consumed"] == len(consumed_uids)
  assert counts["put"] == counts["consumed"] + sum(counts["dropped"].values()) + counts["queued"]
  assert counts["admitted_groups"] == cfg.num_groups
  assert counts["unadmitted_groups"] == 0
  if cfg.max_version_gap is None:
    assert expected["stale"] == 0
  buffer.check_invariants()


@settings(max_examples=5, deadline=None, derandomize=True, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), producers=st.integers(1, 4), consumers=st.integers(1, 2),
       staleness=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
       max_version_gap=st.sampled_from([None, 0, 1, 2]),
       fail_prob=st.sampled_from([0.0, 0.02, 0.1]), use_filter=st.booleans(),
       drop_truncated=st.booleans(), producer_sleep_ms=st.sampled_from([0.0, 0.5]),
       consumer_sleep_ms=st.sampled_from([0.0, 0.5, 2.0]),
       sync_delay_ms=st.sampled_from([0.0, 0.5]))
def test_stream_no_loss_no_duplicate_bounds_hold(seed, producers, consumers, staleness,
                                                 max_version_gap, fail_prob, use_filter,
                                                 drop_truncated, producer_sleep_ms,
                                                 consumer_sleep_ms, sync_delay_ms):
  # 5 examples x 5,000 groups x 4 samples = 100,000 samples.
  cfg = StreamConfig(seed=seed, num_groups=5000, producers=producers, consumers=consumers,
                     staleness=staleness, max_version_gap=max_version_gap, fail_prob=fail_prob,
                     use_filter=use_filter, drop_truncated=drop_truncated,
                     producer_sleep_ms=producer_sleep_ms, consumer_sleep_ms=consumer_sleep_ms,
                     sync_delay_ms=sync_delay_ms)
  result = run_stream(cfg)
  check_stream(cfg, result)
  assert result.max_outstanding_seen <= admission_budget(staleness, cfg.groups_per_version)


def test_stream_with_drops_of_every_kind():
  cfg = StreamConfig(seed=7, num_groups=1500, producers=3, consumers=2, staleness=2.0,
                     max_version_gap=1, fail_prob=0.05, use_filter=True, drop_truncated=True,
                     consumer_sleep_ms=1.0)
  result = run_stream(cfg)
  check_stream(cfg, result)
  dropped = result.buffer.counts["dropped"]
  for reason in ("stale", "reward_failed", "reward_timeout", "rollout_failed", "truncated",
                 "filtered_group"):
    assert dropped[reason] > 0, (reason, dropped)


@settings(max_examples=4, deadline=None, derandomize=True, phases=NO_SHRINK,
          suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), producers=st.integers(1, 4),
       producer_sleep_ms=st.sampled_from([0.0, 0.3, 2.0]),
       consumer_sleep_ms=st.sampled_from([0.0, 0.3, 2.0]), fail_prob=st.sampled_from([0.0, 0.1]),
       sync_delay_ms=st.sampled_from([0.0, 0.0, 1.0]))
def test_on_policy_gap_is_zero_whatever_the_speeds(seed, producers, producer_sleep_ms,
                                                   consumer_sleep_ms, fail_prob, sync_delay_ms):
  # No age bound: a violation would be consumed (and caught here), not dropped as stale.
  cfg = StreamConfig(seed=seed, num_groups=600, producers=producers, consumers=1,
                     groups_per_version=3, staleness=0.0, max_version_gap=None,
                     fail_prob=fail_prob, use_filter=True, producer_sleep_ms=producer_sleep_ms,
                     consumer_sleep_ms=consumer_sleep_ms, sync_delay_ms=sync_delay_ms)
  result = run_stream(cfg)
  check_stream(cfg, result)
  gaps = np.concatenate([learner_version - sample.token_versions
                         for learner_version, groups in result.consumed
                         for group in groups for sample in group])
  assert gaps.size and np.all(gaps == 0), np.unique(gaps)
  assert result.buffer.counts["dropped"]["stale"] == 0
