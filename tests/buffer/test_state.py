"""Checkpoint state: plain JSON, exact continuation, and resume through orbax == uninterrupted."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import random

import pytest

from jaxrl_async.buffer import (
  BufferDataset,
  BufferTimeout,
  VersionedBuffer,
  drop_uniform_reward,
  restore_buffer_checkpoint,
  save_buffer_checkpoint,
)

from .factory import make_buffer, make_group, make_sample, put_group

CONFIG = dict(group_size=3, groups_per_version=4, staleness_threshold=1.0, max_version_gap=1,
              capacity=24, group_filter=drop_uniform_reward, drop_truncated=True)
GROUPS_PER_BATCH = 2


class FakeClock:

  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


@dataclasses.dataclass
class ScriptState:
  """Everything outside the buffer: the rollouter's prompts, the learner's version, the RNG."""
  rng: random.Random
  clock: FakeClock
  learner_version: int = 0
  in_version: int = 0
  next_group_id: int = 0
  admitted: list = dataclasses.field(default_factory=list)  # [group_id, version], not started
  started: dict = dataclasses.field(default_factory=dict)  # group_id -> [version, [indices]]


class Script:
  """A deterministic single-threaded rollouter + learner around a buffer and a grain iterator."""

  def __init__(self, state: ScriptState):
    self.state = state
    self.buffer = VersionedBuffer(**CONFIG, clock=state.clock)
    dataset = BufferDataset(self.buffer, groups_per_batch=GROUPS_PER_BATCH,
                            learner_version_fn=lambda: self.state.learner_version, timeout=0.01)
    self.iterator = iter(dataset)
    self.batches: list[list] = []

  def step(self) -> None:
    state = self.state
    state.clock.now += 1.0
    op = state.rng.random()
    if op < 0.3:
      if self.buffer.available_slots:
        version = self.buffer.acquire_group_slot(1.0)
        state.admitted.append([state.next_group_id, version])
        state.next_group_id += 1
    elif op < 0.75:
      self._put_one()
    elif self.buffer.metrics()["queue/ready_groups"] >= GROUPS_PER_BATCH:
      try:
        groups = next(self.iterator)
      except BufferTimeout:  # stale groups were dropped, too few left
        return
      self.batches.append([[s.to_dict() for s in group] for group in groups])
      state.in_version += len(groups)
      if state.in_version >= CONFIG["groups_per_version"]:
        state.in_version -= CONFIG["groups_per_version"]
        state.learner_version += 1
        self.buffer.publish_version(state.learner_version)

  def _put_one(self) -> None:
    state, rng = self.state, self.state.rng
    if state.admitted and (not state.started or rng.random() < 0.3):
      group_id, version = state.admitted.pop(0)
      indices = list(range(CONFIG["group_size"]))
      rng.shuffle(indices)
      state.started[group_id] = [version, indices]
    elif state.started:
      group_id = rng.choice(sorted(state.started))
    else:
      return
    version, indices = state.started[group_id]
    index = indices.pop()
    if not indices:
      del state.started[group_id]
    failure = rng.choice([{}] * 12 + [{"reward_status": "failed"}, {"finish_reason": "length"}])
    late = max(version, self.buffer.rollout_version - rng.randint(0, 1))
    sample = make_sample(group_id, index, CONFIG["group_size"], (version, late),
                         reward=float(rng.random() < 0.5), **failure)
    self.buffer.put(sample, 1.0)

  def reissue_voided(self) -> None:
    """After a restore the admissions of unstarted prompts are void: admit them again."""
    for prompt in self.state.admitted:
      assert self.buffer.acquire_group_slot(1.0) == prompt[1]


def _metrics_equal(a: dict, b: dict) -> bool:
  """Equal, but for the takes' waits: wall-clock seconds, not the replayed state."""
  return a.keys() == b.keys() and all(
      (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == b[k] for k in a
      if not k.startswith("queue/take_wait_s/"))


def _counts_without_admissions(counts: dict) -> dict:
  # Re-issued prompts are admitted twice in the resumed run, by design.
  return {k: v for k, v in counts.items() if k != "admitted_groups"}


def test_resume_through_orbax_equals_uninterrupted_run(tmp_path):
  total_steps = 1500
  seed = 1234
  reference = Script(ScriptState(random.Random(seed), FakeClock()))
  # Save where the checkpoint holds everything at once: ready and partial groups, and prompts
  # admitted but not started (all in the current window, so re-issuing regenerates them with
  # the same policy version).
  save_step = None
  for step in range(total_steps):
    reference.step()
    counts = reference.buffer.counts
    state = reference.state
    if (save_step is None and step > 150 and state.admitted and state.started
        and reference.buffer.metrics()["queue/ready_groups"] >= 1
        and all(v == reference.buffer.rollout_version for _, v in state.admitted)
        and counts["consumed_groups"] and sum(counts["dropped"].values())):
      save_step = step
      batches_at_save = len(reference.batches)
  assert save_step is not None, "no step had in-flight, partial and ready groups at once"

  first = Script(ScriptState(random.Random(seed), FakeClock()))
  for _ in range(save_step + 1):
    first.step()
  assert first.batches == reference.batches[:batches_at_save]
  save_buffer_checkpoint(tmp_path / "ckpt", save_step, first.buffer, first.iterator)
  saved_script = copy.deepcopy(first.state)
  del first  # the process dies here

  resumed = Script(saved_script)
  restore_buffer_checkpoint(tmp_path / "ckpt", save_step, resumed.buffer, resumed.iterator)
  assert resumed.iterator.get_state()["batches"] == batches_at_save
  assert resumed.buffer.counts["in_flight_groups"] == 0
  resumed.reissue_voided()
  resumed.buffer.check_invariants()
  for _ in range(save_step + 1, total_steps):
    resumed.step()

  assert resumed.batches == reference.batches[batches_at_save:]
  assert len(resumed.batches) > 40
  assert _metrics_equal(resumed.buffer.metrics(), reference.buffer.metrics())
  assert (_counts_without_admissions(resumed.buffer.counts)
          == _counts_without_admissions(reference.buffer.counts))
  assert resumed.iterator.get_state() == reference.iterator.get_state()
  resumed.buffer.check_invariants()


def _busy_buffer() -> VersionedBuffer:
  buffer = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=1.0,
                       max_version_gap=2)
  for _ in range(4):
    buffer.acquire_group_slot(1.0)
  put_group(buffer, make_group(0, 2, version=0))
  put_group(buffer, make_group(1, 2, version=0, reward_status="failed"))
  put_group(buffer, make_group(2, 2, version=0))
  buffer.get_groups(1, 0, 1.0)
  buffer.put(make_sample(3, 1, 2, reward=float("nan"), reward_status="timeout"), 1.0)
  buffer.publish_version(1)
  buffer.acquire_group_slot(1.0)
  buffer.acquire_group_slot(1.0)
  return buffer  # ready: group 2; partial: group 3; in flight: 2 groups


def test_state_is_strict_json_and_round_trips():
  buffer = _busy_buffer()
  state = buffer.get_state()
  assert json.loads(json.dumps(state, allow_nan=False)) == state
  assert [g["samples"][0]["group_id"] for g in state["ready"]] == [2]
  assert [g["group_id"] for g in state["partial"]] == [3]
  assert state["ledger"]["in_flight"] == 2
  restored = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=1.0,
                         max_version_gap=2)
  restored.set_state(json.loads(json.dumps(state)))
  restored.check_invariants()
  again = restored.get_state()
  # In-flight admissions are voided on restore and their slots refunded; all else is equal.
  assert again["ledger"]["in_flight"] == 0
  assert again["ledger"]["outstanding"] == state["ledger"]["outstanding"] - 2
  assert again["ledger"]["used"] == state["ledger"]["used"] - 2
  for key in ("accounting", "latency", "partial", "ready", "rollout_version", "config"):
    assert again[key] == state[key], key
  assert restored.available_slots == buffer.available_slots + 2
  # The restored stream continues: group 3 completes and fails; group 2 is served.
  restored.put(make_sample(3, 0, 2), 1.0)
  assert restored.counts["dropped"]["reward_timeout"] == 2
  (group,) = restored.get_groups(1, 1, 1.0)
  assert group[0].group_id == 2 and group[0].timestamps["enqueued"] > 0
  restored.check_invariants()


def test_a_state_saved_before_takes_waits_were_counted_restores_them_at_zero():
  buffer = _busy_buffer()
  with pytest.raises(BufferTimeout):
    buffer.get_groups(2, 1, 0.02)  # one group ready, two asked for
  state = json.loads(json.dumps(buffer.get_state()))
  assert state["accounting"]["take_wait_s"]["groups"] >= 0.015  # most of the timeout
  restored = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=1.0,
                         max_version_gap=2)
  restored.set_state(state)
  assert restored.metrics()["queue/take_wait_s/groups"] == state["accounting"]["take_wait_s"][
      "groups"]
  del state["accounting"]["take_wait_s"]
  older = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=1.0,
                      max_version_gap=2)
  older.set_state(state)
  assert older.metrics()["queue/take_wait_s/groups"] == 0.0
  older.check_invariants()


def test_set_state_rejects_other_config_and_used_buffer():
  state = _busy_buffer().get_state()
  other = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=0.5,
                      max_version_gap=2)
  with pytest.raises(ValueError, match=r"staleness_threshold: this buffer 0.5, state 1.0"):
    other.set_state(state)
  used = make_buffer(group_size=2, groups_per_version=2, staleness_threshold=1.0,
                     max_version_gap=2)
  used.acquire_group_slot(1.0)
  with pytest.raises(ValueError, match=r"set_state needs a fresh buffer; .* 1 groups admitted"):
    used.set_state(state)
