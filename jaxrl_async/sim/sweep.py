"""Knob search: the fastest setting under a staleness budget, by simulation.

Every combination of `staleness_threshold`, `trigger_parameter_sync_step`, `require_batches`
and `partial_rollout` (partial only with s > 0) runs on the same profile and seed; the mode
follows from the knobs as in the mode table (s = 0: on_policy / stream_off_policy; s > 0:
async_stale / async_partial). A setting meets the budget when its simulated version gap never
exceeds `max_gap` and its stale ratio (consumed tokens with gap >= 1) is at most
`max_stale_ratio`. The answer is the budget-meeting setting with the most samples/s.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxrl_async.config import RunConfig
from jaxrl_async.sim.profile import Profile
from jaxrl_async.sim.simulator import simulate

STALENESS = (0.0, 0.1, 0.25, 0.5, 1.0)
TRIGGERS = (1, 2, 4)
REQUIRE = (1, 2, 4)


def mode_for(staleness: float, trigger: int, partial: bool) -> str:
  if staleness == 0:
    return "on_policy" if trigger == 1 else "stream_off_policy"
  return "async_partial" if partial else "async_stale"


def settings(staleness=STALENESS, triggers=TRIGGERS, require=REQUIRE):
  for s, trigger, batches in itertools.product(staleness, triggers, require):
    for partial in ((False, True) if s > 0 else (False,)):
      yield {"staleness_threshold": s, "trigger_parameter_sync_step": trigger,
             "require_batches": batches, "partial_rollout": partial}


def _versions(config: RunConfig, total_samples: int) -> int:
  return max(1, total_samples // config.samples_per_version)


def row(summary: dict, sync_samples_per_s: float) -> dict:
  keys = ("system/samples_per_s", "algo/version_gap_max", "algo/stale_ratio",
          "algo/partial_ratio", "rollout/idle_ratio", "learner/idle_ratio")
  out = {k: summary[k] for k in keys}
  out["speedup_vs_sync"] = summary["system/samples_per_s"] / sync_samples_per_s
  return out


def sweep(profile: Profile, base: RunConfig, *, total_samples: int, max_gap: int,
          max_stale_ratio: float, seed: int = 0, staleness=STALENESS, triggers=TRIGGERS,
          require=REQUIRE, progress=None) -> dict:
  """Runs every setting on the same budget of `total_samples` consumed samples (as
  benchmarks/modes.py compares modes); returns {'sync': ..., 'rows': [...], 'best': ...}."""
  if max_gap < 0 or not 0 <= max_stale_ratio <= 1:
    raise ValueError(f"budget max_gap={max_gap} must be >= 0 and max_stale_ratio="
                     f"{max_stale_ratio} in [0, 1]")
  sync_config = dataclasses.replace(base, mode="sync", staleness_threshold=0.0,
                                    partial_rollout=False, max_version_gap=None,
                                    version_gap_policy="drop")
  sync = simulate(profile, sync_config, num_versions=_versions(sync_config, total_samples),
                  seed=seed).summary
  sync_rate = sync["system/samples_per_s"]
  rows = []
  for knobs in settings(staleness, triggers, require):
    mode = mode_for(knobs["staleness_threshold"], knobs["trigger_parameter_sync_step"],
                    knobs["partial_rollout"])
    config = dataclasses.replace(base, mode=mode, max_version_gap=None,
                                 version_gap_policy="drop", **knobs)
    summary = simulate(profile, config, num_versions=_versions(config, total_samples),
                       seed=seed).summary
    entry = {"mode": mode, **knobs, **row(summary, sync_rate)}
    entry["meets_budget"] = (entry["algo/version_gap_max"] <= max_gap
                             and entry["algo/stale_ratio"] <= max_stale_ratio)
    rows.append(entry)
    if progress is not None:
      progress(entry)
  fits = [r for r in rows if r["meets_budget"]]
  best = max(fits, key=lambda r: r["system/samples_per_s"]) if fits else None
  return {"budget": {"max_gap": max_gap, "max_stale_ratio": max_stale_ratio},
          "total_samples": total_samples,
          "sync": row(sync, sync_rate), "rows": rows, "best": best}
