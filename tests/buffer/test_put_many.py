"""`put_many` is a loop of `put`: the same admissions, drops, reasons, order and errors."""

from __future__ import annotations

import itertools
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.buffer.errors import BufferTimeout
from jaxrl_async.buffer.groups import drop_uniform_reward

from .factory import make_sample

GROUP_SIZE = 3

sample_spec = st.tuples(
    st.integers(0, 5),  # group id
    st.integers(0, GROUP_SIZE - 1),  # index in group (repeats give duplicate errors)
    st.sampled_from([("eos", "ok"), ("eos", "ok"), ("length", "ok"), ("aborted", "ok"),
                     ("eos", "failed"), ("eos", "timeout")]),
    st.integers(0, 3),  # token version
    st.sampled_from([0.0, 1.0]),  # reward
)
step = st.one_of(
    st.tuples(st.just("admit"), st.integers(1, 3)),
    st.tuples(st.just("put"), st.lists(sample_spec, min_size=1, max_size=8)),
    st.tuples(st.just("get"), st.integers(1, 2)),
    st.tuples(st.just("publish"), st.integers(0, 1)),
)


def _buffer(drop_truncated: bool, filtered: bool) -> VersionedBuffer:
  return VersionedBuffer(group_size=GROUP_SIZE, groups_per_version=2, staleness_threshold=1.0,
                         max_version_gap=1, capacity=GROUP_SIZE * 4,
                         group_filter=drop_uniform_reward if filtered else None,
                         drop_truncated=drop_truncated, clock=itertools.count().__next__,
                         record_drops=True)


def _samples(specs, offset: int):
  return [make_sample(group + offset, index, GROUP_SIZE, (version, version + 1),
                      reward=reward, finish_reason=finish, reward_status=status)
          for group, index, (finish, status), version, reward in specs]


def _error(exc: Exception) -> tuple[str, str]:
  return type(exc).__name__, str(exc).split(":")[0]


def _put_one_by_one(buffer: VersionedBuffer, samples) -> list:
  errors = []
  for sample in samples:
    try:
      buffer.put(sample, 1e-3)
    except (ValueError, BufferTimeout) as exc:
      errors.append(_error(exc))
  return errors


def _put_batched(buffer: VersionedBuffer, samples) -> list:
  errors, rest = [], list(samples)
  while rest:
    before = buffer.counts["put"]
    try:
      buffer.put_many(rest, 1e-3)
      rest = []
    except (ValueError, BufferTimeout) as exc:
      errors.append(_error(exc))
      assert exc.num_put == buffer.counts["put"] - before
      rest = rest[exc.num_put + 1:]  # the samples after the one that raised
  return errors


def _state(buffer: VersionedBuffer) -> tuple:
  buffer.check_invariants()
  metrics = {key: value for key, value in buffer.metrics().items()
             if not key.startswith("queue/take_wait_s/")}  # wall-clock seconds: not compared
  return buffer.counts, metrics, buffer.take_drop_log(), buffer.available_slots


@settings(max_examples=150, deadline=None)
@given(steps=st.lists(step, max_size=25), drop_truncated=st.booleans(),
       filtered=st.booleans())
def test_put_many_equals_a_loop_of_put(steps, drop_truncated, filtered):
  loop, batched = _buffer(drop_truncated, filtered), _buffer(drop_truncated, filtered)
  version = 0
  for number, (kind, arg) in enumerate(steps):
    if kind == "admit":
      for _ in range(arg):
        if loop.available_slots > 0:
          assert loop.acquire_group_slot(1.0) == batched.acquire_group_slot(1.0)
    elif kind == "put":
      offset = 10 * (number // 4)  # groups of a later step may be new ones
      assert (_put_one_by_one(loop, _samples(arg, offset))
              == _put_batched(batched, _samples(arg, offset)))
    elif kind == "get":
      results = []
      for buffer in (loop, batched):
        try:
          groups = buffer.get_groups(arg, version, 1e-3)
          results.append([[(s.uid, s.timestamps["enqueued"]) for s in g] for g in groups])
        except BufferTimeout:
          results.append(None)
      assert results[0] == results[1]
    else:
      version += arg
      loop.publish_version(version)
      batched.publish_version(version)
    assert _state(loop) == _state(batched)


def test_put_many_stops_at_the_first_bad_sample():
  buffer = _buffer(drop_truncated=False, filtered=False)
  good, duplicate, after = _samples([(0, 0, ("eos", "ok"), 0, 1.0)] * 2
                                    + [(1, 0, ("eos", "ok"), 0, 1.0)], 0)
  try:
    buffer.put_many([good, duplicate, after], 1.0)
  except ValueError as exc:
    assert "duplicate" in str(exc)
  else:
    raise AssertionError("a duplicate sample must raise")
  assert buffer.counts["put"] == 1 and buffer.counts["queued"] == 1


def test_one_deadline_bounds_the_whole_call_not_each_wait():
  """A full buffer frees one group's space after 2 s: the three samples after it go in, and
  the fourth waits only for what is left of the call's 3 s (per-sample waits would take 5 s;
  the bounds leave a second for a slow wake-up)."""
  buffer = _buffer(drop_truncated=False, filtered=False)
  full = _samples([(group, index, ("eos", "ok"), 0, float(index % 2))
                   for group in range(4) for index in range(GROUP_SIZE)], 0)
  buffer.put_many(full, 1.0)
  assert buffer.counts["queued"] == GROUP_SIZE * 4  # the capacity
  taker = threading.Timer(2.0, lambda: buffer.get_groups(1, 0, 5.0))
  taker.start()
  late = _samples([(group, 0, ("eos", "ok"), 0, 1.0) for group in range(4)], 10)
  start = time.monotonic()
  try:
    buffer.put_many(late, 3.0, one_deadline=True)
  except BufferTimeout as exc:
    elapsed = time.monotonic() - start
    assert exc.num_put == GROUP_SIZE
  else:
    raise AssertionError("the fourth sample has no space: the call must time out")
  finally:
    taker.join(10.0)
  assert 2.95 <= elapsed < 4.5, elapsed
  assert buffer.counts["put"] == 4 * GROUP_SIZE + GROUP_SIZE
