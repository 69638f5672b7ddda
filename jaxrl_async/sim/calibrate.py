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

- the contentions as a real async run shows them (`role_contention`, optional): the ceiling's
  bare loops leave out what else shares the host in a run (the reward callers and a verifier
  service), so a discarded async run whose roles overlap gives, from its busy spans, how much
  slower the learner ran beside a busy rollout than its work, and the rollout beside a busy
  learner.

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

import contextlib
import dataclasses
import math
from collections.abc import Callable

import numpy as np

from jaxrl_async.sim.profile import Profile
from jaxrl_async.sim.simulator import simulate

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


def _merged(intervals: list[tuple[float, float]]) -> list[list[float]]:
  out: list[list[float]] = []
  for start, end in sorted(intervals):
    if out and start <= out[-1][1]:
      out[-1][1] = max(out[-1][1], end)
    else:
      out.append([start, end])
  return out


def overlap_s(first: list[list[float]], second: list[list[float]]) -> float:
  """Seconds in both of two lists of sorted, disjoint intervals."""
  total, j = 0.0, 0
  for start, end in first:
    while j < len(second) and second[j][1] <= start:
      j += 1
    k = j
    while k < len(second) and second[k][0] < end:
      total += min(end, second[k][1]) - max(start, second[k][0])
      k += 1
  return total


def busy_in_window(spans: list[tuple[str, float, float]], records: list[dict], role: str,
                   beside: str, skip_versions: int = 2) -> dict:
  """The role's busy seconds from version `skip_versions`'s record to the last one, the part
  of them beside the busy `beside` role, and the samples of that window."""
  versions = [r for r in records if "algo/version_gap_max" in r]
  if len(versions) < skip_versions + 2:
    raise ValueError(f"a run's window needs more than {skip_versions + 1} version records, "
                     f"got {len(versions)}")
  begin, end = versions[skip_versions]["time_s"], versions[-1]["time_s"]

  def busy(name):
    return _merged([(max(a, begin), min(b, end)) for r, a, b in spans
                    if r == name and b > begin and a < end])

  mine = busy(role)
  return {"busy_s": sum(b - a for a, b in mine), "beside_s": overlap_s(mine, busy(beside)),
          "samples": versions[-1]["samples"] - versions[skip_versions]["samples"]}


def role_contention(spans: list[tuple[str, float, float]], records: list[dict],
                    work_s_per_sample: float, role: str = "learner", beside: str = "rollout",
                    skip_versions: int = 2, min_overlap: float = 0.1) -> dict:
  """A role's contention c as an async run of this host shows it, for a role whose work per
  sample does not depend on the schedule (the learner's: its updates and tokens). Its busy
  time splits into seconds beside the busy other role (T_o) and alone (T_n); at speed
  1 / (1 + c) beside it, its work W (seconds at full speed: `work_s_per_sample`, the
  profile's, times the samples) is T_n + T_o / (1 + c), so c = T_o / (W - T_n) - 1 (see
  `busy_in_window` for the window). Raises where the role overlapped the other for under
  `min_overlap` of its busy time (nothing to measure), or was slower alone than its work
  allows (then c is not the cause)."""
  if not work_s_per_sample > 0:
    raise ValueError(f"work_s_per_sample={work_s_per_sample!r} must be > 0")
  figures = busy_in_window(spans, records, role, beside, skip_versions)
  total, overlap = figures["busy_s"], figures["beside_s"]
  alone, work = total - overlap, work_s_per_sample * figures["samples"]
  figures["work_s"] = work
  if total <= 0 or overlap < min_overlap * total:
    raise ValueError(f"the {role} was beside a busy {beside} for {overlap:.3f} of its "
                     f"{total:.3f} busy seconds (under {min_overlap}): no contention to "
                     "measure; use a run whose roles overlap")
  if work <= alone:
    raise ValueError(f"the {role}'s {alone:.3f} s alone already exceed its work of {work:.3f} "
                     "s: the profile's cost does not fit this run")
  return {**figures, "contention": max(0.0, overlap / (work - alone) - 1.0)}


def scaled_learner(profile: Profile, scale: float) -> Profile:
  """`profile` with every learner cost (per update, per token, recompute, old-logprob pass)
  times `scale`."""
  if not math.isfinite(scale) or scale <= 0:
    raise ValueError(f"scale={scale!r} must be a positive number")
  learner = profile.learner
  return dataclasses.replace(profile, learner=dataclasses.replace(
      learner, per_update_s=learner.per_update_s * scale,
      s_per_token=learner.s_per_token * scale,
      recompute_s_per_token=learner.recompute_s_per_token * scale,
      old_logprob_s_per_token=learner.old_logprob_s_per_token * scale))


def match_contention(busy_per_sample: Callable[[float], float], target: float,
                     high: float = 8.0, steps: int = 14) -> float:
  """The c in [0, high] at which `busy_per_sample(c)` (a simulated run's busy seconds per
  sample of a role, growing with c) meets `target`, by bisection; 0 or `high` at the edges.
  For a role whose work depends on the schedule (the rollout's decode steps run at any
  occupancy of the slots), where `role_contention`'s closed form does not hold."""
  if not math.isfinite(target) or target <= 0:
    raise ValueError(f"target={target!r} must be a positive number")
  if busy_per_sample(0.0) >= target:
    return 0.0
  if busy_per_sample(high) <= target:
    return high
  low = 0.0
  for _ in range(steps):
    mid = (low + high) / 2
    low, high = (mid, high) if busy_per_sample(mid) < target else (low, mid)
  return (low + high) / 2


CONTENTION_MODELS = ("contention", "scale", "auto")
# The largest contention 'auto' believes: beside one other busy role, a role of this host runs
# at no less than a quarter of its speed (two roles sharing cores each keep a share of them).
PLAUSIBLE_CONTENTION = 3.0


def contention_from_run(used: Profile, spans: list[tuple[str, float, float]],
                        records: list[dict], config, seed: int = 0,
                        model: str = "contention") -> dict:
  """The roles' slowdowns in an async run of this host (its `spans` and `records`; run under
  `config`), against each role's work in `used` simulated for the same config with no
  contention. The learner, by `model`:
  - 'contention': slower only beside a busy rollout (`role_contention`);
  - 'scale': slower by one factor all the time, its busy seconds per sample over its work
    per sample (`learner.scale`; its contention 0);
  - 'auto': 'contention' where it fits with a c of at most PLAUSIBLE_CONTENTION, else 'scale'
    (a larger c, or a learner slower alone than its work, says it was slow apart from the
    rollout too, which no contention explains).
  Then the rollout's contention by `match_contention`: the c at which a simulation of that
  run, with the learner's figure, keeps the rollout busy as long per sample as the run did.
  The learner's entry names the model used (`model`)."""
  if model not in CONTENTION_MODELS:
    raise ValueError(f"model={model!r}; allowed: {CONTENTION_MODELS}")
  free = dataclasses.replace(used, contention=0.0, learner_contention=0.0, startup_s=0.0,
                             shutdown_s=0.0)
  summary = simulate(free, config, seed=seed).summary
  work = summary["learner/busy_s"] / summary["consumed_samples"]
  learner = None
  if model == "contention":
    learner = {**role_contention(spans, records, work), "model": "contention"}
  elif model == "auto":
    with contextlib.suppress(ValueError):  # no overlap, or slower alone than its work
      learner = {**role_contention(spans, records, work), "model": "contention"}
    if learner is not None and learner["contention"] > PLAUSIBLE_CONTENTION:
      learner = None
  if learner is None:
    learner = {**busy_in_window(spans, records, "learner", "rollout"), "model": "scale",
               "contention": 0.0}
    learner["scale"] = learner["busy_s"] / learner["samples"] / work
    free = scaled_learner(free, learner["scale"])
  rollout = busy_in_window(spans, records, "rollout", "learner")

  def rollout_per_sample(c: float) -> float:
    run = simulate(dataclasses.replace(free, contention=c,
                                       learner_contention=learner["contention"]),
                   config, seed=seed, spans=True)
    window = busy_in_window(run.spans, run.records, "rollout", "learner")
    return window["busy_s"] / window["samples"]

  rollout["contention"] = match_contention(rollout_per_sample,
                                           rollout["busy_s"] / rollout["samples"])
  return {"learner": learner, "rollout": rollout}


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
