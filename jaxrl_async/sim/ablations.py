"""verl's 128-GPU ablations (staleness_threshold, require_batches) predicted from one profile.

The profile is `published.verl_setup(128)`'s, fitted on the published sync run only; each
ablation changes one knob of the published async setting and nothing else (no refitting). A
prediction is compared with the published table by its shape, not its values:

- `shape(speeds)`: the settings in increasing order, with their speeds (work per second,
  relative to anything: only ratios count). `saturates_at` is the smallest setting from which
  every further step changes the speed by less than `tolerance` (None: the gain has not stopped
  within the settings); `rising` says every step before it is a gain.
- the published speeds: 1 / step seconds for staleness_threshold (the 128_modes table: s = 0 is
  the stream off-policy run), 1 / total time over the first 300 steps for require_batches.

Two shapes agree when both rise up to their saturation point and saturate at the same setting.
"""

from __future__ import annotations

import dataclasses
import itertools

from jaxrl_async.sim import published
from jaxrl_async.sim.simulator import simulate

TOLERANCE = 0.05  # a step that changes the speed by less than this is no gain (the plateau)
STALENESS = (0.0, 0.1, 0.3, 0.5)
REQUIRE_BATCHES = (1, 2, 4)
_STALENESS_ROWS = {0.0: "stream_off_policy (trigger 4, require 4, s=0)",
                   0.1: "async partial s=0.1", 0.3: "async partial s=0.3",
                   0.5: "async partial s=0.5"}


def shape(speeds: dict, tolerance: float = TOLERANCE) -> dict:
  """`rising` and `saturates_at` of speeds by setting (see the module doc)."""
  if len(speeds) < 2 or any(not v > 0 for v in speeds.values()):
    raise ValueError(f"shape needs two or more positive speeds, got {speeds}")
  settings = sorted(speeds)
  steps = [speeds[b] / speeds[a] - 1.0 for a, b in itertools.pairwise(settings)]
  start = len(settings) - 1  # the last setting: no step after it
  while start > 0 and abs(steps[start - 1]) < tolerance:
    start -= 1
  saturates_at = settings[start] if start < len(settings) - 1 else None
  return {"settings": settings, "steps": steps, "saturates_at": saturates_at,
          "rising": all(step > 0 for step in steps[:start])}


def same_shape(predicted: dict, measured: dict) -> bool:
  return (predicted["rising"] and measured["rising"]
          and predicted["saturates_at"] == measured["saturates_at"])


def published_speeds(spec: dict | None = None) -> dict[str, dict]:
  spec = spec or published.load_published()
  modes, require = spec["published"]["128_modes"], spec["published"]["128_require_batches"]
  return {"staleness_threshold": {s: 1.0 / modes[row] for s, row in _STALENESS_ROWS.items()},
          "require_batches": {int(k): 1.0 / v for k, v in require.items()
                              if not k.startswith("_")}}


def predicted_speeds(num_versions: int = 20, seed: int = 0) -> dict[str, dict]:
  """Samples/s of each ablation setting over `num_versions` versions of the published async
  setting (require_batches r: 4 / r times as many, its versions being r / 4 as big), over the
  simulated sync baseline's, all with the one 128-GPU profile."""
  profile, configs = published.verl_setup(128, seed=seed)
  base = configs["async_partial_s0.5"]
  sync = simulate(profile, configs["sync"], num_versions=num_versions, seed=seed)
  sync_speed = sync.summary["system/samples_per_s"]

  def speed(config, versions):
    summary = simulate(profile, config, num_versions=versions, seed=seed).summary
    return summary["system/samples_per_s"] / sync_speed

  staleness = {s: speed(configs["stream_off_policy"] if s == 0 else dataclasses.replace(
      base, staleness_threshold=s), num_versions) for s in STALENESS}
  require = {r: speed(dataclasses.replace(base, require_batches=r),
                      max(1, num_versions * base.require_batches // r))
             for r in REQUIRE_BATCHES}
  return {"staleness_threshold": staleness, "require_batches": require}


def compare(num_versions: int = 20, seed: int = 0) -> dict[str, dict]:
  """Per ablation: the predicted and published speeds, their shapes, and whether they agree."""
  predicted, measured = predicted_speeds(num_versions, seed), published_speeds()
  out = {}
  for knob in ("staleness_threshold", "require_batches"):
    first = min(measured[knob])
    out[knob] = {"predicted_speedup_over_sync": predicted[knob],
                 "published_speed_vs_first": {k: v / measured[knob][first]
                                              for k, v in measured[knob].items()},
                 "predicted_shape": shape(predicted[knob]),
                 "published_shape": shape(measured[knob])}
    out[knob]["same_shape"] = same_shape(out[knob]["predicted_shape"],
                                         out[knob]["published_shape"])
  return out
