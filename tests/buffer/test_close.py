"""close() and wake-ups: every blocked call returns on the event that unblocks it."""

from __future__ import annotations

import threading
import time

import pytest

from jaxrl_async.buffer import BufferClosed, BufferTimeout, VersionedBuffer, admission_budget

from .factory import make_sample


def test_close_wakes_every_blocked_call_within_one_second():
  buffer = VersionedBuffer(group_size=2, groups_per_version=2, staleness_threshold=0.0,
                           max_version_gap=None, capacity=4)
  buffer.acquire_group_slot(1.0)
  buffer.acquire_group_slot(1.0)
  buffer.put(make_sample(0, 0, 2), 1.0)  # admitted, partial
  buffer.put(make_sample(1, 0, 2), 1.0)  # admitted, partial
  buffer.put(make_sample(2, 0, 2), 1.0)  # unadmitted, partial
  buffer.put(make_sample(3, 0, 2), 1.0)  # unadmitted, partial: the buffer is full
  calls = {
      "put_full_a": lambda: buffer.put(make_sample(0, 1, 2), 30.0),
      "put_full_b": lambda: buffer.put(make_sample(4, 0, 2), 30.0),
      "acquire_a": lambda: buffer.acquire_group_slot(30.0),
      "acquire_b": lambda: buffer.acquire_group_slot(30.0),
      "get_a": lambda: buffer.get_groups(1, 0, 30.0),
      "get_b": lambda: buffer.get_groups(2, 0, 30.0),
  }
  outcome: dict[str, tuple[str, float]] = {}

  def call(name):
    try:
      calls[name]()
      outcome[name] = ("returned", time.monotonic())
    except BaseException as error:
      outcome[name] = (type(error).__name__, time.monotonic())

  threads = [threading.Thread(target=call, args=(name,), name=name) for name in calls]
  for thread in threads:
    thread.start()
  time.sleep(0.3)
  assert not outcome, f"calls returned before close: {outcome}"
  closed_at = time.monotonic()
  buffer.close()
  for thread in threads:
    thread.join(5.0)
  for name in calls:
    kind, when = outcome[name]
    assert kind == "BufferClosed", (name, kind)
    assert when - closed_at < 1.0, (name, when - closed_at)
  # Later calls fail too; queued samples stay until discarded under a reason.
  with pytest.raises(BufferClosed):
    buffer.put(make_sample(5, 0, 2), 1.0)
  with pytest.raises(BufferClosed):
    buffer.acquire_group_slot(1.0)
  with pytest.raises(BufferClosed):
    buffer.get_groups(1, 0, 1.0)
  with pytest.raises(BufferClosed):
    buffer.publish_version(1)
  assert buffer.closed and buffer.counts["queued"] == 4
  assert buffer.discard_queued("shutdown") == 4
  assert buffer.counts["dropped"]["shutdown"] == 4
  buffer.check_invariants()


def test_close_under_streaming_load():
  budget = admission_budget(0.5, 4)
  buffer = VersionedBuffer(group_size=4, groups_per_version=4, staleness_threshold=0.5,
                           max_version_gap=None, capacity=4 * budget)
  finished: dict[str, tuple[str, float]] = {}

  def producer(worker):
    group_id = worker * 10**6
    try:
      while True:
        version = buffer.acquire_group_slot(30.0)
        for index in range(4):
          buffer.put(make_sample(group_id, index, 4, (version,)), 30.0)
        group_id += 1
    except BaseException as error:
      finished[f"producer-{worker}"] = (type(error).__name__, time.monotonic())

  def consumer():
    try:
      while True:  # never publishes: producers end up blocked on admission
        buffer.get_groups(1, 0, 30.0)
    except BaseException as error:
      finished["consumer"] = (type(error).__name__, time.monotonic())

  threads = [threading.Thread(target=producer, args=(w,)) for w in range(3)]
  threads.append(threading.Thread(target=consumer))
  for thread in threads:
    thread.start()
  time.sleep(0.3)
  closed_at = time.monotonic()
  buffer.close()
  for thread in threads:
    thread.join(5.0)
  assert len(finished) == 4
  for name, (kind, when) in finished.items():
    assert kind == "BufferClosed", (name, kind)
    assert when - closed_at < 1.0, (name, when - closed_at)
  buffer.check_invariants()


def _call_in_thread(fn) -> tuple[threading.Thread, dict]:
  result: dict = {}

  def run():
    try:
      result["value"] = fn()
    except BaseException as error:
      result["error"] = error

  thread = threading.Thread(target=run, name="blocked-call")
  thread.start()
  return thread, result


def _assert_still_blocked(thread: threading.Thread, result: dict) -> None:
  thread.join(0.1)
  assert thread.is_alive() and not result, result


def _assert_woken(thread: threading.Thread, result: dict) -> None:
  # The call waits up to 30 s; returning well before that means the event woke it.
  thread.join(10.0)
  assert not thread.is_alive(), "a blocked call missed the event that unblocks it"
  assert "error" not in result, result.get("error")


def test_blocked_calls_are_woken_by_the_event_that_unblocks_them():
  buffer = VersionedBuffer(group_size=2, groups_per_version=1, staleness_threshold=1.0,
                           max_version_gap=0, capacity=4)
  # A consumer waiting for a group is woken when its last member arrives.
  consumer = _call_in_thread(lambda: buffer.get_groups(1, 0, 30.0))
  _assert_still_blocked(*consumer)
  buffer.acquire_group_slot(1.0)
  buffer.put(make_sample(0, 0, 2, (0,)), 1.0)
  _assert_still_blocked(*consumer)
  buffer.put(make_sample(0, 1, 2, (0,)), 1.0)
  _assert_woken(*consumer)
  # A producer waiting for admission is woken by a refund (a dropped group) ...
  buffer.acquire_group_slot(1.0)
  buffer.put(make_sample(1, 0, 2, (0,)), 1.0)  # budget 2: group 0 consumed + group 1
  producer = _call_in_thread(lambda: buffer.acquire_group_slot(30.0))
  _assert_still_blocked(*producer)
  buffer.put(make_sample(1, 1, 2, (0,), reward_status="failed"), 1.0)
  _assert_woken(*producer)
  # ... and by a new version.
  producer = _call_in_thread(lambda: buffer.acquire_group_slot(30.0))
  _assert_still_blocked(*producer)
  buffer.publish_version(1)
  _assert_woken(*producer)
  # A producer waiting for space is woken when a consumer frees it.
  buffer.put(make_sample(2, 0, 2, (1,)), 1.0)
  buffer.put(make_sample(2, 1, 2, (1,)), 1.0)  # ready
  buffer.put(make_sample(3, 0, 2, (1,)), 1.0)  # admitted
  buffer.put(make_sample(4, 0, 2, (1,)), 1.0)  # unadmitted: full
  producer = _call_in_thread(lambda: buffer.put(make_sample(5, 0, 2, (1,)), 30.0))
  _assert_still_blocked(*producer)
  buffer.get_groups(1, 1, 1.0)
  _assert_woken(*producer)
  # ... or when stale groups are dropped.
  buffer.put(make_sample(3, 1, 2, (1,)), 1.0)  # group 3 ready: full again
  producer = _call_in_thread(lambda: buffer.put(make_sample(6, 0, 2, (2,)), 30.0))
  _assert_still_blocked(*producer)
  with pytest.raises(BufferTimeout):
    buffer.get_groups(2, 2, 0.05)  # group 3 is stale for learner version 2
  _assert_woken(*producer)
  buffer.check_invariants()
