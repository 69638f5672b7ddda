"""Resume after a crash loses nothing: the groups the learner had taken for its next update
when a checkpoint was written are saved with it and trained first on resume; a run ended by a
disk error resumes from its last good checkpoint; rewards that are NaN, not a number, or raise
are counted and never trained on.

A crash is a fault raised in the learner right after the checkpoint is written (what a kill -9
at that moment leaves behind: the checkpoint, and logs written up to the crash)."""

import dataclasses
import json
import os

import numpy as np
import pytest

from jaxrl_async import faults
from jaxrl_async.backends.base import RoleFailed
from jaxrl_async.checkpoint import CheckpointError
from jaxrl_async.ledger import LEDGER_FILE, read_events
from jaxrl_async.run import api
from tests.test_end_to_end import GROUP_SIZE, SAMPLES_PER_VERSION, quiet, small_config


@pytest.fixture(autouse=True)
def no_plan_after():
  yield
  faults.configure(None)


def _async_config(**overrides):
  settings = dict(mode="async_partial", staleness_threshold=1.0, max_version_gap=2,
                  partial_rollout=True, total_samples=12 * SAMPLES_PER_VERSION,
                  checkpoint_every_versions=3, eval_every_versions=100)
  settings.update(overrides)
  return small_config(**settings)


def _summary(run_dir):
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
    return json.load(f)


def _saved_run_state(run_dir, step):
  path = os.path.join(run_dir, "checkpoints", str(step), "run", "metadata")  # orbax JsonSave
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _check_books(run_dir, num_versions):
  summary = _summary(run_dir)
  assert summary["ledger/missing"] == 0, summary
  assert summary["ledger/duplicates"] == 0, summary
  assert summary["ledger/produced"] == summary["rollout/produced_groups"] * GROUP_SIZE
  assert summary["policy_version"] == num_versions
  return summary


def test_groups_taken_before_a_checkpoint_survive_a_crash_after_it(tmp_path):
  config = _async_config()
  run_dir = str(tmp_path / "run")
  # Crash after the 2nd periodic checkpoint (version 6), before anything else is written. The
  # learner pauses for a second after training version 6, before it takes the next update's
  # groups: with s = 1 the rollout then has them ready (without the pause this relied on the
  # rollout being ahead by chance).
  faults.configure("learner.trained=delay:1.0@6,checkpoint.after_write=raise@2")
  with pytest.raises(RoleFailed, match="injected at fault point checkpoint.after_write"):
    api.run(config, run_dir, progress=False, log=quiet)
  faults.configure(None)
  taken = _saved_run_state(run_dir, 6)["taken"]
  # The learner takes the next update's groups before it publishes a version; they are there
  # (this is the case that used to be lost).
  assert len(taken) == config.groups_per_update
  taken_ids = {group[0]["group_id"] for group in taken}
  api.run(config, run_dir, resume=True, progress=False, log=quiet)
  _check_books(run_dir, config.num_versions)
  events = read_events(os.path.join(run_dir, LEDGER_FILE))
  first_resumed = next(e for e in events if e["event"] == "consumed" and e["policy_version"] == 7)
  assert taken_ids <= set(first_resumed["groups"])


def test_a_full_disk_stops_the_run_and_it_resumes_from_the_last_good_checkpoint(tmp_path):
  config = _async_config()
  run_dir = str(tmp_path / "run")
  faults.configure("checkpoint.before_write=raise:ENOSPC@3")
  with pytest.raises(RoleFailed, match="No space left on device") as caught:
    api.run(config, run_dir, progress=False, log=quiet)
  assert isinstance(caught.value.__cause__, CheckpointError)
  faults.configure(None)
  assert sorted(int(n) for n in os.listdir(os.path.join(run_dir, "checkpoints"))
                if n.isdigit()) == [3, 6]
  api.run(config, run_dir, resume=True, progress=False, log=quiet)
  _check_books(run_dir, config.num_versions)


class BadRewardTask:
  """The built-in task, whose reward is NaN, a string, or raises for some prompts."""

  def __init__(self, task):
    self._task = task

  def __getattr__(self, name):
    return getattr(self._task, name)

  @staticmethod
  def badness(prompt_tokens) -> int:
    return int(np.sum(prompt_tokens)) % 7  # 0: NaN, 1: a string, 2: raises

  def reward(self, prompt_tokens, response_tokens, meta):
    kind = self.badness(prompt_tokens)
    if kind == 0:
      return float("nan")
    if kind == 1:
      return "not a number"
    if kind == 2:
      raise ValueError("verifier crashed")
    return self._task.reward(prompt_tokens, response_tokens, meta)


@pytest.mark.parametrize("mode", ["sync", "async_stale"])
def test_bad_rewards_are_counted_and_never_trained_on(tmp_path, mode):
  base = small_config()
  task = BadRewardTask(base.task)
  settings = dict(task=task, total_samples=8 * SAMPLES_PER_VERSION)
  if mode != "sync":
    settings.update(mode=mode, staleness_threshold=0.5, max_version_gap=2)
  config = dataclasses.replace(base, **settings)
  run_dir = str(tmp_path / "run")
  summary = api.run(config, run_dir, progress=False, log=quiet)
  events = read_events(os.path.join(run_dir, LEDGER_FILE))
  consumed_prompts = [p for e in events if e["event"] == "consumed" for p in e["prompts"]]
  assert consumed_prompts, "nothing was trained"
  assert all(task.badness(task.problem(p).prompt_tokens) > 2 for p in consumed_prompts)
  assert summary["queue/dropped/reward_failed"] > 0
  assert summary["reward/failed"] > 0 and summary["reward/retries"] > 0
  assert summary["ledger/missing"] == 0 and summary["ledger/duplicates"] == 0
  assert summary["ledger/dropped/reward_failed"] == summary["queue/dropped/reward_failed"]


def test_a_crash_before_the_first_checkpoint_then_resume_starts_over_cleanly(tmp_path):
  config = _async_config(checkpoint_every_versions=100)  # the only checkpoint is at the end
  run_dir = str(tmp_path / "run")
  faults.configure("learner.take_publish=raise@3")
  with pytest.raises(RoleFailed, match="learner.take_publish"):
    api.run(config, run_dir, progress=False, log=quiet)
  faults.configure(None)
  assert os.path.getsize(os.path.join(run_dir, LEDGER_FILE)) > 0  # versions 1, 2 were logged
  api.run(config, run_dir, resume=True, progress=False, log=quiet)
  _check_books(run_dir, config.num_versions)
  with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
    versions = [json.loads(line)["policy_version"] for line in f
                if "result/reward_mean" in line]
  assert versions == list(range(1, config.num_versions + 1))
