"""Adaptive staleness: the staleness threshold s moves with the run, one window at a time.

`RunConfig.staleness_controller = 'adaptive'` lets s move within [staleness_min,
staleness_max], starting at `staleness_threshold`. Every `staleness_window_versions` policy
versions the window's metrics go through `decide`, a pure function of them, the s in force and
the last `MEMORY_WINDOWS` windows (no clock, no thread); the live loop (`run/loop.py`) and the
simulator (`sim/simulator.py`) call it the same way and give the new s to the buffer's
admission (`staleness_budget.StalenessBudget`), which takes it at the next window opening.

The window's metrics, from the version records (docs/knobs.md):
  idle_ratio   the learner's idle ratio over the window: 1 - (learner busy s) / (wall s), both
               summed over the window's versions (the run's clock: evaluation and checkpoint
               time excluded);
  stale_ratio  the mean over the window's versions of `algo/stale_ratio` (the share of
               consumed tokens with version gap >= 1);
  kl           the mean of `algo/behaviour_kl` (the k3 estimate of KL(behaviour || current)
               on the consumed tokens: how far the trained weights are from the ones that drew
               them); NaN where no version measured it (the simulator).

The rule (`decide`), with h = `staleness_hysteresis`:
  1. over budget: stale_ratio > stale_ratio_budget or kl > kl_budget -> s - step (not below
     staleness_min). Safety first: a budget beats idleness. A stale_ratio_budget of 1.0 (the
     default) is no budget: a share cannot exceed it, and its hysteresis band would otherwise
     hold s wherever the share passes (1 - h).
  2. else, idle_ratio > idle_target, both metrics at most (1 - h) x their budget, and s + step
     did not break a budget in the remembered windows -> s + step (not above staleness_max).
  3. else s stays. Between (1 - h) x budget and the budget s neither rises nor falls (a dead
     band), and a level that broke a budget is not tried again for `MEMORY_WINDOWS` windows:
     together they keep s from swinging between two levels every window.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

CONTROLLERS = ("fixed", "adaptive")
MEMORY_WINDOWS = 4  # closed windows remembered: a level that broke a budget waits this long
_ROUND = 9  # decimals s is rounded to, so that steps of 0.1 do not drift


@dataclasses.dataclass(frozen=True)
class StalenessControl:
  """The controller's knobs: RunConfig's `staleness_*`, `idle_target` and `*_budget` (their
  defaults and checks live there; `control_of` reads them)."""

  controller: str
  window_versions: int
  step: float
  minimum: float
  maximum: float
  idle_target: float
  stale_ratio_budget: float
  kl_budget: float
  hysteresis: float


def control_of(config) -> StalenessControl:
  """The controller a RunConfig asks for (read by name: buffer/ does not import config)."""
  return StalenessControl(
      controller=config.staleness_controller, window_versions=config.staleness_window_versions,
      step=config.staleness_step, minimum=config.staleness_min, maximum=config.staleness_max,
      idle_target=config.idle_target, stale_ratio_budget=config.stale_ratio_budget,
      kl_budget=config.kl_budget, hysteresis=config.staleness_hysteresis)


class VersionSample(NamedTuple):
  """One policy version, as the controller sees it."""

  wall_s: float  # seconds the version took on the run's clock
  learner_busy_s: float  # of which the learner was busy
  stale_ratio: float  # algo/stale_ratio
  kl: float  # algo/behaviour_kl, NaN where not measured


class WindowMetrics(NamedTuple):
  idle_ratio: float
  stale_ratio: float
  kl: float  # NaN: not measured, no KL budget applies


class WindowOutcome(NamedTuple):
  """A closed window: the s it ran at, its metrics, and how s changed after it."""

  threshold: float
  metrics: WindowMetrics
  change: float


class Decision(NamedTuple):
  threshold: float  # s from the next admission window on
  change: float  # threshold - the previous s (0.0: kept)
  reason: str


class StalenessState(NamedTuple):
  """The controller between versions: the s in force, the open window's versions, the last
  closed windows, and (wall_s, learner busy_s) at the last record of this process's life (not
  saved: a resumed run's role timer starts again at 0)."""

  threshold: float
  window: tuple[VersionSample, ...] = ()
  history: tuple[WindowOutcome, ...] = ()
  mark: tuple[float, float] = (0.0, 0.0)


def init_state(threshold: float, mark: tuple[float, float] = (0.0, 0.0)) -> StalenessState:
  return StalenessState(threshold=float(threshold), mark=(float(mark[0]), float(mark[1])))


def window_metrics(samples: Sequence[VersionSample]) -> WindowMetrics:
  """The window's idle ratio (busy and wall summed), mean stale ratio and mean measured KL."""
  if not samples:
    raise ValueError("window_metrics needs at least one version")
  wall = sum(sample.wall_s for sample in samples)
  busy = sum(sample.learner_busy_s for sample in samples)
  idle = min(1.0, max(0.0, 1.0 - busy / wall)) if wall > 0 else 0.0
  stale = sum(sample.stale_ratio for sample in samples) / len(samples)
  kls = [sample.kl for sample in samples if math.isfinite(sample.kl)]
  return WindowMetrics(idle, stale, sum(kls) / len(kls) if kls else math.nan)


def over_budget(control: StalenessControl, metrics: WindowMetrics,
                scale: float = 1.0) -> list[str]:
  """Each metric above `scale` x its budget, as 'name value > bound'."""
  found = []
  if (control.stale_ratio_budget < 1.0
      and metrics.stale_ratio > scale * control.stale_ratio_budget):
    found.append(f"stale_ratio {metrics.stale_ratio:.3g} > "
                 f"{_scaled('stale_ratio_budget', control.stale_ratio_budget, scale)}")
  if math.isfinite(metrics.kl) and metrics.kl > scale * control.kl_budget:
    found.append(f"kl {metrics.kl:.3g} > {_scaled('kl_budget', control.kl_budget, scale)}")
  return found


def _scaled(name: str, budget: float, scale: float) -> str:
  return f"{name} {budget:.3g}" if scale == 1.0 else f"{scale:.3g} x {name} {budget:.3g}"


def decide(control: StalenessControl, threshold: float, metrics: WindowMetrics,
           history: Sequence[WindowOutcome] = ()) -> Decision:
  """The rule of the module docstring: the s after a window that ran at `threshold`."""
  s = float(threshold)
  if control.controller == "fixed":
    return Decision(s, 0.0, "fixed")
  over = over_budget(control, metrics)
  if over:
    lowered = max(control.minimum, round(s - control.step, _ROUND))
    if lowered < s:
      return Decision(lowered, round(lowered - s, _ROUND), "; ".join(over))
    return Decision(s, 0.0, f"{'; '.join(over)}; at staleness_min {control.minimum:.3g}")
  idle = f"idle_ratio {metrics.idle_ratio:.3g}"
  if not metrics.idle_ratio > control.idle_target:
    return Decision(s, 0.0, f"{idle} <= idle_target {control.idle_target:.3g}")
  near = over_budget(control, metrics, 1.0 - control.hysteresis)
  if near:
    return Decision(s, 0.0, f"{idle} > idle_target, but {'; '.join(near)} (hysteresis)")
  raised = min(control.maximum, round(s + control.step, _ROUND))
  if raised <= s:
    return Decision(s, 0.0, f"{idle} > idle_target; at staleness_max {control.maximum:.3g}")
  broke = [outcome.threshold for outcome in history[-MEMORY_WINDOWS:]
           if outcome.threshold >= raised - 1e-9 and over_budget(control, outcome.metrics)]
  if broke:
    return Decision(s, 0.0, f"{idle} > idle_target, but s={broke[-1]:.3g} broke a budget in "
                    f"the last {MEMORY_WINDOWS} windows")
  return Decision(raised, round(raised - s, _ROUND),
                  f"{idle} > idle_target {control.idle_target:.3g}")


def observe(control: StalenessControl, state: StalenessState,
            sample: VersionSample) -> tuple[StalenessState, Decision | None]:
  """Adds a version to the open window; at the window's last version, closes it and returns
  the decision (else None)."""
  window = state.window + (sample,)
  if len(window) < control.window_versions:
    return state._replace(window=window), None
  metrics = window_metrics(window)
  decision = decide(control, state.threshold, metrics, state.history)
  history = (state.history + (WindowOutcome(state.threshold, metrics, decision.change),))
  return StalenessState(decision.threshold, (), history[-MEMORY_WINDOWS:], state.mark), decision


def on_record(control: StalenessControl, state: StalenessState,
              record: Mapping[str, Any]) -> tuple[StalenessState, dict, Decision | None]:
  """One version record (cumulative `system/wall_s` and `learner/busy_s`, `algo/stale_ratio`,
  `algo/behaviour_kl`) -> (state, the record's `staleness/` fields, the window's decision or None).
  `staleness/threshold` is the s of the admission window the version's weights opened; a
  window's last version adds the decision (`change`, `reason`) and the window's metrics."""
  wall, busy = float(record["system/wall_s"]), float(record["learner/busy_s"])
  sample = VersionSample(wall - state.mark[0], busy - state.mark[1],
                         _number(record.get("algo/stale_ratio"), 0.0),
                         _number(record.get("algo/behaviour_kl"), math.nan))
  fields: dict[str, Any] = {"staleness/threshold": state.threshold}
  state, decision = observe(control, state._replace(mark=(wall, busy)), sample)
  if decision is not None:
    metrics = state.history[-1].metrics
    fields.update({"staleness/change": decision.change, "staleness/reason": decision.reason,
                   "staleness/window_idle_ratio": metrics.idle_ratio,
                   "staleness/window_stale_ratio": metrics.stale_ratio,
                   "staleness/window_kl": metrics.kl})
  return state, fields, decision


def _number(value, default: float) -> float:
  return default if value is None else float(value)


# ---- the checkpoint's run state ------------------------------------------------------------------
def state_to_json(state: StalenessState) -> dict[str, Any]:
  """Plain JSON (NaN written as None); the mark is not saved (see `StalenessState`)."""
  return {"threshold": state.threshold,
          "window": [[_json(v) for v in sample] for sample in state.window],
          "history": [[outcome.threshold, [_json(v) for v in outcome.metrics], outcome.change]
                      for outcome in state.history]}


def state_from_json(data: Mapping[str, Any],
                    mark: tuple[float, float] = (0.0, 0.0)) -> StalenessState:
  return StalenessState(
      threshold=float(data["threshold"]),
      window=tuple(VersionSample(*map(_unjson, sample)) for sample in data["window"]),
      history=tuple(WindowOutcome(float(threshold), WindowMetrics(*map(_unjson, metrics)),
                                  float(change))
                    for threshold, metrics, change in data["history"]),
      mark=(float(mark[0]), float(mark[1])))


def _json(value: float) -> float | None:
  return float(value) if math.isfinite(value) else None


def _unjson(value) -> float:
  return math.nan if value is None else float(value)
