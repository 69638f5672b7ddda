"""End to end, sync mode: a short run trains, writes the DESIGN metrics, a summary and checkpoints;
resume continues from the checkpoint (and equals the uninterrupted run); reward failures and
timeouts are dropped whole-group and counted exactly.

Runs use the built-in task with short strings and a 20-step warm start, cached once per session.
"""

import dataclasses
import itertools
import json
import os
import threading
import zlib

import jax
import numpy as np
import pytest

from jaxrl_async.checkpoint import RunCheckpointer
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from jaxrl_async.run import build as build_lib
from jaxrl_async.tasks import prompts as prompts_lib
from jaxrl_async.tasks.reverse import DigitReverseTask

GROUP_SIZE = 4
GROUPS_PER_VERSION = 2  # mini_batch_size x require_batches x trigger
SAMPLES_PER_VERSION = GROUP_SIZE * GROUPS_PER_VERSION

# README "Metrics": names every per-version record of a run carries.
VERSION_RECORD_NAMES = (
    "policy_version", "learner_step", "system/samples_per_s", "system/tokens_per_s",
    "system/steps_per_hour", "rollout/idle_ratio", "learner/idle_ratio", "reward/idle_ratio",
    "sync/idle_ratio", "sync/latency_s", "sync/bytes", "sync/interval_steps",
    "algo/version_gap_mean", "algo/version_gap_max", "algo/stale_ratio", "algo/partial_ratio",
    "algo/max_partial_span", "algo/clipfrac", "algo/entropy", "algo/is_weight_mean",
    "algo/is_weight_max", "algo/masked_fraction", "algo/old_logprob_source",
    "result/reward_mean", "result/accuracy")




def small_config(**overrides) -> RunConfig:
  # precompile_updates off: a tiny run meets few of the row counts it would compile ahead
  settings = dict(task=DigitReverseTask(0, max_len=8), precompile_updates=False,
                  warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=GROUP_SIZE,
                  mini_batch_size=GROUPS_PER_VERSION, total_samples=4 * SAMPLES_PER_VERSION,
                  max_concurrent_decodes=8, eval_size=16, eval_every_versions=2,
                  checkpoint_every_versions=2)
  settings.update(overrides)
  return RunConfig(**settings)


def quiet(*args, **kwargs):
  del args, kwargs


def host_copy(params):
  return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(params))


def trees_equal(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(np.array_equal, a, b)))


def version_records(records):
  """Records written after a policy version (evaluation records have no algo/ metrics)."""
  return [r for r in records if "algo/version_gap_max" in r]


# ---- a short run, resumed twice ------------------------------------------------------------
@pytest.fixture(scope="module")
def sync_runs(tmp_path_factory):
  """4 versions; resume to 6; resume again at 6; and 6 versions straight in another dir."""
  root = tmp_path_factory.mktemp("sync")
  run_dir = str(root / "run")
  short = small_config(total_samples=4 * SAMPLES_PER_VERSION)
  longer = dataclasses.replace(short, total_samples=6 * SAMPLES_PER_VERSION)
  out = {"run_dir": run_dir, "config": short}

  parts = build_lib.build(short, log=quiet)
  out["base_params"] = host_copy(parts.learner.initial_state.params)
  result = api.train(parts, run_dir, progress=False, log=quiet)
  out["summary"], out["params"] = result.summary, host_copy(result.state.params)
  out["records"] = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  checkpoints = os.path.join(run_dir, "checkpoints")
  out["checkpoint_steps"] = sorted(int(name) for name in os.listdir(checkpoints)
                                   if name.isdigit())
  checkpointer = RunCheckpointer(checkpoints)
  out["latest_checkpoint"] = checkpointer.latest_step()
  checkpointer.close()
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
    out["summary_file"] = json.load(f)

  logs = []
  parts = build_lib.build(longer, log=quiet)
  result = api.train(parts, run_dir, resume=True, progress=False, log=logs.append)
  out["resumed_summary"], out["resumed_params"] = result.summary, host_copy(result.state.params)
  out["resumed_logs"] = logs
  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  out["resumed_records"] = records[len(out["records"]):]

  parts = build_lib.build(longer, log=quiet)
  result = api.train(parts, run_dir, resume=True, progress=False, log=quiet)
  out["again_summary"], out["again_params"] = result.summary, host_copy(result.state.params)
  out["again_records"] = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))[len(records):]

  straight_dir = str(root / "straight")
  parts = build_lib.build(longer, log=quiet)
  result = api.train(parts, straight_dir, progress=False, log=quiet)
  out["straight_summary"], out["straight_params"] = (result.summary,
                                                     host_copy(result.state.params))
  return out


@pytest.mark.slow
def test_sync_run_trains_one_update_per_version(sync_runs):
  summary = sync_runs["summary"]
  assert summary["mode"] == "sync"
  assert summary["policy_version"] == 4
  assert summary["learner_step"] == 4  # trigger 1: one update per version
  assert summary["consumed_samples"] == 4 * SAMPLES_PER_VERSION
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.allclose(a, b),
                                         sync_runs["base_params"], sync_runs["params"]))
  assert all(changed), "every parameter tensor should have moved away from the base policy"


@pytest.mark.slow
def test_sync_run_writes_design_metrics(sync_runs):
  config = sync_runs["config"]
  records = version_records(sync_runs["records"])
  assert [r["policy_version"] for r in records] == [1, 2, 3, 4]
  assert [r["learner_step"] for r in records] == [1, 2, 3, 4]
  assert [r["samples"] for r in records] == [SAMPLES_PER_VERSION * v for v in (1, 2, 3, 4)]
  for record in records:
    missing = [name for name in VERSION_RECORD_NAMES if name not in record]
    assert not missing, f"version record lacks {missing}"
    assert record["algo/version_gap_max"] == 0
    assert record["algo/stale_ratio"] == 0
    assert record["algo/old_logprob_source"] == config.learner.old_logprob_source
    assert record["system/samples_per_s"] > 0
    assert record["sync/latency_s"] >= 0
    for role in ("rollout", "learner", "reward", "sync"):
      assert 0.0 <= record[f"{role}/idle_ratio"] <= 1.0
    assert 0.0 <= record["result/reward_mean"] <= 1.0
  # Evaluation every 2 versions (the last one at the end of the run), on both axes.
  evals = [r for r in sync_runs["records"] if "eval/accuracy" in r]
  assert [r["policy_version"] for r in evals] == [0, 2, 4]
  assert [r["learner_step"] for r in evals] == [0, 2, 4]


@pytest.mark.slow
def test_sync_run_writes_summary_and_checkpoints(sync_runs):
  summary, on_disk = sync_runs["summary"], sync_runs["summary_file"]
  assert on_disk == json.loads(json.dumps(summary))
  for name in ("system/samples_per_s", "rollout/idle_ratio", "learner/idle_ratio",
               "system/wall_s", "eval/accuracy", "policy_version", "learner_step"):
    assert name in on_disk
  assert on_disk["checkpoint_dir"] == os.path.join(os.path.abspath(sync_runs["run_dir"]),
                                                   "checkpoints")
  assert sync_runs["checkpoint_steps"] == [2, 4]  # checkpoint_every_versions=2
  assert sync_runs["latest_checkpoint"] == 4


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint(sync_runs):
  assert any("policy_version 4" in line for line in sync_runs["resumed_logs"])
  records = version_records(sync_runs["resumed_records"])
  assert [r["policy_version"] for r in records] == [5, 6]
  assert [r["learner_step"] for r in records] == [5, 6]
  assert [r["samples"] for r in records] == [5 * SAMPLES_PER_VERSION, 6 * SAMPLES_PER_VERSION]
  summary = sync_runs["resumed_summary"]
  assert (summary["policy_version"], summary["learner_step"]) == (6, 6)
  assert summary["consumed_samples"] == 6 * SAMPLES_PER_VERSION


@pytest.mark.slow
def test_resume_equals_the_uninterrupted_run(sync_runs):
  straight = sync_runs["straight_summary"]
  assert (straight["policy_version"], straight["learner_step"]) == (6, 6)
  # Same prompts, same sample keys, same optimizer state: the same parameters.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               sync_runs["resumed_params"], sync_runs["straight_params"])
  assert sync_runs["resumed_summary"]["eval/accuracy"] == straight["eval/accuracy"]


@pytest.mark.slow
def test_resume_of_a_finished_run_does_no_more_updates(sync_runs):
  summary = sync_runs["again_summary"]
  assert (summary["policy_version"], summary["learner_step"]) == (6, 6)
  assert summary["consumed_samples"] == 6 * SAMPLES_PER_VERSION
  assert version_records(sync_runs["again_records"]) == []
  assert trees_equal(sync_runs["again_params"], sync_runs["resumed_params"])


# ---- reward failures and timeouts ----------------------------------------------------------
FAIL_BUCKET, SLOW_BUCKET, BUCKETS = 0, 1, 4
FAILING_MEMBER, SLOW_MEMBER = 1, 2
REWARD_TIMEOUT_S = 0.2
SLOW_DELAY_S = 1.0
FAULT_VERSIONS = 4


def prompt_bucket(digits: str) -> int:
  return zlib.crc32(digits.encode()) % BUCKETS


class FaultyRewardTask(DigitReverseTask):
  """The built-in task whose training reward raises for one member of the groups of some
  prompts and is slow for one member of others (chosen by the prompt's digits). Evaluation
  rewards are left alone. Same repr as the parent, so the cached warm start is shared."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self.calls = []
    self._lock = threading.Lock()
    self.release = threading.Event()

  def reward(self, prompt_tokens, response_tokens, meta):
    if meta.get("split") == "train":
      member = int(meta["index_in_group"])
      with self._lock:
        self.calls.append((meta["digits"], member))
      bucket = prompt_bucket(meta["digits"])
      if bucket == FAIL_BUCKET and member == FAILING_MEMBER:
        raise ValueError(f"verifier crashed on {meta['digits']!r}")
      if bucket == SLOW_BUCKET and member == SLOW_MEMBER:
        self.release.wait(SLOW_DELAY_S)
    return super().reward(prompt_tokens, response_tokens, meta)


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory):
  task = FaultyRewardTask(0, max_len=8)
  config = small_config(task=task, total_samples=FAULT_VERSIONS * SAMPLES_PER_VERSION,
                        reward_timeout_s=REWARD_TIMEOUT_S, reward_retries=0,
                        eval_every_versions=FAULT_VERSIONS)
  run_dir = str(tmp_path_factory.mktemp("faults"))
  try:
    summary = api.run(config, run_dir, progress=False, log=quiet)
  finally:
    task.release.set()
  # Independently: the sync baseline gives group g the g-th prompt of the seeded pipeline.
  num_groups = FAULT_VERSIONS * GROUPS_PER_VERSION
  problems = list(itertools.islice(iter(prompts_lib.prompt_dataset(task, seed=config.seed)),
                                   num_groups))
  buckets = [prompt_bucket(p.meta["digits"]) for p in problems]
  return {"summary": summary, "task": task, "problems": problems, "buckets": buckets,
          "records": read_jsonl(os.path.join(run_dir, "metrics.jsonl"))}


def test_fault_injection_preconditions(fault_run):
  """The seeded prompts give failing, slow and clean groups, and versions with one of each."""
  buckets = fault_run["buckets"]
  assert FAIL_BUCKET in buckets and SLOW_BUCKET in buckets
  per_version = [buckets[v * GROUPS_PER_VERSION:(v + 1) * GROUPS_PER_VERSION]
                 for v in range(FAULT_VERSIONS)]
  bad = (FAIL_BUCKET, SLOW_BUCKET)
  assert any(all(b not in bad for b in groups) for groups in per_version)
  assert any(any(b in bad for b in groups) and any(b not in bad for b in groups)
             for groups in per_version)


def test_every_training_sample_is_scored_once(fault_run):
  expected = sorted((p.meta["digits"], member) for p in fault_run["problems"]
                    for member in range(GROUP_SIZE))
  assert sorted(fault_run["task"].calls) == expected


def test_reward_failures_drop_whole_groups_and_are_counted(fault_run):
  summary = fault_run["summary"]
  failing_groups = fault_run["buckets"].count(FAIL_BUCKET)
  assert summary["queue/dropped/reward_failed"] == GROUP_SIZE * failing_groups
  assert summary["policy_version"] == FAULT_VERSIONS  # the run went on


def test_reward_timeouts_drop_whole_groups_and_are_counted(fault_run):
  summary = fault_run["summary"]
  slow_groups = fault_run["buckets"].count(SLOW_BUCKET)
  assert summary["queue/dropped/reward_timeout"] == GROUP_SIZE * slow_groups


def test_every_sample_is_consumed_or_dropped(fault_run):
  summary = fault_run["summary"]
  dropped = sum(v for k, v in summary.items() if k.startswith("queue/dropped/"))
  assert summary["consumed_samples"] > 0
  assert summary["consumed_samples"] + dropped == FAULT_VERSIONS * SAMPLES_PER_VERSION


def test_samples_counted_as_consumed_are_trained_on(fault_run):
  records = version_records(fault_run["records"])
  assert len(records) == FAULT_VERSIONS
  previous_step, previous_samples = 0, 0
  for record in records:
    trained = record["learner_step"] > previous_step
    new_samples = record["samples"] - previous_samples
    assert trained or new_samples == 0, (
        f"version {record['policy_version']}: {new_samples} samples counted as consumed "
        "without an update")
    previous_step, previous_samples = record["learner_step"], record["samples"]
