"""What a sync run cannot show, measured once and added to the profile fitted from it.

A sync run (one process, the roles one after the other) fixes the roles' costs; the async modes
also pay for what only happens when the roles run apart. Three parameters, each measured once
for the machine and the backend, never per mode:

- the layout and the contention (`processes_layout`), from `benchmarks/concurrency_ceiling.py`'s
  `roles` and `roles_processes` figures: the default run's rollout loop and learner loop, each
  alone in one process on every core (as the sync run runs them), each alone in the processes
  backend's layout (the rollout server pinned to its core with one XLA thread; the learner on
  every core), and both at once in that layout. Each role's cost is scaled by its layout's
  time alone over its time in one process; each role's contention c is its time per batch while
  the other runs beside it over its time alone, minus 1 (k busy roles: speed 1 / (1 + c (k - 1))).
- the hand-off latency (`handoff_latency`): how much later a published version's first sample
  enters the buffer in a measured async run than the simulator predicts for the same run with
  no hand-off (the records' `handoff/publish_to_enqueue_s`, median over versions): the weight
  path between the processes and the rollouter's poll, which no role's busy time covers.
- the buffer's cost per sample (`buffer_s_per_sample`): the cross-process buffer's time per
  sample through put + get (`benchmarks/buffer_throughput.py --cross_process`) less the
  in-process buffer's, whose cost the sync run's fitted times already hold.

- the run's edges (`run_edges`): the async backends start and stop their servers, which a
  sync run in one process does not; from the same async run's records and summary, the time
  before its first version less the simulated one, and its wall time after its last version.

One cost a sync run never pays is not measured but assumed (`with_recompute`): the proximal
policy's forward pass that the 'recompute' anchor adds to every update of a window after its
first (the sync run's windows have one update), taken as `FORWARD_FRACTION` of the update's
cost per token (a forward pass is about a third of forward + backward in FLOPs).

Pure functions of plain data; the benchmark that measures the inputs is
`benchmarks/sim_calibration.py`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxrl_async.sim.profile import Profile

HANDOFF_FIELD = "handoff/publish_to_enqueue_s"
FORWARD_FRACTION = 1.0 / 3.0


def _need(record: dict, key: str, where: str) -> float:
  value = record.get(key)
  if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{where}: {key} must be a positive number, got {value!r}")
  return float(value)


def layout_factors(ceiling: dict) -> dict:
  """Scales and contentions from a concurrency_ceiling result with `roles` (one process) and
  `roles_processes` (the processes backend's layout): rollout_scale, learner_scale,
  contention (the rollout's), learner_contention (None where the result has no per-role
  figures: then one contention, both at once over the rollout pinned alone, minus 1)."""
  if "roles" not in ceiling or "roles_processes" not in ceiling:
    raise ValueError("a concurrency_ceiling result with 'roles' and 'roles_processes' is needed "
                     f"(got keys {sorted(ceiling)}): run benchmarks/concurrency_ceiling.py")
  one, layout = ceiling["roles"], ceiling["roles_processes"]
  pinned = _need(layout, "rollout_pinned_ms_per_batch", "roles_processes")
  learner_alone = _need(layout, "learner_ms_per_batch", "roles_processes")
  factors = {"rollout_scale": pinned / _need(one, "rollout_ms_per_batch", "roles"),
             "learner_scale": learner_alone / _need(one, "learner_ms_per_batch", "roles")}
  if layout.get("rollout_beside_ms_per_batch") and layout.get("learner_beside_ms_per_batch"):
    factors["contention"] = max(0.0, layout["rollout_beside_ms_per_batch"] / pinned - 1.0)
    factors["learner_contention"] = max(
        0.0, layout["learner_beside_ms_per_batch"] / learner_alone - 1.0)
  else:
    both = _need(layout, "both_ms_per_batch", "roles_processes")
    factors["contention"], factors["learner_contention"] = max(0.0, both / pinned - 1.0), None
  return factors


def processes_layout(profile: Profile, factors: dict) -> Profile:
  """`profile` (fitted from a sync run) moved to the processes backend's layout by
  `layout_factors`: decode and prefill times times rollout_scale, the learner's costs times
  learner_scale, and the contentions."""
  rollout_scale, learner_scale = factors["rollout_scale"], factors["learner_scale"]
  rollout = dataclasses.replace(
      profile.rollout,
      decode_curve=tuple((n, s * rollout_scale) for n, s in profile.rollout.decode_curve),
      prefill_s_per_token=profile.rollout.prefill_s_per_token * rollout_scale)
  learner = dataclasses.replace(profile.learner,
                                per_update_s=profile.learner.per_update_s * learner_scale,
                                s_per_token=profile.learner.s_per_token * learner_scale)
  return dataclasses.replace(profile, rollout=rollout, learner=learner,
                             contention=factors["contention"],
                             learner_contention=factors["learner_contention"])


def median_handoff(records: list[dict], skip_versions: int = 2) -> float:
  """The median of `handoff/publish_to_enqueue_s` over the records that carry it, after the
  first `skip_versions` versions (compilation, warm-up)."""
  values = [r[HANDOFF_FIELD] for r in records
            if r.get("policy_version", 0) > skip_versions
            and isinstance(r.get(HANDOFF_FIELD), (int, float)) and math.isfinite(r[HANDOFF_FIELD])]
  if not values:
    raise ValueError(f"no record after version {skip_versions} carries {HANDOFF_FIELD} (an "
                     "async run's records do; the sync loop's do not)")
  return float(np.median(values))


def handoff_latency(measured: list[dict], simulated: list[dict], skip_versions: int = 2) -> float:
  """The hand-off latency the simulator lacks: the measured run's median publish -> first
  enqueued less the simulated one (the same mode and profile with no hand-off), at least 0."""
  return max(0.0, median_handoff(measured, skip_versions)
             - median_handoff(simulated, skip_versions))


def buffer_s_per_sample(cross_process_samples_per_s: float,
                        in_process_samples_per_s: float) -> float:
  """Host seconds per sample the processes backend's buffer adds over the in-process one."""
  for name, value in (("cross_process_samples_per_s", cross_process_samples_per_s),
                      ("in_process_samples_per_s", in_process_samples_per_s)):
    if not value > 0 or not math.isfinite(value):
      raise ValueError(f"{name}={value!r} must be a positive number")
  return max(0.0, 1.0 / cross_process_samples_per_s - 1.0 / in_process_samples_per_s)


def with_recompute(profile: Profile, forward_fraction: float = FORWARD_FRACTION) -> Profile:
  """`profile` with the recompute pass's cost per token, `forward_fraction` of the learner's
  cost per token, where the profile has none (a fitted sync profile)."""
  if not 0.0 <= forward_fraction <= 1.0:
    raise ValueError(f"forward_fraction={forward_fraction} must be in [0, 1]")
  if profile.learner.recompute_s_per_token:
    return profile
  learner = dataclasses.replace(
      profile.learner, recompute_s_per_token=forward_fraction * profile.learner.s_per_token)
  return dataclasses.replace(profile, learner=learner)


def run_edges(measured: list[dict], measured_wall_s: float,
              simulated: list[dict]) -> tuple[float, float]:
  """(startup_s, shutdown_s): the measured run's first version record came this much later
  than the simulated run's (started with no startup), and its summary's wall time ends this
  long after its last version record; both at least 0."""
  versions = [r for r in measured if "algo/version_gap_max" in r]
  simulated = [r for r in simulated if "algo/version_gap_max" in r]
  if not versions or not simulated:
    raise ValueError("run_edges needs per-version records of the measured and simulated runs")
  if not math.isfinite(measured_wall_s) or measured_wall_s < versions[-1]["time_s"]:
    raise ValueError(f"measured_wall_s={measured_wall_s!r} must be a finite time at or after "
                     f"the last version record ({versions[-1]['time_s']})")
  startup = max(0.0, versions[0]["time_s"] - simulated[0]["time_s"])
  return startup, measured_wall_s - versions[-1]["time_s"]


def median_ceiling(results: list[dict]) -> dict:
  """The median, field by field, of repeated concurrency_ceiling results (nested numbers; other
  values from the first): repeats taken in turn spread the machine's changing load over every
  phase instead of leaving it to whichever phase it hit."""
  if not results:
    raise ValueError("median_ceiling needs at least one result")
  first = results[0]
  out = {}
  for key, value in first.items():
    values = [r.get(key) for r in results]
    if isinstance(value, dict):
      out[key] = median_ceiling([v for v in values if isinstance(v, dict)])
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and all(
        isinstance(v, (int, float)) for v in values):
      out[key] = float(np.median(values))
    else:
      out[key] = value
  return out
