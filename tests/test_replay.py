"""Record and replay (run/schedule_record.py, run/schedule_read.py, run/regenerate.py,
run/replay.py): a tiny async_partial run on the threads backend records its schedule; the
learner replay reproduces every checkpoint bit for bit, the full replay draws the same tokens,
and the as_sync replay draws every token on-policy. (A processes run killed and resumed:
tests/test_replay_lives.py.)"""

from __future__ import annotations

import os

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from jaxrl_async.run import api, build
from jaxrl_async.run.replay import replay
from jaxrl_async.run.schedule_read import ScheduleError, read_schedule
from jaxrl_async.run.schedule_record import (
  ScheduleRecorder,
  cut_back,
  interval_path,
  recorded_ends,
  version_segments,
  version_segments_many,
)
from jaxrl_async.types import Sample
from tests.backends.test_backend_contract import tiny_config

NUM_VERSIONS = 6


def quiet(*args, **kwargs):
  del args, kwargs


def config():
  # s = 1 and partial rollouts: stale and interrupted samples; checkpoints at 2, 4 and 6.
  return tiny_config("threads", num_versions=NUM_VERSIONS, mode="async_partial",
                     staleness_threshold=1.0, partial_rollout=True, max_version_gap=2)


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("recorded"))
  summary = api.run(config(), run_dir, progress=False, log=quiet)
  parts = build.build(config(), log=quiet)  # the replays' parts (replay never consumes them)
  yield run_dir, summary, parts
  parts.rollout.rewards.close()


# ---- the format --------------------------------------------------------------------------
def test_version_segments_run_length_encode_the_per_token_versions():
  versions, lengths = version_segments(np.array([3, 3, 4, 6, 6, 6], np.int32))
  assert versions.tolist() == [3, 4, 6] and lengths.tolist() == [2, 1, 3]
  versions, lengths = version_segments(np.zeros((0,), np.int32))
  assert versions.size == 0 and lengths.size == 0


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(arrays=st.lists(st.lists(st.integers(0, 5), max_size=8), max_size=6))
def test_version_segments_many_is_version_segments_of_each_array_joined(arrays):
  arrays = [np.asarray(a, np.int32) for a in arrays]
  counts, versions, lengths = version_segments_many(arrays)
  each = [version_segments(a) for a in arrays]
  assert counts.dtype == versions.dtype == lengths.dtype == np.int32
  assert counts.tolist() == [len(v) for v, _ in each]
  assert versions.tolist() == [int(x) for v, _ in each for x in v]
  assert lengths.tolist() == [int(x) for _, n in each for x in n]


def sample(group_id, member, versions, reward):
  n = len(versions)
  return Sample(prompt_id=100 + group_id, group_id=group_id, group_size=2,
                prompt_tokens=np.array([1, 5, 6], np.int32),
                response_tokens=np.arange(n, dtype=np.int32) + 70000 * (group_id == 9),
                behaviour_logprobs=-np.linspace(0.1, 1.0, n, dtype=np.float32),
                token_versions=np.asarray(versions, np.int32), finish_reason="eos",
                reward=reward, reward_status="ok", interruptions=len(set(versions)) - 1,
                meta={"target": [6, 5], "index_in_group": member})


def test_a_recorded_interval_reads_back_sample_for_sample(tmp_path):
  recorder = ScheduleRecorder(tmp_path, seed=3, group_size=2, groups_per_update=1,
                              start_version=0)
  groups = [[sample(4, 0, [0, 0, 1], 1.0), sample(4, 1, [0], 0.25)],
            [sample(9, 1, [1, 1], 0.5), sample(9, 0, [], 0.0)]]  # members as trained
  recorder.on_version(2, groups, {0: 10.0, 1: 11.0, 2: 12.5})  # two updates at version 1
  recorder.flush(2)
  (interval,) = read_schedule(tmp_path)
  assert (interval.start_version, interval.end_version) == (0, 2)
  assert interval.published == {0: 10.0, 1: 11.0, 2: 12.5}
  assert [(u.version, u.local) for u in interval.updates] == [(1, 0), (1, 1)]
  for update, group in zip(interval.updates, groups, strict=True):
    (read,) = update.groups
    for a, b in zip(read, group, strict=True):
      for field in ("prompt_tokens", "response_tokens", "behaviour_logprobs", "token_versions"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert getattr(a, field).dtype == getattr(b, field).dtype, field
      assert (a.uid, a.prompt_id, a.reward, a.interruptions, a.meta) == (
          b.uid, b.prompt_id, b.reward, b.interruptions, b.meta)
  # The keys are the rollout's: a function of (seed, group, member).
  from jaxrl_async.rollout.generation import sample_keys
  assert np.array_equal(interval.updates[1].keys[0], sample_keys(3, 9, [1, 0]))


def test_cut_back_deletes_the_files_past_the_checkpoint_and_a_gap_is_an_error(tmp_path):
  for start, end in ((0, 2), (2, 4), (4, 6)):
    ScheduleRecorder(tmp_path, seed=0, group_size=2, groups_per_update=1,
                     start_version=start).flush(end)
  assert cut_back(tmp_path, 4) == [6] and recorded_ends(tmp_path) == [2, 4]
  assert [i.end_version for i in read_schedule(tmp_path, until=3)] == [2, 4]
  with pytest.raises(ScheduleError, match="reaches version 4 only"):
    read_schedule(tmp_path, until=5)
  os.remove(interval_path(tmp_path, 2))
  with pytest.raises(ScheduleError, match="starts at version 2 .* reach version 0"):
    read_schedule(tmp_path)
  assert cut_back(tmp_path, None) == [4] and recorded_ends(tmp_path) == []
  with pytest.raises(ScheduleError, match="no recorded schedule"):
    read_schedule(tmp_path)


# ---- a recorded run ------------------------------------------------------------------------
def test_an_async_run_records_one_file_per_checkpoint_with_every_consumed_sample(recorded_run):
  run_dir, summary, _ = recorded_run
  intervals = read_schedule(run_dir)
  assert [i.end_version for i in intervals] == [2, 4, 6]
  samples = [s for i in intervals for u in i.updates for g in u.groups for s in g]
  assert len(samples) == summary["consumed_samples"] == summary["schedule/samples"]
  updates = [(u.version, u.local) for i in intervals for u in i.updates]
  assert updates == [(v, 0) for v in range(NUM_VERSIONS)]
  published = {v for i in intervals for v in i.published}
  assert published == set(range(NUM_VERSIONS + 1))
  assert 0 < summary["schedule/bytes_per_sample"] < 1000


def test_learner_replay_equals_every_checkpoint_bit_for_bit(recorded_run):
  run_dir, _, parts = recorded_run
  report = replay(parts, run_dir, level="learner", log=quiet)
  assert [c["version"] for c in report["checkpoints"]] == [2, 4, 6]
  assert report["bitwise_equal"], report["checkpoints"]
  assert report["learner_step"] == NUM_VERSIONS
  # --until stops at the version: checkpoint 2 compared, nothing after.
  report = replay(parts, run_dir, level="learner", until=3, log=quiet)
  assert [c["version"] for c in report["checkpoints"]] == [2]
  assert report["learner_step"] == 3


def test_full_replay_draws_the_recorded_tokens_and_reaches_the_same_params(recorded_run):
  run_dir, summary, parts = recorded_run
  report = replay(parts, run_dir, level="full", log=quiet)
  tokens = report["tokens"]
  assert tokens["samples"] == summary["consumed_samples"]
  assert tokens["identical_tokens"] == tokens["samples"], tokens
  assert tokens["behaviour_logprob_max_abs_diff"] == 0.0
  assert report["bitwise_equal"], report["checkpoints"]


def test_as_sync_replay_draws_each_version_on_policy(recorded_run):
  run_dir, _, parts = recorded_run
  intervals = read_schedule(run_dir)
  off_policy = sum(bool(np.any(s.token_versions != u.version))
                   for i in intervals for u in i.updates for g in u.groups for s in g)
  assert off_policy > 0  # the run trained stale or interrupted samples
  report = replay(parts, run_dir, level="learner", as_sync=True, log=quiet)
  assert report["tokens"]["off_policy_in_run"] == off_policy
  assert report["tokens"]["off_policy"] == 0
  assert report["tokens"]["samples"] == len(
      [s for i in intervals for u in i.updates for g in u.groups for s in g])
  assert [row["policy_version"] for row in report["side_by_side"]] == list(
      range(1, NUM_VERSIONS + 1))
  assert all(row["run_reward_mean"] is not None for row in report["side_by_side"])
