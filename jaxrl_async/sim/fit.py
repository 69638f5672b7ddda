"""A profile measured from a run of this project: `profile_from_run(run_dir)`.

Reads the run's `metrics.jsonl` (one record per policy version, cumulative busy seconds per
role) and its operative `config.gin`, and fits:

- the decode-step time: the run's rollout busy seconds per version divided by the decode steps
  the simulator needs for one version of this batch geometry and length distribution (the
  engine runs every slot at each step, so the step time does not depend on active slots);
- the response length distribution: the groups the fitted versions consumed, each drawn whole
  (`lengths/groups`: a group's members answer one prompt, so their lengths go together, and a
  long tail is kept as measured); for a run recorded without them, P(L = k) ∝ r^k on [1, max]
  with the run's mean response length (the built-in task's family; `max` from the task's
  `max_len` + 1, else 25);
- the learner: busy seconds per version = per_update_s + s_per_token * tokens, least squares
  over versions (per-token only when the fit is degenerate). A run whose updates all have one
  size cannot tell the two apart; `learner_fixed_fraction` f, measured elsewhere (the share of
  an update's time that does not grow with its tokens: optimizer step, dispatch), splits the
  run's mean update time U over its mean tokens per update T instead: per_update_s = f U,
  s_per_token = (1 - f) U / T;
- reward: its busy seconds per sample; sync: the mean `sync/latency_s`;
- version_overhead_s: wall-clock per version not covered by any role (host time: records,
  bookkeeping), from a sync run; startup_s: the time before the fitted versions that they do
  not account for (tracing, compilation).

If the run directory has `spans.jsonl` (the roles' busy intervals on the run's clock) reaching
back to the fitted versions, the role busy totals come from it instead of the counters.
The first `skip_versions` versions are left out (compilation, warm-up).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

import numpy as np

from jaxrl_async.config import RunConfig
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.sim.profile import (
  LatencyModel,
  LearnerCost,
  LengthModel,
  Profile,
  RolloutCost,
  SyncCost,
)
from jaxrl_async.sim.simulator import simulate
from jaxrl_async.sinks import SPANS_FILE, read_spans

_KNOBS = ("mode", "group_size", "mini_batch_size", "require_batches",
          "trigger_parameter_sync_step", "max_concurrent_decodes", "staleness_threshold",
          "max_version_gap", "version_gap_policy", "partial_rollout", "total_samples",
          "reward_workers")


def read_run_config(run_dir: str) -> dict:
  """RunConfig knobs bound in the run's config.gin (only plain literals)."""
  path = os.path.join(run_dir, "config.gin")
  knobs: dict = {}
  if not os.path.isfile(path):
    return knobs
  with open(path, encoding="utf-8") as f:
    text = f.read()
  for name, value in re.findall(r"RunConfig\.(\w+) = ([^\n\\]+)", text):
    if name in _KNOBS:
      knobs[name] = _literal(value.strip())
  match = re.search(r"\w+Task\.max_len = (\d+)", text)  # the response cap is max_len + 1
  if match:
    knobs["task_max_len"] = int(match.group(1))
  return knobs


def _literal(text: str):
  if text in ("True", "False", "None"):
    return {"True": True, "False": False, "None": None}[text]
  if text[:1] in "'\"":
    return text.strip("'\"")
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def geometric_ratio(mean: float, low: int, high: int) -> float:
  """r with mean of P(L = k) ∝ r^k on [low, high] equal to `mean` (bisection)."""
  if not low < mean < high:
    raise ValueError(f"a mean response length of {mean:.3g} tokens is outside ({low}, {high})")
  support = np.arange(low, high + 1, dtype=np.float64)

  def mean_of(ratio):
    weights = np.exp((support - low) * math.log(ratio))
    return float((support * weights).sum() / weights.sum())

  lo, hi = 1e-6, 1e6
  for _ in range(200):
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if mean_of(mid) < mean else (lo, mid)
  return math.sqrt(lo * hi)


def length_model(records: list[dict], mean_tokens: float, cap: int) -> LengthModel:
  """The fitted versions' consumed groups, drawn whole (`lengths/groups` in their records); a
  run recorded without them: P(L = k) ∝ r^k on [1, cap] with the run's mean length."""
  groups = tuple(tuple(int(n) for n in g) for r in records for g in r.get("lengths/groups") or ())
  if groups:
    return LengthModel(kind="groups", min=1, max=max(cap, max(max(g) for g in groups)),
                       groups=groups)
  return LengthModel(kind="geometric", min=1, max=cap, ratio=geometric_ratio(mean_tokens, 1, cap))


def span_totals(path: str, begin_s: float, end_s: float) -> dict[str, float] | None:
  """Busy seconds per role inside [begin_s, end_s] of the run's clock, from the recorded busy
  spans; None if the spans (the latest ones are kept) do not reach back to begin_s."""
  spans = read_spans(path)
  if not spans or min(start for _, start, _ in spans) > begin_s:
    return None
  totals: dict[str, float] = {}
  for role, start, end in spans:
    overlap = min(end, end_s) - max(start, begin_s)
    if overlap > 0:
      totals[role] = totals.get(role, 0.0) + overlap
  return totals


def profile_from_run(run_dir: str, *, skip_versions: int = 2, seed: int = 0,
                     name: str | None = None, contention: float = 0.0,
                     learner_fixed_fraction: float | None = None) -> Profile:

  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"--profile_from {run_dir}: no metrics.jsonl there")
  records = [r for r in read_jsonl(path) if "algo/version_gap_max" in r and "rollout/busy_s" in r]
  if len(records) < skip_versions + 3:
    raise ValueError(f"{path} has {len(records)} per-version records; fitting needs at least "
                     f"{skip_versions + 3} (skip_versions={skip_versions})")
  knobs = read_run_config(run_dir)
  first, last = records[skip_versions], records[-1]
  versions = last["policy_version"] - first["policy_version"]
  wall = last["time_s"] - first["time_s"]
  samples = last["samples"] - first["samples"]
  tokens_at = [r["system/tokens_per_s"] * r["time_s"] for r in records]
  tokens = tokens_at[-1] - tokens_at[skip_versions]
  busy = {role: last[f"{role}/busy_s"] - first[f"{role}/busy_s"]
          for role in ("rollout", "reward", "learner", "sync")}
  spans_path = os.path.join(run_dir, SPANS_FILE)
  totals = (span_totals(spans_path, first["time_s"], last["time_s"])
            if os.path.isfile(spans_path) else None)
  if totals:
    busy.update({role: totals[role] for role in busy if role in totals})
  group_size = int(knobs.get("group_size", 8))
  slots = int(knobs.get("max_concurrent_decodes", 64))
  length = length_model(records[skip_versions + 1:], tokens / samples,
                        int(knobs.get("task_max_len", 24)) + 1)

  # Learner: per-version busy = a + b * tokens over the fitted versions.
  steps = np.diff([r["learner/busy_s"] for r in records[skip_versions:]])
  toks = np.diff(tokens_at[skip_versions:])
  per_update, per_token = 0.0, busy["learner"] / tokens
  updates_per_version = int(knobs.get("trigger_parameter_sync_step", 1))
  if toks.std() > 0:
    slope, intercept = np.polyfit(toks, steps, 1)
    if slope > 0 and intercept > 0:
      per_token, per_update = float(slope), float(intercept) / updates_per_version
  if learner_fixed_fraction is not None:
    if not 0.0 <= learner_fixed_fraction < 1.0:
      raise ValueError(f"learner_fixed_fraction={learner_fixed_fraction} must be in [0, 1)")
    updates = versions * updates_per_version
    update_s, update_tokens = busy["learner"] / updates, tokens / updates
    per_update = learner_fixed_fraction * update_s
    per_token = (1.0 - learner_fixed_fraction) * update_s / update_tokens
  sync_s = float(np.mean([r["sync/latency_s"] for r in records[skip_versions:]]))
  reward_s = busy["reward"] / samples
  overhead = max(0.0, (wall - sum(busy.values())) / versions) if knobs.get(
      "mode", "sync") == "sync" else 0.0
  startup = max(0.0, first["time_s"] - first["policy_version"] * wall / versions)
  notes = (f"fitted from {path}{' and its busy spans' if totals else ''}: versions {first['policy_version']}..{last['policy_version']}, "
           f"{samples} samples, {tokens:.0f} response tokens, wall {wall:.3f} s, busy "
           + ", ".join(f"{k} {v:.3f} s" for k, v in busy.items()),)
  if learner_fixed_fraction is not None:
    notes += (f"learner: {learner_fixed_fraction:.3f} of an update's time fixed per update "
              "(given, measured outside this run)",)
  base = Profile(name=name or f"fit:{os.path.basename(os.path.normpath(run_dir))}",
                 prompt_tokens=max(1, length.max + 1), response_length=length,
                 rollout=RolloutCost(replicas=1, slots=slots, decode_curve=((1, 1.0),)),
                 reward_workers=1, reward_latency=LatencyModel(kind="fixed", value=reward_s),
                 learner=LearnerCost(per_update_s=per_update, s_per_token=per_token),
                 sync=SyncCost(fixed_s=sync_s), contention=contention,
                 version_overhead_s=overhead, notes=notes)
  # Decode steps per version of this geometry: simulate the sync schedule at 1 s per step.
  config = RunConfig(mode="sync", group_size=group_size,
                     mini_batch_size=int(knobs.get("mini_batch_size", 8)),
                     require_batches=int(knobs.get("require_batches", 1)),
                     trigger_parameter_sync_step=updates_per_version,
                     max_concurrent_decodes=slots, total_samples=10 ** 9)
  probe = dataclasses.replace(base, reward_latency=LatencyModel(), version_overhead_s=0.0,
                              learner=LearnerCost(), sync=SyncCost())
  probe_versions = max(200, versions)  # a long tail needs many versions for a steady mean
  steps_per_version = simulate(probe, config, num_versions=probe_versions, seed=seed).summary[
      "rollout/busy_s"] / probe_versions
  step_s = busy["rollout"] / versions / steps_per_version
  return dataclasses.replace(base, startup_s=startup, rollout=RolloutCost(replicas=1, slots=slots,
                                                       decode_curve=((1, step_s),)),
                             notes=notes + (f"decode step {step_s * 1e3:.3f} ms (rollout busy per "
                                            f"version / {steps_per_version:.1f} simulated "
                                            "decode steps per version)",))


def knobs_from_run(run_dir: str) -> dict:
  return {k: v for k, v in read_run_config(run_dir).items() if k in _KNOBS}


def dump(profile: Profile) -> str:
  return json.dumps(profile.to_dict(), indent=1)
