"""The buffer service's bookkeeping for rollout servers: the groups each client started and has
not put (handed over when it is revoked), the prompt position, the version rule for several
servers; a producer in another process; both transports; a dead or silent service fails
clearly within a timeout."""

import json
import threading
import time

import numpy as np
import pytest

from jaxrl_async.backends.processes import child, wire
from jaxrl_async.backends.processes.buffer_service import (
  BufferService,
  ClientRevoked,
  RemoteBufferClient,
)
from jaxrl_async.buffer import BufferClosed
from tests.buffer.factory import make_buffer, make_group


@pytest.fixture
def service():
  buffer = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=1.0)
  made = BufferService(buffer).start()
  yield made
  buffer.close()
  made.stop()


def client(service, client_id):
  return RemoteBufferClient(service.address, service.authkey, client_id, margin_s=5.0)


def start(group_id, prompt_state=None):
  entry = {"problem": {"prompt_id": 100 + group_id}, "group_id": group_id, "missing": [0, 1]}
  if prompt_state is not None:
    entry.update(prompt_state=prompt_state, next_group_id=group_id + 1)
  return entry


def test_revoke_hands_over_exactly_the_unfinished_groups(service):
  producer = client(service, "a")
  starts = [start(0, {"next_index": 1}), start(1, {"next_index": 2}), start(2, {"next_index": 3})]
  assert producer.acquire_group_slots(3, 0, starts=starts) == 3
  group0, group1 = make_group(0, 2), make_group(1, 2)
  producer.put_many(group0, timeout=5.0)  # finished: not handed over
  producer.put_many(group1[1:], timeout=5.0)  # member 0 still missing
  orphan = service.revoke("a", timeout=10.0)
  assert [(e["group_id"], e["missing"]) for e in orphan["inflight"]] == [(1, [0]), (2, [0, 1])]
  assert all(e["admitted"] for e in orphan["inflight"])
  assert orphan["prompt_state"] == {"next_index": 3} and orphan["next_group_id"] == 3
  assert service.reissued == [1, 2]
  assert service.started == {0: 100, 1: 101, 2: 102}
  with pytest.raises(ClientRevoked):
    producer.put_many(group1[:1], timeout=5.0)
  # The successor puts the missing member; the group completes once.
  service.register("b", inflight=orphan["inflight"][:1])
  successor = client(service, "b")
  successor.put_many(group1[:1], timeout=5.0)
  assert service.tracked("b") == []
  assert [g[0].group_id for g in successor.get_groups(2, 0, timeout=5.0)] == [0, 1]
  producer.disconnect()
  successor.disconnect()


def test_only_admitted_starts_are_recorded(service):
  producer = client(service, "a")
  starts = [start(g, {"next_index": g + 1}) for g in range(6)]
  assert producer.acquire_group_slots(6, 0, starts=starts) == 4  # the budget: (1 + 1) * 2
  assert [e["group_id"] for e in service.tracked("a")] == [0, 1, 2, 3]
  assert service.revoke("a", timeout=10.0)["prompt_state"] == {"next_index": 4}
  producer.disconnect()


def test_the_window_follows_the_oldest_version_a_live_server_holds(service):
  first, second = client(service, "a"), client(service, "b")
  first.publish_version(0)
  second.publish_version(0)
  first.publish_version(2)
  assert service.buffer.rollout_version == 0  # b still holds version 0
  second.publish_version(1)
  assert service.buffer.rollout_version == 1
  service.revoke("b", timeout=10.0)  # a lost server no longer holds the window back
  assert service.buffer.rollout_version == 2
  first.disconnect()
  second.disconnect()


def test_a_producer_in_another_process(service, tmp_path):
  out = str(tmp_path / "produced.json")
  producer = child.spawn("tests.backends.children:produce_groups",
                         (service.address, service.authkey, 4, out), name="producer")
  try:
    consumer = client(service, "consumer")
    groups = consumer.get_groups(4, 0, timeout=120.0)
    producer.join(60.0)
    assert producer.exitcode == 0
  finally:
    child.reap(producer)
  assert sorted(g[0].group_id for g in groups) == [0, 1, 2, 3]
  assert all(len(g) == 2 for g in groups)
  with open(out, encoding="utf-8") as f:
    assert json.load(f) == {"admitted": 4}
  counts = service.buffer.counts
  assert counts["put"] == 8 == counts["consumed"]
  consumer.disconnect()


def test_a_stopped_service_fails_calls_clearly_within_a_timeout():
  buffer = make_buffer(group_size=2, groups_per_version=2)
  served = BufferService(buffer).start()
  producer = client(served, "a")
  assert producer.counts()["put"] == 0
  served.stop()
  started = time.monotonic()
  with pytest.raises(BufferClosed, match="gone"):
    producer.counts()  # the open connection was closed by the service
  with pytest.raises(BufferClosed, match="gone"):
    producer.counts()  # a new connection is refused
  assert time.monotonic() - started < 5.0
  producer.disconnect()


def test_a_silent_service_times_out_instead_of_hanging():
  release = threading.Event()

  def handler(method, args, kwargs):
    if method != "hello":
      release.wait(30.0)

  server = wire.Server(lambda conn: handler, b"key", name="silent")
  server.start()
  silent = RemoteBufferClient(server.address, b"key", "a", margin_s=0.2)
  started = time.monotonic()
  with pytest.raises(wire.ServiceTimeout, match="get_groups"):
    silent.get_groups(1, 0, timeout=0.1)
  assert time.monotonic() - started < 5.0
  release.set()
  silent.disconnect()
  server.stop()


@pytest.mark.parametrize("transport", ["columnar", "pickle"])
def test_both_transports_carry_samples_exactly(service, transport):
  producer = RemoteBufferClient(service.address, service.authkey, "a", margin_s=5.0,
                                transport=transport)
  assert producer.acquire_group_slots(1, 0) == 1
  group = make_group(0, 2)
  group[1].behaviour_logprobs[:] = [np.nan, -0.0]
  group[1].meta["answer"] = {"text": "42", "steps": [1, 2]}
  producer.put_many(group, timeout=5.0)
  (got,) = producer.get_groups(1, 0, timeout=5.0)
  for mine, theirs in zip(got, group, strict=True):
    assert mine.behaviour_logprobs.tobytes() == theirs.behaviour_logprobs.tobytes()
    assert mine.response_tokens.tolist() == theirs.response_tokens.tolist()
    assert mine.meta == theirs.meta and set(mine.timestamps) == {"enqueued", "consumed"}
  producer.disconnect()


def test_a_bad_transport_is_refused(service):
  with pytest.raises(ValueError, match="transport"):
    RemoteBufferClient(service.address, service.authkey, "a", transport="carrier-pigeon")
