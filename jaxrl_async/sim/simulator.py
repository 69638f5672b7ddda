"""`simulate(profile, config)`: one run of a mode on the virtual clock, with the real buffer.

Returns the per-version records (the names and meaning of a real run's metrics.jsonl, so the
same tools read both) and a summary: samples/s, each role's idle ratio, the version-gap
distribution (token-weighted), stale and partial ratios, drops by reason, and the buffer's
accounting after the run.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time

import numpy as np

from jaxrl_async.buffer import VersionedBuffer, staleness_control
from jaxrl_async.config import RunConfig
from jaxrl_async.metrics import JsonlWriter, group_lengths, staleness_metrics
from jaxrl_async.run.handoff import Handoffs
from jaxrl_async.sim.clock import Clock, Device, Host
from jaxrl_async.sim.drivers import SimLearner, sync_loop
from jaxrl_async.sim.profile import LearnerCost, Profile
from jaxrl_async.sim.replicas import ReplicaPool
from jaxrl_async.sim.roles import Process, ReadyGroups, SimRollouter
from jaxrl_async.sinks import SPANS_FILE

ROLES = ("rollout", "reward", "learner", "sync")


@dataclasses.dataclass
class SimResult:
  records: list[dict]
  summary: dict
  counts: dict  # the buffer's sample counts at the end (before the queue is discarded)
  spans: list | None = None  # (role, start, end) of every piece of work, if asked for

  def write(self, out_dir: str | os.PathLike) -> None:
    """metrics.jsonl (one record per policy version), summary.json and, with spans,
    spans.jsonl, as a real run writes them."""
    import json
    os.makedirs(out_dir, exist_ok=True)
    writer = JsonlWriter(os.path.join(out_dir, "metrics.jsonl"))
    for record in self.records:
      writer.write(record)
    writer.close()
    if self.spans is not None:
      with open(os.path.join(out_dir, SPANS_FILE), "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"role": role, "start": start, "end": end}) + "\n"
                     for role, start, end in self.spans)
    with open(os.path.join(out_dir, "summary.json"), "w", encoding="utf-8") as f:
      json.dump(_finite(self.summary), f, indent=2, sort_keys=True)


def _finite(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None
  if isinstance(value, dict):
    return {k: _finite(v) for k, v in value.items()}
  return value


def update_model(cost: LearnerCost, config: RunConfig, buffer_s_per_sample: float = 0.0):
  """Seconds of one learner update on `groups` (the `local`-th update of its window), with
  `buffer_s_per_sample` of host time per sample it consumes (the async modes' buffer)."""
  old_pass = config.mode in cost.old_logprob_pass_modes
  recompute = config.learner.needs_recompute
  per_sample = buffer_s_per_sample if config.mode != "sync" else 0.0

  def update_s(groups, local: int) -> float:
    tokens = sum(sample.meta["tokens"] for group in groups for sample in group)
    seconds = cost.per_update_s + tokens * cost.s_per_token
    if per_sample:
      seconds += per_sample * sum(len(group) for group in groups)
    if recompute and local > 0:
      seconds += tokens * cost.recompute_s_per_token
    if old_pass:
      seconds += tokens * cost.old_logprob_s_per_token
    return seconds

  return update_s


class Recorder:
  """Builds one record per published version, like the real run's `version_record`."""

  def __init__(self, clock, config, profile, buffer, pool, learner_device, num_versions,
               counters, handoffs: Handoffs | None = None):
    self.clock, self.config, self.profile = clock, config, profile
    self.buffer, self.pool, self.learner_device = buffer, pool, learner_device
    self.num_versions = num_versions
    self.counters = counters  # callable -> dict of rollout/learner counters
    self.records: list[dict] = []
    self.handoffs = handoffs  # the async modes: publish -> first enqueued -> first taken
    self.samples = self.tokens = self.updates = 0
    self.gap_hist = np.zeros(1, np.int64)
    self.partial = self.max_span = 0
    # Adaptive staleness: the live loop's controller, on the same records.
    self.control = (staleness_control.control_of(config)
                    if config.adaptive_staleness else None)
    self.staleness = (None if self.control is None
                      else staleness_control.init_state(config.staleness_threshold))

  def busy(self) -> dict[str, float]:
    replicas = self.pool.replicas
    return {"rollout": sum(r.device.busy_s.get("rollout", 0.0) for r in replicas) / len(replicas),
            "reward": self.pool.reward_busy_s,
            "learner": self.learner_device.busy_s.get("learner", 0.0),
            "sync": self.learner_device.busy_s.get("sync", 0.0)}

  def on_version(self, version: int, groups: list, extra: dict, sync_latency: float) -> None:
    samples = [sample for group in groups for sample in group]
    self.samples += len(samples)
    self.tokens += sum(sample.meta["tokens"] for sample in samples)
    self.updates += math.ceil(len(groups) / self.config.groups_per_update) if groups else 0
    staleness = staleness_metrics(groups, version - 1)
    if samples:
      counts = staleness.get("algo/version_gap_counts")  # the real metric, where it exists
      hist = (np.asarray(counts, np.int64) if counts is not None else np.bincount(
          (version - 1) - np.concatenate([s.token_versions for s in samples])))
      if hist.size > self.gap_hist.size:
        hist[:self.gap_hist.size] += self.gap_hist
        self.gap_hist = hist
      else:
        self.gap_hist[:hist.size] += hist
      self.partial += round(staleness["algo/partial_ratio"] * len(samples))
      self.max_span = max(self.max_span, staleness["algo/max_partial_span"])
    wall = max(self.clock.now, 1e-12)
    record = {"policy_version": version, "learner_step": self.updates,
              "samples": self.samples, "time_s": wall,
              "system/samples_per_s": self.samples / wall,
              "system/tokens_per_s": self.tokens / wall,
              "system/steps_per_hour": self.updates * 3600.0 / wall,
              "system/wall_s": wall,
              "sync/latency_s": sync_latency, "sync/bytes": self.profile.sync.bytes,
              "sync/interval_steps": self.config.trigger_parameter_sync_step,
              "algo/old_logprob_source": self.config.learner.old_logprob_source,
              **staleness, **group_lengths(groups), **self.buffer.metrics(), **extra,
              **self.counters()}
    if self.handoffs is not None:  # as run/loop.py's on_version
      self.handoffs.observe(groups)
      latest = self.handoffs.intervals(version - 1)
      record.update({f"handoff/{name}": value for name, value in (latest or {}).items()})
    for role, busy in self.busy().items():
      record[f"{role}/busy_s"] = busy
      record[f"{role}/idle_ratio"] = max(0.0, 1.0 - busy / wall)
    if self.control is not None:  # as run/loop.py's on_version
      self.staleness, fields, decision = staleness_control.on_record(self.control,
                                                                     self.staleness, record)
      record.update(fields)
      if decision is not None and decision.change:
        self.buffer.set_staleness_threshold(decision.threshold, version + 1)
    self.records.append(record)
    if version >= self.num_versions:
      self.clock.stopped = True


def simulate(profile: Profile, config: RunConfig, *, num_versions: int | None = None,
             seed: int = 0, max_events: int = 50_000_000, spans: bool = False) -> SimResult:
  """Runs `config.mode` for `num_versions` policy versions (default: the config's budget);
  `spans`: keep every role's busy intervals (`SimResult.spans`)."""
  began = time.perf_counter()
  num_versions = config.num_versions if num_versions is None else int(num_versions)
  if num_versions < 1:
    raise ValueError(f"num_versions={num_versions} must be >= 1")
  clock = Clock(spans=spans)
  host = Host(profile.contention, None if profile.learner_contention is None
              else {"learner": profile.learner_contention})
  rollout_cost, learner_cost = profile.resources(config.mode)
  rng = np.random.default_rng(seed)
  # Room for the largest budget: staleness_max where the controller may raise s.
  capacity = max(config.buffer_capacity or 0, config.min_capacity)
  buffer = VersionedBuffer(group_size=config.group_size,
                           groups_per_version=config.groups_per_version,
                           staleness_threshold=config.staleness_threshold,
                           max_version_gap=config.max_version_gap, capacity=capacity,
                           drop_truncated=getattr(config, "drop_truncated", False),
                           version_gap_policy=getattr(config, "version_gap_policy", "drop"),
                           clock=lambda: clock.now)
  pool = ReplicaPool(clock, profile, rollout_cost, host, rng, on_turn=None, on_finished=None,
                     on_rewarded=None, group_size=config.group_size)
  ready = ReadyGroups(buffer, config.group_size)
  learner_device = Device(clock, "learner", host)
  update_s = update_model(learner_cost, config, profile.buffer_s_per_sample)
  sync_s = profile.sync.transfer_s
  holder: list[Process] = []

  if config.mode == "sync":
    state: dict = {}
    recorder = Recorder(clock, config, profile, buffer, pool, learner_device, num_versions,
                        lambda: {"sim/generate_s": state.get("generate_s", 0.0)})
    body = sync_loop(clock, pool=pool, buffer=buffer, ready=ready, learner=learner_device,
                     update_s=update_s, sync_s=sync_s + rollout_cost.weight_load_s,
                     overhead_s=profile.sync_mode_overhead_s + profile.version_overhead_s,
                     group_size=config.group_size,
                     groups_per_update=config.groups_per_update,
                     trigger_parameter_sync_step=config.trigger_parameter_sync_step,
                     num_versions=num_versions, state=state, process=holder,
                     debug_checks=config.debug_checks,
                     on_version=recorder.on_version)
    rollouter = None
  else:
    rollouter = SimRollouter(clock, pool, buffer, ready, group_size=config.group_size,
                             partial_rollout=config.partial_rollout,
                             partial_strategy=config.partial_strategy,
                             on_group_ready=lambda: holder[0].wake("groups"))
    def publish(version: int) -> None:  # the weight path's latency, then the rollout side
      if profile.handoff_s:
        clock.at(clock.now + profile.handoff_s, rollouter.on_publish, version)
      else:
        rollouter.on_publish(version)

    learner = SimLearner(device=learner_device, ready=ready, publish=publish,
                         update_s=update_s, sync_s=sync_s,
                         overhead_s=profile.version_overhead_s,
                         groups_per_update=config.groups_per_update,
                         trigger_parameter_sync_step=config.trigger_parameter_sync_step,
                         num_versions=num_versions,
                         on_policy=config.asserts_on_policy,
                         max_version_gap=config.max_version_gap,
                         debug_checks=config.debug_checks, on_version=None)

    def counters():
      return {"learner/wait_s": learner.wait_s,
              **{f"rollout/{k}": v for k, v in rollouter.counts.items()}}

    recorder = Recorder(clock, config, profile, buffer, pool, learner_device, num_versions,
                        counters, Handoffs(learner.published_at))
    learner.on_version = lambda version, groups, extra, latency: recorder.on_version(
        version, groups, {}, latency)
    body = learner.run(clock)
  process = Process(clock, body)
  holder.append(process)
  clock.at(profile.startup_s, process.start)
  events = clock.run(max_events)
  if rollouter is not None:
    rollouter.stopped = True
  if len(recorder.records) < num_versions:
    raise RuntimeError(
        f"the simulation stopped after {len(recorder.records)} of {num_versions} versions with "
        f"no event left: {buffer.counts} (a role is waiting for work that never comes)")
  buffer.check_invariants()
  counts = buffer.counts
  return SimResult(recorder.records,
                   summarise(recorder, config, profile, counts, events,
                             time.perf_counter() - began), counts, clock.spans)


def summarise(recorder: Recorder, config: RunConfig, profile: Profile, counts: dict,
              events: int, elapsed_s: float) -> dict:
  last = recorder.records[-1]
  hist = recorder.gap_hist
  entries = int(hist.sum())
  gaps = np.arange(hist.size)
  summary = {k: v for k, v in last.items() if k.startswith(("system/", "rollout/", "reward/",
                                                             "learner/", "sync/", "queue/",
                                                             "lengths/", "sim/"))}
  if profile.shutdown_s:  # the run ends after its servers stop, as a real summary counts it
    wall = last["system/wall_s"] + profile.shutdown_s
    summary.update({"system/wall_s": wall, "system/samples_per_s": last["samples"] / wall,
                    "system/tokens_per_s": last["system/tokens_per_s"] * last["time_s"] / wall})
  summary.update({
      "mode": config.mode, "profile": profile.name, "policy_version": last["policy_version"],
      "learner_step": last["learner_step"], "consumed_samples": recorder.samples,
      "algo/version_gap_mean": float((gaps * hist).sum() / entries) if entries else 0.0,
      "algo/version_gap_max": float(gaps[hist > 0].max()) if entries else 0.0,
      "algo/stale_ratio": float(hist[1:].sum() / entries) if entries else 0.0,
      "algo/partial_ratio": recorder.partial / max(recorder.samples, 1),
      "algo/max_partial_span": float(recorder.max_span),
      "algo/version_gap_hist": {str(g): float(hist[g] / entries) for g in range(hist.size)
                                if hist[g]} if entries else {},
      "algo/version_gap_counts": [int(c) for c in hist],
      "knobs": {"staleness_threshold": config.staleness_threshold,
                "trigger_parameter_sync_step": config.trigger_parameter_sync_step,
                "require_batches": config.require_batches,
                "mini_batch_size": config.mini_batch_size,
                "partial_rollout": config.partial_rollout,
                "max_version_gap": config.max_version_gap, "group_size": config.group_size},
      "sim/events": events, "sim/elapsed_s": elapsed_s,
      "sim/put": counts["put"], "sim/consumed": counts["consumed"],
      "sim/queued": counts["queued"], "sim/dropped": sum(counts["dropped"].values()),
  })
  if recorder.handoffs is not None:
    summary.update(recorder.handoffs.summary())
  if recorder.staleness is not None:  # the s the adaptive controller ended at
    summary["staleness/threshold"] = recorder.staleness.threshold
  return summary
