"""End to end, async modes: each mode's staleness bound holds on every consumed batch, partial
rollouts really span versions, every sample is accounted for, and a failing role stops the run
with that role's error.

Runs use the built-in task with short strings and a 20-step warm start, cached once per session.
"""

import os
import threading

import pytest

from jaxrl_async.backends.base import RoleFailed
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from jaxrl_async.tasks.reverse import DigitReverseTask

GROUP_SIZE = 4




def small_config(num_versions: int, **overrides) -> RunConfig:
  settings = dict(task=DigitReverseTask(0, max_len=8),
                  warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=GROUP_SIZE,
                  mini_batch_size=2, max_concurrent_decodes=8, eval_size=16,
                  eval_every_versions=2, checkpoint_every_versions=2)
  settings.update(overrides)
  groups_per_version = (settings["mini_batch_size"] * settings.get("require_batches", 1)
                        * settings.get("trigger_parameter_sync_step", 1))
  return RunConfig(total_samples=num_versions * groups_per_version * GROUP_SIZE, **settings)


def quiet(*args, **kwargs):
  del args, kwargs


def run_mode(config: RunConfig, run_dir) -> tuple[dict, list[dict]]:
  """Runs to the end (a role error would raise RoleFailed here); returns the summary and the
  per-version records."""
  summary = api.run(config, str(run_dir), progress=False, log=quiet)
  records = read_jsonl(os.path.join(str(run_dir), "metrics.jsonl"))
  return summary, [r for r in records if "algo/version_gap_max" in r]


def check_run(config: RunConfig, summary: dict, records: list[dict]) -> None:
  """What every async run must show: all versions trained, one record per version, and every
  sample the rollouter started accounted for exactly once."""
  assert summary["mode"] == config.mode
  assert summary["policy_version"] == config.num_versions
  assert summary["learner_step"] == config.num_versions * config.trigger_parameter_sync_step
  assert [r["policy_version"] for r in records] == list(range(1, config.num_versions + 1))
  assert [r["learner_step"] for r in records] == [
      v * config.trigger_parameter_sync_step for v in range(1, config.num_versions + 1)]
  # The buffer: put == consumed + dropped (any reason) + queued; what was queued at the end is
  # dropped as 'shutdown'.
  dropped = sum(v for k, v in summary.items() if k.startswith("queue/dropped/"))
  assert summary["queue/depth"] == 0
  assert summary["queue/put"] == summary["queue/consumed"] + dropped
  assert summary["queue/dropped/shutdown"] == summary["queue/discarded_at_end"]
  assert summary["queue/consumed"] == summary["consumed_samples"] == config.total_samples
  # The rollouter: every sample it started was put into the buffer or aborted at shutdown.
  started = summary["rollout/groups_started"] * config.group_size
  assert started == summary["queue/put"] + summary["rollout/shutdown"]
  assert summary["rollout/swaps"] >= 1


@pytest.mark.parametrize("mode, overrides", [
    ("on_policy", dict()),
    ("stream_off_policy", dict(trigger_parameter_sync_step=2)),
], ids=["on_policy", "stream_off_policy"])
def test_on_policy_modes_consume_only_gap_zero_tokens(tmp_path, mode, overrides):
  config = small_config(4, mode=mode, **overrides)
  assert config.debug_checks  # the learner also asserts gap 0 on every batch
  summary, records = run_mode(config, tmp_path)
  check_run(config, summary, records)
  for record in records:
    assert record["algo/version_gap_max"] == 0, record["policy_version"]
    assert record["algo/stale_ratio"] == 0
    assert record["algo/partial_ratio"] == 0
  assert summary["queue/dropped/stale"] == 0
  assert summary["rollout/interrupted"] == 0


def test_async_stale_consumes_stale_tokens_within_the_bound(tmp_path):
  config = small_config(4, mode="async_stale", staleness_threshold=1.0, max_version_gap=1)
  summary, records = run_mode(config, tmp_path)
  check_run(config, summary, records)
  assert all(r["algo/version_gap_max"] <= 1 for r in records), [
      r["algo/version_gap_max"] for r in records]
  assert any(r["algo/stale_ratio"] > 0 for r in records)
  assert all(r["algo/partial_ratio"] == 0 for r in records)  # partial rollout is off
  assert summary["rollout/interrupted"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["reprefill", "keep_kv"])
def test_async_partial_resumes_interrupted_samples(tmp_path, strategy):
  # Few slots and longer strings, so that samples are in flight at weight syncs. The first
  # versions carry no partial sample (while the first update compiles, the rollouter finishes
  # its whole budget), so 6 versions give interrupted groups several chances to be consumed
  # within max_version_gap before the run ends. Evaluation and checkpoints (which pause the
  # rollouter) only at the end, to keep the run short.
  config = small_config(6, mode="async_partial", task=DigitReverseTask(0, max_len=16),
                        staleness_threshold=1.0, max_version_gap=2, partial_rollout=True,
                        partial_strategy=strategy, max_concurrent_decodes=4,
                        eval_every_versions=6, checkpoint_every_versions=6)
  summary, records = run_mode(config, tmp_path)
  check_run(config, summary, records)
  assert summary["rollout/interrupted"] > 0
  assert all(r["algo/version_gap_max"] <= 2 for r in records), [
      r["algo/version_gap_max"] for r in records]
  assert any(r["algo/partial_ratio"] > 0 for r in records)
  assert max(r["algo/max_partial_span"] for r in records) >= 1


# ---- a failing role ------------------------------------------------------------------------
class PromptSourceFailure(RuntimeError):
  pass


class FailingPromptsTask:
  """Wraps a task; its training problems raise after `limit` of them were served (so the
  rollouter, which draws the prompts, fails mid-run). Same repr as the wrapped task, so the
  cached warm start is shared; the warm start and evaluation use the wrapped task's methods."""

  def __init__(self, inner, limit: int):
    self._inner = inner
    self.limit = limit
    self.served = 0
    self._lock = threading.Lock()

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def __repr__(self):
    return repr(self._inner)

  def problem(self, index, split="train"):
    if split == "train":
      with self._lock:
        self.served += 1
        if self.served > self.limit:
          raise PromptSourceFailure(f"prompt source gave out after {self.limit} prompts")
    return self._inner.problem(index, split)


@pytest.mark.timeout(120)
def test_a_failing_rollouter_stops_the_run_with_its_error(tmp_path):
  task = FailingPromptsTask(DigitReverseTask(0, max_len=8), limit=6)
  config = small_config(50, mode="on_policy", task=task)  # far more prompts than it will get
  with pytest.raises(RoleFailed, match="rollouter") as info:
    api.run(config, str(tmp_path), progress=False, log=quiet)
  chain, error = [], info.value
  while error is not None:
    chain.append(error)
    error = error.__cause__ or error.__context__
  assert any(isinstance(e, PromptSourceFailure) for e in chain), chain
  assert task.served == task.limit + 1  # it stopped at the first failure
  records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "algo/version_gap_max" in r]
  assert len(records) < config.num_versions
