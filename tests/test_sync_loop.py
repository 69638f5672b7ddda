"""The sync loop (`run.sync_loop.run_sync`): each version generates its own groups, in group id
order, trains on all of them at version gap 0 and only then publishes the next version.
(`test_end_to_end.py` covers its metrics, checkpoints, resume and reward faults.)"""

import json

from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.ledger import LEDGER_FILE
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from jaxrl_async.tasks.reverse import DigitReverseTask

GROUP_SIZE = 4
GROUPS_PER_VERSION = 4  # mini_batch_size 2 x trigger_parameter_sync_step 2
NUM_VERSIONS = 3


def test_each_version_trains_on_exactly_the_groups_it_generated(tmp_path):
  config = RunConfig(task=DigitReverseTask(0, max_len=8),
                     warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=GROUP_SIZE,
                     mini_batch_size=2, trigger_parameter_sync_step=2,
                     total_samples=NUM_VERSIONS * GROUPS_PER_VERSION * GROUP_SIZE,
                     max_concurrent_decodes=8, eval_size=16, eval_every_versions=10,
                     checkpoint_every_versions=10, debug_checks=True, precompile_updates=False)
  assert config.groups_per_version == GROUPS_PER_VERSION
  summary = api.run(config, tmp_path / "run", progress=False, log=lambda *a: None)

  with open(tmp_path / "run" / LEDGER_FILE, encoding="utf-8") as f:
    events = [json.loads(line) for line in f]
  consumed = [e for e in events if e["event"] == "consumed"]
  dropped = [e for e in events if e["event"] == "dropped"]
  # Version v trained on the groups made for it: ids (v - 1) N .. v N - 1, none left over.
  assert [e["policy_version"] for e in consumed] == list(range(1, NUM_VERSIONS + 1))
  for event in consumed:
    first = (event["policy_version"] - 1) * GROUPS_PER_VERSION
    dropped_groups = {g for d in dropped for g, _ in d["samples"]}
    expected = [g for g in range(first, first + GROUPS_PER_VERSION) if g not in dropped_groups]
    assert event["groups"] == expected
  assert summary["rollout/next_group_id"] == NUM_VERSIONS * GROUPS_PER_VERSION
  assert summary["ledger/missing"] == 0 and summary["ledger/duplicates"] == 0

  # Every update of version v saw only tokens of version v - 1 (on-policy), two updates each.
  records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
             if "result/reward_mean" in r]
  assert [r["learner_step"] for r in records] == [2, 4, 6]
  assert all(r["algo/version_gap_max"] == 0 for r in records)
  assert all(r["algo/stale_ratio"] == 0 for r in records)
