"""The BufferClient contract, run against the in-process buffer and the one served to another
process (over the real transport, 127.0.0.1): both must behave the same."""

import contextlib
import threading

import numpy as np
import pytest

from jaxrl_async.backends.processes.buffer_service import BufferService, RemoteBufferClient
from jaxrl_async.buffer import BufferClosed, BufferTimeout
from jaxrl_async.buffer.client import LocalBufferClient
from tests.buffer.factory import make_buffer, make_group

JOIN_S = 10.0


@pytest.fixture(params=["local", "remote"])
def make_client(request):
  """make(**buffer knobs) -> a BufferClient of a fresh buffer, of the parametrized kind."""
  opened = []

  def make(**overrides):
    buffer = make_buffer(**overrides)
    if request.param == "local":
      client = LocalBufferClient(buffer)
      opened.append((buffer, None, client))
      return client
    service = BufferService(buffer).start()
    client = RemoteBufferClient(service.address, service.authkey, "test", margin_s=5.0)
    opened.append((buffer, service, client))
    return client

  yield make
  for buffer, service, client in opened:
    buffer.close()
    client.disconnect()
    if service is not None:
      service.stop()


def in_thread(fn, *args, **kwargs):
  """Runs fn in a named thread; returns (thread, outcome dict with 'value' or 'error')."""
  outcome = {}

  def body():
    try:
      outcome["value"] = fn(*args, **kwargs)
    except BaseException as error:  # reported to the test
      outcome["error"] = error

  thread = threading.Thread(target=body, name="contract-caller", daemon=True)
  thread.start()
  return thread, outcome


def test_admission_takes_the_budget_then_blocks_until_a_new_version(make_client):
  client = make_client(group_size=2, groups_per_version=2, staleness_threshold=0.5)
  budget = 3  # floor((1 + 0.5) * 2)
  assert client.acquire_group_slots(10, 0) == budget
  assert client.acquire_group_slots(1, 0) == 0
  assert client.acquire_group_slots(1, 0.05) == 0  # waited, then gave up without raising
  thread, outcome = in_thread(client.acquire_group_slots, 2, 30.0)
  for group_id in range(budget):
    client.put_many(make_group(group_id, 2), timeout=5.0)
  client.get_groups(2, 0, timeout=5.0)
  assert thread.is_alive()  # consumed groups do not open a window; a version does
  client.publish_version(1)
  thread.join(JOIN_S)
  assert not thread.is_alive()
  # The new window is charged with the one group still queued: 2 of its 3 slots are free.
  assert outcome == {"value": 2}
  assert client.acquire_group_slots(1, 0) == 0


def test_an_ask_naming_a_newer_held_version_publishes_it_in_the_same_call(make_client):
  client = make_client(group_size=2, groups_per_version=2, staleness_threshold=0.5)
  client.publish_version(0)
  assert client.acquire_group_slots(10, 0, holding_version=0) == 3
  for group_id in range(3):
    client.put_many(make_group(group_id, 2), timeout=5.0)
  client.get_groups(2, 0, timeout=5.0)
  assert client.acquire_group_slots(2, 0, holding_version=0) == 0  # window 0 is spent
  # Version 1's window (3 slots, 1 charged to the group still queued) opens in this call.
  assert client.acquire_group_slots(5, 0, holding_version=1) == 2
  with pytest.raises(ValueError):
    client.publish_version(0)  # the ask published 1: the rollout version does not go back


def test_a_dropped_group_frees_its_admission_for_a_blocked_caller(make_client):
  client = make_client(group_size=2, groups_per_version=1, staleness_threshold=0.0)
  assert client.acquire_group_slots(1, 0) == 1
  thread, outcome = in_thread(client.acquire_group_slots, 1, 30.0)
  failed = make_group(0, 2)
  failed[1].reward_status, failed[1].reward = "failed", float("nan")
  client.put_many(failed, timeout=5.0)
  thread.join(JOIN_S)
  assert outcome == {"value": 1}
  assert client.counts()["dropped"]["reward_failed"] == 2


def test_only_whole_groups_are_returned_in_index_order(make_client):
  client = make_client(group_size=4, groups_per_version=2)
  assert client.acquire_group_slots(2, 0) == 2
  group = make_group(7, 4)
  client.put_many([group[3], group[1]], timeout=5.0)
  with pytest.raises(BufferTimeout):
    client.get_groups(1, 0, timeout=0.05)
  client.put_many([group[0], group[2]], timeout=5.0)
  (returned,) = client.get_groups(1, 0, timeout=5.0)
  assert [s.meta["index_in_group"] for s in returned] == [0, 1, 2, 3]
  assert {s.group_id for s in returned} == {7}
  assert all("consumed" in s.timestamps and "enqueued" in s.timestamps for s in returned)
  np.testing.assert_array_equal(returned[2].response_tokens, group[2].response_tokens)


def test_groups_older_than_the_gap_are_dropped_as_stale(make_client):
  client = make_client(group_size=2, groups_per_version=2, staleness_threshold=1.0,
                       max_version_gap=1)
  client.acquire_group_slots(2, 0)
  client.put_many(make_group(0, 2, version=0), timeout=5.0)
  client.put_many(make_group(1, 2, version=0), timeout=5.0)
  client.publish_version(2)
  client.acquire_group_slots(1, 0)
  client.put_many(make_group(2, 2, version=2), timeout=5.0)
  (group,) = client.get_groups(1, 2, timeout=5.0)  # gap 2 > 1 for groups 0 and 1
  assert group[0].group_id == 2
  counts = client.counts()
  assert counts["dropped"]["stale"] == 4
  assert client.metrics()["queue/dropped/stale"] == 4.0


def test_the_groups_an_ask_starts_name_their_admissions(make_client):
  """Group 80, admitted at version 1, starts after the swap to 2; group 81, admitted at 2, is
  still out. The starts name each admission's group, so 80's arrival retires its own and the
  take that closes version 2 (bound 1, 'wait') has nothing of version 1 to wait for
  (tests/buffer/test_version_gap_policy.py has the guess unnamed admissions fall back to)."""
  client = make_client(group_size=2, groups_per_version=1, staleness_threshold=1.0,
                       max_version_gap=1, version_gap_policy="wait")
  problem = {"prompt_id": 0}
  client.acquire_group_slots(1, 0, holding_version=1,
                             starts=[{"group_id": 80, "problem": problem, "missing": [0, 1]}])
  client.acquire_group_slots(1, 0, holding_version=2,
                             starts=[{"group_id": 81, "problem": problem, "missing": [0, 1]}])
  client.put_many(make_group(80, 2, version=2), timeout=5.0)
  (group,) = client.get_groups(1, 2, timeout=0.5)
  assert group[0].group_id == 80
  assert client.metrics()["queue/take_wait_s/age_bound"] == 0.0


def test_close_wakes_every_blocked_caller(make_client):
  client = make_client(group_size=2, groups_per_version=1)
  client.acquire_group_slots(1, 0)
  getter = in_thread(client.get_groups, 1, 0, 30.0)
  admitter = in_thread(client.acquire_group_slots, 1, 30.0)
  assert getter[0].is_alive() and admitter[0].is_alive()
  client.close()
  for thread, outcome in (getter, admitter):
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), BufferClosed), outcome
  with pytest.raises(BufferClosed):
    client.put_many(make_group(0, 2), timeout=1.0)
  with pytest.raises(BufferClosed):
    client.acquire_group_slots(1, 0)


def test_a_full_buffer_blocks_puts_until_timeout(make_client):
  client = make_client(group_size=2, groups_per_version=1, capacity=4)
  # Unadmitted partial groups fill the capacity (4 samples) and cannot complete.
  client.put_many([make_group(g, 2)[0] for g in range(4)], timeout=5.0)
  with pytest.raises(BufferTimeout):
    client.put_many([make_group(9, 2)[0]], timeout=0.05)
  assert client.counts()["queued"] == 4


def test_every_sample_put_is_consumed_dropped_or_queued(make_client):
  rng = np.random.default_rng(0)
  client = make_client(group_size=3, groups_per_version=4, staleness_threshold=1.0,
                       max_version_gap=1)
  consumed, group_id = 0, 0
  for version in range(6):
    admitted = client.acquire_group_slots(8, 0)
    for _ in range(admitted):
      group = make_group(group_id, 3, version=max(version - int(rng.integers(0, 3)), 0))
      if rng.random() < 0.3:
        group[int(rng.integers(0, 3))].reward_status = "timeout"
      client.put_many(group[:2] if rng.random() < 0.2 else group, timeout=5.0)
      group_id += 1
    with contextlib.suppress(BufferTimeout):
      consumed += 3 * len(client.get_groups(2, version, timeout=0.05))
    client.publish_version(version + 1)
  counts = client.counts()
  assert counts["consumed"] == consumed
  assert counts["put"] == counts["consumed"] + sum(counts["dropped"].values()) + counts["queued"]
  assert counts["dropped"]["reward_timeout"] > 0 and counts["queued"] > 0


def test_state_round_trip_continues_the_stream(make_client):
  client = make_client(group_size=2, groups_per_version=2)
  client.acquire_group_slots(2, 0)
  client.put_many(make_group(0, 2), timeout=5.0)
  client.put_many(make_group(1, 2)[:1], timeout=5.0)
  state = client.get_state()
  other = make_client(group_size=2, groups_per_version=2)
  other.set_state(state)
  assert other.counts()["queued"] == 3
  other.put_many(make_group(1, 2)[1:], timeout=5.0)
  groups = other.get_groups(2, 0, timeout=5.0)
  assert [g[0].group_id for g in groups] == [0, 1]


def test_bad_arguments_fail_naming_the_argument(make_client):
  client = make_client()
  with pytest.raises(ValueError, match="max_count"):
    client.acquire_group_slots(0, 0)
  with pytest.raises(ValueError, match="timeout"):
    client.acquire_group_slots(1, -1.0)
  with pytest.raises(ValueError, match="timeout"):
    client.put_many(make_group(0, 2), timeout=0)
  with pytest.raises(ValueError, match="version"):
    client.publish_version(-1)
  with pytest.raises(ValueError, match="num_groups"):
    client.get_groups(0, 0, timeout=1.0)
