"""The Learner role: the staleness check on hand-made samples, and the role thread driven with a
real VersionedBuffer and DeviceTransferChannel and a counting update function (no model)."""

import threading
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.buffer import BufferClosed, BufferTimeout, VersionedBuffer, admission_budget
from jaxrl_async.learner.learner import LearnerRole, StalenessViolation, check_staleness
from jaxrl_async.metrics import RoleTimer
from jaxrl_async.sync.channel import DeviceTransferChannel
from jaxrl_async.types import Sample

GROUP_SIZE = 2
JOIN_S = 30.0


def make_sample(group_id: int, index: int, token_versions, group_size: int = GROUP_SIZE):
  n = len(token_versions)
  return Sample(prompt_id=group_id, group_id=group_id, group_size=group_size,
                prompt_tokens=np.array([1, 5, 6, 4], np.int32),
                response_tokens=np.arange(n, dtype=np.int32) + 5,
                behaviour_logprobs=np.full((n,), -0.5, np.float32),
                token_versions=np.asarray(token_versions, np.int32), finish_reason="eos",
                reward=float(index % 2), reward_status="ok", meta={"index_in_group": index})


def make_group(group_id: int, *member_versions, group_size: int = GROUP_SIZE):
  """One group; member i has token versions member_versions[i] (default: all members alike)."""
  if len(member_versions) == 1:
    member_versions = member_versions * group_size
  return [make_sample(group_id, i, versions, group_size)
          for i, versions in enumerate(member_versions)]


# ---- check_staleness ----------------------------------------------------------------------
def test_gap_zero_passes_in_on_policy_mode():
  groups = [make_group(0, (3, 3, 3)), make_group(1, (3,))]
  stats = check_staleness(groups, 3, on_policy=True, max_version_gap=None)
  assert stats["algo/version_gap_max"] == 0
  assert stats["algo/version_gap_mean"] == 0
  assert stats["algo/stale_ratio"] == 0
  assert stats["algo/partial_ratio"] == 0


@pytest.mark.parametrize("max_version_gap", [None, 0, 1, 5])
def test_gap_one_raises_in_on_policy_mode(max_version_gap):
  groups = [make_group(0, (3, 3)), make_group(1, (3, 3), (2, 3))]  # one token of gap 1
  with pytest.raises(StalenessViolation, match="gap 1"):
    check_staleness(groups, 3, on_policy=True, max_version_gap=max_version_gap)


def test_gaps_up_to_max_version_gap_pass_off_policy():
  # Tokens at versions 1, 2, 3 under learner version 3: gaps 2, 1, 0.
  groups = [make_group(0, (1, 2), (3, 3))]
  stats = check_staleness(groups, 3, on_policy=False, max_version_gap=2)
  assert stats["algo/version_gap_max"] == 2
  assert stats["algo/version_gap_mean"] == pytest.approx((2 + 1 + 0 + 0) / 4)
  assert stats["algo/stale_ratio"] == pytest.approx(2 / 4)
  assert stats["algo/partial_ratio"] == pytest.approx(1 / 2)  # member 0 spans versions 1..2
  assert stats["algo/max_partial_span"] == 1


def test_gap_beyond_max_version_gap_raises():
  groups = [make_group(0, (3, 3)), make_group(1, (0, 3), (3, 3))]  # gap 3
  with pytest.raises(StalenessViolation, match="max_version_gap=2"):
    check_staleness(groups, 3, on_policy=False, max_version_gap=2)
  stats = check_staleness(groups, 3, on_policy=False, max_version_gap=None)  # no bound
  assert stats["algo/version_gap_max"] == 3


@pytest.mark.parametrize("on_policy", [True, False])
def test_tokens_from_a_future_version_raise(on_policy):
  groups = [make_group(0, (4, 4))]
  with pytest.raises(StalenessViolation):
    check_staleness(groups, 3, on_policy=on_policy, max_version_gap=None)


@pytest.mark.parametrize("on_policy", [True, False])
def test_a_future_token_among_current_ones_raises(on_policy):
  groups = [make_group(0, (3, 3)), make_group(1, (3, 3), (3, 4))]  # one token of version 4
  with pytest.raises(StalenessViolation):
    check_staleness(groups, 3, on_policy=on_policy, max_version_gap=None)


# ---- the role thread -----------------------------------------------------------------------
class State(NamedTuple):
  step: int
  params: dict


class CountingUpdate:
  """update_fn(state, groups, window_params, version, local): adds 1 to every parameter."""

  def __init__(self):
    self.calls = []

  def __call__(self, state, groups, window_params, version, local):
    self.calls.append({"version": version, "local": local,
                       "group_ids": [g[0].group_id for g in groups],
                       "window": None if window_params is None else float(
                           window_params["w"][0])})
    params = jax.tree.map(lambda x: x + 1.0, state.params)
    return State(state.step + 1, params), {"groups": (np.float32(len(groups)), np.float32(1))}


class OnPolicyProducer:
  """Stands in for the rollouter: publishes each new weight version to the buffer, then admits
  and puts whole groups whose tokens carry the admitted version."""

  def __init__(self, buffer: VersionedBuffer, channel: DeviceTransferChannel):
    self.buffer, self.channel = buffer, channel
    self.stop = threading.Event()
    self.error = None
    self.groups_put = 0
    self._thread = threading.Thread(target=self._run, name="test-producer", daemon=True)

  def start(self):
    self._thread.start()

  def join(self, timeout):
    self.stop.set()
    self._thread.join(timeout)
    assert not self._thread.is_alive()

  def _run(self):
    version = -1
    try:
      while not self.stop.is_set():
        latest = self.channel.wait_for_version(version, timeout=0.02)
        if latest > version:
          version = latest
          self.buffer.publish_version(version)
        try:
          admitted_version = self.buffer.acquire_group_slot(timeout=0.02)
        except BufferTimeout:
          continue
        for sample in make_group(self.groups_put, (admitted_version,) * 3):
          self.buffer.put(sample, timeout=5.0)
        self.groups_put += 1
    except BufferClosed:
      pass
    except BaseException as error:  # surfaced by the test
      self.error = error


def make_role(buffer, channel, update, *, groups_per_update, trigger, num_versions,
              start_version=0, on_policy=True, max_version_gap=None, needs_window_params=False):
  published = []
  role = LearnerRole(
      state=State(0, {"w": jnp.zeros((3,), jnp.float32)}), buffer=buffer, channel=channel,
      timer=RoleTimer(), update_fn=update,
      copy_params=lambda p: jax.tree.map(lambda x: x.copy(), p),
      groups_per_update=groups_per_update, trigger_parameter_sync_step=trigger,
      num_versions=num_versions, start_version=start_version, on_policy=on_policy,
      max_version_gap=max_version_gap, needs_window_params=needs_window_params,
      on_version=lambda *args: published.append(args), poll_s=0.02)
  return role, published


def run_role_to_completion(role, buffer, producer):
  """Start the role, wait until it has published every version, then stop everything."""
  role.start()
  try:
    assert role.done.wait(JOIN_S), "the learner did not finish"
  finally:
    role.stop()
    buffer.close()
    role.join(JOIN_S)
    producer.join(JOIN_S)
  assert role.error is None, role.error
  assert producer.error is None, producer.error


def make_buffer(groups_per_version: int, staleness_threshold: float = 0.0, max_version_gap=None):
  budget = admission_budget(staleness_threshold, groups_per_version)
  return VersionedBuffer(group_size=GROUP_SIZE, groups_per_version=groups_per_version,
                         staleness_threshold=staleness_threshold,
                         max_version_gap=max_version_gap, capacity=GROUP_SIZE * budget)


@pytest.mark.parametrize("groups_per_update, trigger", [(1, 1), (2, 1), (1, 3), (2, 2)])
def test_role_publishes_each_version_after_trigger_updates(groups_per_update, trigger):
  num_versions = 3
  groups_per_version = groups_per_update * trigger
  buffer = make_buffer(groups_per_version)
  channel = DeviceTransferChannel(logical_axes=None)
  update = CountingUpdate()
  role, published = make_role(buffer, channel, update, groups_per_update=groups_per_update,
                              trigger=trigger, num_versions=num_versions,
                              needs_window_params=True)
  producer = OnPolicyProducer(buffer, channel)
  producer.start()
  run_role_to_completion(role, buffer, producer)
  # Updates: `trigger` per version, each on `groups_per_update` groups, in version order.
  assert [(c["version"], c["local"]) for c in update.calls] == [
      (v, local) for v in range(num_versions) for local in range(trigger)]
  assert all(len(c["group_ids"]) == groups_per_update for c in update.calls)
  consumed_ids = [gid for c in update.calls for gid in c["group_ids"]]
  assert len(set(consumed_ids)) == len(consumed_ids) == num_versions * groups_per_version
  assert buffer.counts["consumed_groups"] == num_versions * groups_per_version
  # The window params are those at the start of the version window (each update adds 1).
  assert [c["window"] for c in update.calls] == [
      float(v * trigger) for v in range(num_versions) for _ in range(trigger)]
  # Versions: the start version once, then exactly num_versions new ones.
  assert role.version == num_versions
  assert channel.latest_version() == num_versions
  assert channel.metrics()["sync/publishes"] == num_versions + 1
  version, params = channel.fetch()
  assert version == num_versions
  np.testing.assert_array_equal(params["w"], np.full((3,), num_versions * trigger, np.float32))
  assert [p[0] for p in published] == list(range(1, num_versions + 1))
  for at_version, state, groups, accumulated, staleness in published:
    assert state.step == at_version * trigger
    assert len(groups) == groups_per_version
    assert accumulated["groups"] == (groups_per_version, trigger)  # (sum, count) pairs
    assert staleness["algo/version_gap_max"] == 0


def test_role_resumes_from_its_start_version():
  buffer = make_buffer(1)
  channel = DeviceTransferChannel(logical_axes=None)
  update = CountingUpdate()
  role, published = make_role(buffer, channel, update, groups_per_update=1, trigger=1,
                              num_versions=5, start_version=3)
  producer = OnPolicyProducer(buffer, channel)
  producer.start()
  run_role_to_completion(role, buffer, producer)
  assert [c["version"] for c in update.calls] == [3, 4]
  assert [p[0] for p in published] == [4, 5]
  assert channel.metrics()["sync/publishes"] == 3  # 3 (the start), 4, 5


def test_stop_ends_a_role_blocked_on_an_empty_buffer():
  buffer = make_buffer(2)
  channel = DeviceTransferChannel(logical_axes=None)
  update = CountingUpdate()
  role, published = make_role(buffer, channel, update, groups_per_update=2, trigger=1,
                              num_versions=3)
  role.start()
  try:
    assert channel.wait_for_version(-1, timeout=JOIN_S) == 0  # it published, now it waits
    time.sleep(0.2)
    assert role.alive and not role.done.is_set()
    role.stop()
    role.join(2.0)  # raises TimeoutError if it did not stop within 2 s
  finally:
    buffer.close()
  assert role.done.is_set()
  assert role.error is None
  assert update.calls == [] and published == []
  assert role.version == 0


def test_closing_the_buffer_ends_a_blocked_role_cleanly():
  buffer = make_buffer(2)
  channel = DeviceTransferChannel(logical_axes=None)
  role, _ = make_role(buffer, channel, CountingUpdate(), groups_per_update=2, trigger=1,
                      num_versions=3)
  role.start()
  assert channel.wait_for_version(-1, timeout=JOIN_S) == 0
  buffer.close()
  role.join(2.0)
  assert role.done.is_set()
  assert role.error is None


def test_a_stale_batch_stops_the_role_with_a_staleness_violation():
  # Groups of version 0 put without admission reach a learner at version 1 in on-policy mode.
  buffer = make_buffer(1)
  channel = DeviceTransferChannel(logical_axes=None)
  update = CountingUpdate()
  role, published = make_role(buffer, channel, update, groups_per_update=1, trigger=1,
                              num_versions=3, start_version=1)
  for sample in make_group(0, (0, 0)):
    buffer.put(sample, timeout=1.0)
  role.start()
  try:
    assert role.done.wait(JOIN_S)
  finally:
    buffer.close()
    role.join(JOIN_S)
  assert isinstance(role.error, StalenessViolation)
  assert update.calls == [] and published == []  # never trained on the stale batch


def test_queued_groups_are_taken_before_the_next_version_is_announced():
  """A group already queued when version v+1 is ready is taken at v+1 before the announcement,
  so the rollouter's next admission window does not count it as carried over."""
  buffer = make_buffer(groups_per_version=1, staleness_threshold=1.0, max_version_gap=1)
  for group_id in range(2):  # two groups of version 0 queued before the learner starts
    buffer.acquire_group_slot(timeout=1.0)
    for sample in make_group(group_id, (0, 0, 0)):
      buffer.put(sample, timeout=1.0)
  channel = DeviceTransferChannel(logical_axes=None)
  consumed_at_publish = []
  publish = channel.publish

  def recording_publish(version, params):
    consumed_at_publish.append((version, buffer.counts["consumed"]))
    publish(version, params)

  channel.publish = recording_publish
  update = CountingUpdate()
  role, published = make_role(buffer, channel, update, groups_per_update=1, trigger=1,
                              num_versions=2, on_policy=False, max_version_gap=1)
  role.start()
  role.join(10.0)
  assert role.error is None
  assert [(c["version"], c["group_ids"]) for c in update.calls] == [(0, [0]), (1, [1])]
  # Version 1 was announced after group 1 had been taken (both samples' groups consumed).
  assert consumed_at_publish == [(0, 0), (1, 2 * GROUP_SIZE), (2, 2 * GROUP_SIZE)]
  assert [p[0] for p in published] == [1, 2]


def test_groups_taken_before_a_stop_are_trained_and_recorded():
  """Ctrl-C between taking the next version's groups and training them: they have left the
  buffer, so the role trains on them and records that version before it stops."""
  buffer = make_buffer(1, staleness_threshold=1.0)  # two groups may be queued at once
  buffer.publish_version(0)
  for group_id in range(2):
    buffer.acquire_group_slot(timeout=1.0)
    for sample in make_group(group_id, (0, 0)):
      buffer.put(sample, timeout=1.0)
  channel = DeviceTransferChannel(logical_axes=None)
  update = CountingUpdate()
  role, published = make_role(buffer, channel, update, groups_per_update=1, trigger=1,
                              num_versions=5, on_policy=False, max_version_gap=2)

  def on_version(version, *rest):
    published.append((version, *rest))
    if version == 1:  # group 1 was taken for version 1 just before version 1 was announced
      role.stop()
  role.on_version = on_version
  role.start()
  role.join(JOIN_S)
  assert role.error is None, role.error
  assert [call["group_ids"] for call in update.calls] == [[0], [1]]
  assert [p[0] for p in published] == [1, 2]
  assert buffer.counts["consumed"] == 2 * GROUP_SIZE
  buffer.check_invariants()
