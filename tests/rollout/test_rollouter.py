"""The Rollouter role with real parts: engine and continuous batcher (tiny random model), a
VersionedBuffer, a DeviceTransferChannel and a RewardPool. Admission at s = 0, pause / resume /
snapshot, stop and shutdown accounting."""

import collections
import time

import pytest

from jaxrl_async.buffer import VersionedBuffer, admission_budget
from jaxrl_async.metrics import RoleTimer
from jaxrl_async.model import get_config, init_model, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import ContinuousBatcher
from jaxrl_async.rollout.rewards import RewardPool
from jaxrl_async.rollout.rollouter import Rollouter
from jaxrl_async.run.build import make_group_requests
from jaxrl_async.sync.channel import DeviceTransferChannel
from jaxrl_async.tasks import prompts as prompts_lib
from jaxrl_async.tasks.base import Problem
from jaxrl_async.tasks.reverse import DigitReverseTask

# Longer strings, few slots: the random model's responses (mostly run to the length limit) keep
# the slots busy for many decode steps, so work is in flight when the tests pause or stop.
TASK = DigitReverseTask(0, max_len=16)
SLOTS = 2
GROUP_SIZE = 4
GROUPS_PER_VERSION = 2
SEED = 0
WAIT_S = 60.0


@pytest.fixture(scope="module")
def model():
  config = get_config("tiny", vocab_size=TASK.tokenizer.vocab_size,
                      max_seq_len=TASK.max_sequence_len)
  graphdef, params = split_model(init_model(config, seed=0))
  _, other_params = split_model(init_model(config, seed=1))
  engine = Engine(graphdef, config, max_concurrent_decodes=SLOTS,
                  max_prefill_length=TASK.max_sequence_len)
  return engine, params, other_params


class Harness:
  """A Rollouter wired to real parts; `close()` stops everything it started."""

  def __init__(self, engine, staleness_threshold: float):
    budget = admission_budget(staleness_threshold, GROUPS_PER_VERSION)
    self.buffer = VersionedBuffer(group_size=GROUP_SIZE, groups_per_version=GROUPS_PER_VERSION,
                                  staleness_threshold=staleness_threshold,
                                  max_version_gap=None, capacity=GROUP_SIZE * budget)
    self.channel = DeviceTransferChannel(logical_axes=None)
    self.rewards = RewardPool(TASK.reward, num_workers=2, timeout_s=10.0)
    self.rollouter = Rollouter(
        batcher=ContinuousBatcher(engine, eos_id=TASK.tokenizer.eos_id,
                                  max_response_len=TASK.max_response_len),
        prompts=iter(prompts_lib.prompt_dataset(TASK, seed=SEED)), rewards=self.rewards,
        buffer=self.buffer, channel=self.channel, timer=RoleTimer(),
        make_requests=lambda problem, group_id, members: make_group_requests(
            problem, group_id, GROUP_SIZE, SEED, members),
        group_size=GROUP_SIZE, partial_rollout=False, partial_strategy="reprefill")

  def close(self):
    self.rollouter.resume()
    self.rollouter.stop()
    self.buffer.close()
    try:
      self.rollouter.join(WAIT_S)
    finally:
      self.rewards.close()


@pytest.fixture
def make_harness(model):
  made = []

  def make(staleness_threshold: float = 0.0) -> Harness:
    made.append(Harness(model[0], staleness_threshold))
    return made[-1]

  yield make
  for harness in made:
    harness.close()


def wait_until(condition, timeout: float = WAIT_S, what: str = "condition") -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out after {timeout} s waiting for {what}")
    time.sleep(0.002)


def members_in_buffer(buffer: VersionedBuffer) -> dict[int, set[int]]:
  """group id -> indices of the members the buffer holds (partial and ready groups)."""
  state = buffer.get_state()
  held = collections.defaultdict(set)
  for record in state["partial"] + state["ready"]:
    for sample in record["samples"]:
      held[sample["group_id"]].add(int(sample["meta"]["index_in_group"]))
  return held


# ---- admission ----------------------------------------------------------------------------
def test_on_policy_admission_waits_for_the_next_version(make_harness, model):
  _, params, other_params = model
  harness = make_harness(staleness_threshold=0.0)
  rollouter, buffer, channel = harness.rollouter, harness.buffer, harness.channel
  per_version = GROUPS_PER_VERSION * GROUP_SIZE
  channel.publish(0, params)
  rollouter.start()
  wait_until(lambda: buffer.counts["put"] == per_version, what="version 0's samples")
  time.sleep(0.5)  # time enough to (wrongly) start more
  assert rollouter.error is None
  assert rollouter.counts["groups_started"] == GROUPS_PER_VERSION
  assert buffer.counts["admitted_groups"] == GROUPS_PER_VERSION
  assert buffer.counts["put"] == per_version
  assert buffer.available_slots == 0
  assert rollouter.batcher.idle  # nothing generated ahead for version 1

  groups = buffer.get_groups(GROUPS_PER_VERSION, 0, timeout=5.0)
  assert all(set(s.token_versions.tolist()) == {0} for g in groups for s in g)
  time.sleep(0.3)  # consuming frees no admission: the window's budget is spent
  assert rollouter.counts["groups_started"] == GROUPS_PER_VERSION

  channel.publish(1, other_params)
  wait_until(lambda: buffer.counts["put"] == 2 * per_version, what="version 1's samples")
  time.sleep(0.5)
  assert rollouter.error is None
  assert rollouter.counts["groups_started"] == 2 * GROUPS_PER_VERSION
  assert rollouter.counts["swaps"] == 1
  # the swap's stages, timed: the channel's fetch and the load (nothing in flight to resume)
  assert 0 < rollouter.counts["swap_fetch_s"] < 5 and 0 < rollouter.counts["swap_load_s"] < 5
  assert buffer.rollout_version == 1
  groups = buffer.get_groups(GROUPS_PER_VERSION, 1, timeout=5.0)
  assert all(set(s.token_versions.tolist()) == {1} for g in groups for s in g)
  assert sorted(g[0].group_id for g in groups) == [2, 3]
  assert buffer.counts["consumed"] == 2 * per_version


# ---- pause / resume / snapshot ------------------------------------------------------------
def check_snapshot(harness: Harness) -> list[dict]:
  """While paused: the snapshot lists exactly the started groups the buffer does not hold in
  full, each with the members it lacks and its problem. Returns the in-flight entries."""
  rollouter = harness.rollouter
  snapshot = rollouter.snapshot()
  started = rollouter.counts["groups_started"]
  assert snapshot["next_group_id"] == started
  held = members_in_buffer(harness.buffer)
  consumed = harness.buffer.counts["consumed_groups"]
  assert consumed == 0  # nobody consumes in these tests
  expected = {gid: sorted(set(range(GROUP_SIZE)) - held.get(gid, set()))
              for gid in range(started)}
  expected = {gid: missing for gid, missing in expected.items() if missing}
  assert {e["group_id"]: e["missing"] for e in snapshot["inflight"]} == expected
  state = harness.buffer.get_state()
  prompts = {s["group_id"]: s["prompt_tokens"] for r in state["partial"] for s in r["samples"]}
  for entry in snapshot["inflight"]:
    problem = Problem.from_dict(entry["problem"])  # JSON round trip for the checkpoint
    if entry["group_id"] in prompts:
      assert problem.prompt_tokens.tolist() == prompts[entry["group_id"]]
  return snapshot["inflight"]


def test_pause_snapshot_resume(make_harness, model):
  harness = make_harness(staleness_threshold=3.0)  # 8 groups of work for 2 slots
  rollouter, buffer = harness.rollouter, harness.buffer
  harness.channel.publish(0, model[1])
  rollouter.start()
  with pytest.raises(RuntimeError, match="pause"):
    rollouter.snapshot()  # only while paused
  wait_until(lambda: buffer.counts["put"] >= 1, what="the first sample")
  saw_in_flight = False
  for _ in range(20):  # a pause right after a resume must not deadlock
    rollouter.pause(timeout=10.0)
    put = buffer.counts["put"]
    inflight = check_snapshot(harness)
    saw_in_flight = saw_in_flight or bool(inflight)
    assert buffer.counts["put"] == put  # paused: nothing moves
    rollouter.resume()
  assert saw_in_flight, "no pause found a group in flight"
  assert rollouter.error is None
  # After the last resume generation goes on to the end of the window's budget.
  budget = buffer.budget
  wait_until(lambda: buffer.counts["put"] == budget * GROUP_SIZE, what="the whole budget")
  rollouter.pause(timeout=10.0)
  assert check_snapshot(harness) == []
  rollouter.resume()


# ---- stop ---------------------------------------------------------------------------------
def test_stop_returns_promptly_and_counts_aborted_samples(make_harness, model):
  harness = make_harness(staleness_threshold=3.0)
  rollouter, buffer = harness.rollouter, harness.buffer
  harness.channel.publish(0, model[1])
  rollouter.start()
  wait_until(lambda: buffer.counts["put"] >= 1, what="the first sample")
  rollouter.stop()
  rollouter.join(5.0)  # raises TimeoutError if it did not stop within 5 s
  assert not rollouter.alive
  assert rollouter.error is None
  started = rollouter.counts["groups_started"] * GROUP_SIZE
  # Samples already in the reward pool still reach the (open) buffer; every other one was
  # aborted at shutdown and counted.
  wait_until(lambda: buffer.counts["put"] + rollouter.counts["shutdown"] == started,
             timeout=10.0, what="every started sample to be put or counted as shutdown")
  assert rollouter.counts["shutdown"] > 0
  assert buffer.counts["put"] < started
  # A stopped rollouter counts as paused: its snapshot lists what must be re-issued.
  inflight = check_snapshot(harness)
  missing = sum(len(entry["missing"]) for entry in inflight)
  assert missing == rollouter.counts["shutdown"]


def test_closing_the_buffer_stops_the_rollouter_without_error(make_harness, model):
  harness = make_harness(staleness_threshold=3.0)
  rollouter, buffer = harness.rollouter, harness.buffer
  harness.channel.publish(0, model[1])
  rollouter.start()
  wait_until(lambda: buffer.counts["put"] >= 1, what="the first sample")
  buffer.close()
  wait_until(lambda: not rollouter.alive, timeout=10.0, what="the rollouter to stop")
  assert rollouter.error is None
  started = rollouter.counts["groups_started"] * GROUP_SIZE
  wait_until(lambda: buffer.counts["put"] + rollouter.counts["shutdown"] == started,
             timeout=10.0, what="every started sample to be put or counted as shutdown")
