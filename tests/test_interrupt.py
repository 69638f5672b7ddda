"""Ctrl-C in the sync baseline leaves a checkpoint that resumes without losing a prompt."""

import json
import os

import numpy as np
import pytest

from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run.api import run
from jaxrl_async.tasks.reverse import DigitReverseTask


class InterruptingTask(DigitReverseTask):
  """Raises KeyboardInterrupt (as Ctrl-C would) at the n-th reward call, once."""

  def __init__(self, interrupt_at: int, **kwargs):
    super().__init__(0, max_len=6, **kwargs)
    self.calls, self.interrupt_at = 0, interrupt_at

  def reward(self, prompt_tokens, response_tokens, meta):
    self.calls += 1
    if self.calls == self.interrupt_at:
      raise KeyboardInterrupt
    return super().reward(prompt_tokens, response_tokens, meta)


def _config(task, total):
  return RunConfig(task=task, group_size=4, mini_batch_size=2, total_samples=total,
                   warm_start=WarmStartConfig(steps=10, batch_size=8), max_concurrent_decodes=8,
                   eval_size=8, eval_every_versions=100, checkpoint_every_versions=100,
                   reward_workers=1, precompile_updates=False)


def test_interrupt_before_update_checkpoints_the_version_boundary(tmp_path):
  run_dir = str(tmp_path / "run")
  per_version = 2 * 4
  # 8 evaluation calls at version 0, versions 0 and 1 (16 calls), then Ctrl-C in version 2.
  task = InterruptingTask(interrupt_at=8 + 2 * per_version + 3)
  with pytest.raises(KeyboardInterrupt):
    run(_config(task, total=5 * per_version), run_dir, progress=False, log=lambda *a: None)
  # checkpoint_every_versions=100: only the interrupt can have written this checkpoint.
  assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["2"]
  resumed = run(_config(InterruptingTask(interrupt_at=-1), total=5 * per_version), run_dir,
                resume=True, progress=False, log=lambda *a: None)
  assert resumed["policy_version"] == 5
  assert resumed["learner_step"] == 5
  assert resumed["consumed_samples"] == 5 * per_version
  records = [r for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
             if "algo/version_gap_max" in r]
  assert [r["policy_version"] for r in records] == [1, 2, 3, 4, 5]
  # The prompts of the interrupted version are re-issued with the same group ids (so the same
  # sampling keys): every version's rewards and losses equal those of an uninterrupted run.
  straight_dir = str(tmp_path / "straight")
  straight = run(_config(InterruptingTask(interrupt_at=-1), total=5 * per_version),
                 straight_dir, progress=False, log=lambda *a: None)
  assert straight["consumed_samples"] == resumed["consumed_samples"]
  uninterrupted = [r for r in read_jsonl(os.path.join(straight_dir, "metrics.jsonl"))
                   if "algo/version_gap_max" in r]
  for got, want in zip(records, uninterrupted, strict=True):
    assert got["result/reward_mean"] == want["result/reward_mean"]
    assert got["algo/loss"] == pytest.approx(want["algo/loss"], abs=1e-6)
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
    assert json.load(f)["policy_version"] == 5
  assert np.isfinite(resumed["eval/accuracy"])
