"""What the loops write: one version's metrics record, evaluation records, the progress bar's
line, the reward pool's counts and the sample ledger's audit. Plain functions of their
arguments; the loops decide when to call them."""

from __future__ import annotations

import sys

import jax
import numpy as np

from jaxrl_async.config import RunConfig
from jaxrl_async.ledger import SampleLedger, audit, audit_metrics, read_events
from jaxrl_async.metrics import group_lengths, reduce_metrics, staleness_metrics
from jaxrl_async.rollout.rewards import RewardPool


def progress_bar(total: int, initial: int, enabled: bool):
  from tqdm import tqdm
  return tqdm(total=total, initial=initial, disable=not enabled, unit="version",
              dynamic_ncols=True)


def reward_metrics(rewards: RewardPool) -> dict[str, int]:
  """`reward/retries` and the outcome counts of the reward pool, over the run so far."""
  return {f"reward/{name}": int(count) for name, count in rewards.counts.items()}


def ledger_audit(ledger: SampleLedger, group_size: int, *, next_group_id: int | None = None,
                 groups=None) -> dict:
  """The sample ledger's audit at the end of a run, as `ledger/...` figures; a lost or
  duplicated sample is reported on stderr (the summary says how many). The produced groups:
  ids below `next_group_id`, or `groups` (`ledger.audit`)."""
  result = audit(read_events(ledger.path), next_group_id=next_group_id, group_size=group_size,
                 groups=groups)
  if result["missing"] or result["duplicates"] or result["unknown"]:
    print(f"warning: sample ledger {ledger.path}: {len(result['missing'])} samples lost, "
          f"{len(result['duplicates'])} counted twice, {len(result['unknown'])} unknown "
          f"(first lost: {result['missing'][:5]}, first twice: {result['duplicates'][:5]})",
          file=sys.stderr)
  return audit_metrics(result)


def eval_record(version: int, state, consumed: int, timer, evaluation: dict) -> dict:
  """The metrics record of a held-out evaluation of `state` at `version`."""
  return {"policy_version": version, "learner_step": int(state.step), "samples": consumed,
          "time_s": timer.wall_s(), **evaluation}


def show_version(bar, record: dict, evaluation: dict, *, gap: bool = True) -> None:
  """One version on the progress bar: its reward, the last accuracy (and the largest gap)."""
  postfix = {"reward": f"{record['result/reward_mean']:.3f}",
             "acc": f"{evaluation.get('eval/accuracy', float('nan')):.3f}"}
  if gap:
    postfix["gap"] = f"{record['algo/version_gap_max']:.0f}"
  bar.set_postfix(**postfix)
  bar.update(1)


def version_record(config: RunConfig, timer, version: int, state, groups, accumulated: dict,
                   consumed: int, tokens: int, sync_latency: float) -> dict:
  """The metrics of policy version `version`, made from `groups` (consumed by its updates)."""
  rewards = [s.reward for g in groups for s in g]
  wall_s = max(timer.wall_s(), 1e-9)
  record = {
      "policy_version": version,
      "learner_step": int(state.step),
      "samples": consumed,
      "time_s": timer.wall_s(),
      "system/samples_per_s": consumed / wall_s,
      "system/tokens_per_s": tokens / wall_s,
      "system/steps_per_hour": int(state.step) * 3600.0 / wall_s,
      "result/reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
      "result/accuracy": float(np.mean(np.asarray(rewards) == 1.0)) if rewards else float("nan"),
      "sync/latency_s": sync_latency,
      "sync/bytes": int(sum(x.nbytes for x in jax.tree.leaves(state.params))),
      "sync/interval_steps": config.trigger_parameter_sync_step,
      "algo/old_logprob_source": config.learner.old_logprob_source,
      **group_lengths(groups),
      **staleness_metrics(groups, version - 1),
      **reduce_metrics(accumulated, prefix="algo/"),
  }
  record.update(timer.summary())
  return record
