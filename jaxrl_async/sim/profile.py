"""What the simulator models: the roles' compute, as plain data (a JSON object per profile).

A `Profile` holds no scheduling logic; the schedule comes from the real buffer and the role
loops that `simulator.py` drives. Times are seconds of the virtual clock.

- rollout: `replicas` data-parallel engines of `slots` decode slots each; a decode step with n
  active slots takes `decode_curve(n)` s (piecewise linear through the given (n, s) points);
  prefill costs `prefill_s_per_token` per prompt token (once per group: its members share the
  prompt) and per re-prefilled token after a weight swap ('reprefill'); `weight_load_s` to load
  new weights. Response lengths follow `response_length` (kind 'groups': measured groups drawn
  whole, as `--profile_from` fits them); prompts have `prompt_tokens` tokens.
- reward: `workers` scorers, each sample's latency drawn from `reward_latency`; a sample fails
  with probability `fail_prob` (its group is dropped as `reward_failed` by the buffer).
- learner: an update of T response tokens takes `per_update_s + T * s_per_token`; a window's
  later updates with the 'recompute' anchor add `T * recompute_s_per_token`; modes listed in
  `old_logprob_pass_modes` add `T * old_logprob_s_per_token` per update (a separate
  old-logprob forward pass, as verl's colocated baseline runs).
- sync: publishing a version takes `fixed_s + bytes / bandwidth_bytes_per_s` on the learner.
- host: `contention` > 0 makes the roles share one host (threads of one process): while k
  roles compute at once each runs at speed 1 / (1 + contention * (k - 1)).
  `learner_contention`, if set, is the learner's own (rollout replicas keep `contention`): roles
  laid out unevenly on the cores slow each other down unevenly (the processes backend's learner
  on every core beside a rollout server pinned to one).
- colocated: the sync baseline's own rollout replicas and learner costs when it runs on all
  devices (verl's colocated baseline); fields missing there fall back to the ones above.
- sync_mode_overhead_s: host time per version between the sync baseline's stages (sync only).
- version_overhead_s: host time per version in every mode, outside every role's busy time
  (records, bookkeeping): between the stages in sync, on the learner's thread after publishing
  in the async modes.
- handoff_s: the hand-off latency of the async modes' weight path: a version the learner
  publishes reaches the rollout side this long after its publish ends (the transfer to another
  process, the rollouter's poll for it); a delay, not work: no role is busy for it.
- buffer_s_per_sample: host time per consumed sample on the learner's thread in the async
  modes (samples crossing into the learner's process: decoding, assembly), beside the sync run's
  in-process buffer whose cost is already in its fitted times.
- startup_s: time before the first version starts (tracing, compilation; the async backends'
  servers starting).
- shutdown_s: time after the last version until the run ends (the servers stopping); counts in
  the summary's wall time and samples/s, as in a real run's summary.
- token_block: real tokens per simulated token entry (1 = exact per-token versions; a larger
  block keeps long responses cheap to simulate, versions then change only at block edges).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import numpy as np

LENGTH_KINDS = ("fixed", "geometric", "lognormal", "empirical", "groups")
LATENCY_KINDS = ("fixed", "lognormal")


def _fail(field: str, value: Any, allowed: str) -> None:
  raise ValueError(f"profile field {field}={value!r} is invalid; allowed: {allowed}")


def _positive(field: str, value: Any, *, zero_ok: bool = False) -> float:
  ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
  if not ok or value < 0 or (value == 0 and not zero_ok):
    _fail(field, value, "a finite number >= 0" if zero_ok else "a finite number > 0")
  return float(value)


def _count(field: str, value: Any) -> int:
  if not isinstance(value, int) or isinstance(value, bool) or value < 1:
    _fail(field, value, "an int >= 1")
  return value


@dataclasses.dataclass(frozen=True)
class LengthModel:
  """Response lengths in tokens, clipped to [min, max]; a length of `max` is a truncation."""

  kind: str = "geometric"
  min: int = 1
  max: int = 25
  value: float = 8.0  # fixed: the length
  ratio: float = 0.75  # geometric: P(L = k) ∝ ratio**k on [min, max]
  median: float = 1000.0  # lognormal
  sigma: float = 1.0  # lognormal
  values: tuple = ()  # empirical: lengths ...
  weights: tuple = ()  # ... and their weights (uniform if empty)
  groups: tuple = ()  # groups: measured groups' member lengths, each drawn whole

  def __post_init__(self):
    if self.kind not in LENGTH_KINDS:
      _fail("response_length.kind", self.kind, str(LENGTH_KINDS))
    _count("response_length.min", self.min)
    if not isinstance(self.max, int) or self.max < self.min:
      _fail("response_length.max", self.max, f"an int >= min={self.min}")
    if self.kind == "geometric":
      _positive("response_length.ratio", self.ratio)
    if self.kind == "lognormal":
      _positive("response_length.median", self.median)
      _positive("response_length.sigma", self.sigma, zero_ok=True)
    if self.kind == "empirical" and (not self.values or (
        self.weights and len(self.weights) != len(self.values))):
      _fail("response_length.values", self.values, "a non-empty list (weights: same length)")
    if self.kind == "groups" and (not self.groups or not all(
        isinstance(g, tuple) and g and all(isinstance(n, int) and n >= 0 for n in g)
        for g in self.groups)):
      _fail("response_length.groups", self.groups,
            "a non-empty list of non-empty lists of lengths (ints >= 0)")

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    if self.kind == "fixed":
      lengths = np.full(n, self.value)
    elif self.kind == "geometric":
      support = np.arange(self.min, self.max + 1)
      logits = (support - self.min) * math.log(self.ratio)
      probs = np.exp(logits - logits.max())
      lengths = rng.choice(support, size=n, p=probs / probs.sum())
    elif self.kind == "lognormal":
      lengths = self.median * np.exp(self.sigma * rng.standard_normal(n))
    elif self.kind == "groups":  # a random member of a random group: the lengths' marginal
      sizes = np.fromiter((len(g) for g in self.groups), np.int64, len(self.groups))
      flat = np.fromiter((x for g in self.groups for x in g), np.int64, int(sizes.sum()))
      pick = rng.integers(len(sizes), size=n)
      offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
      lengths = flat[offsets[pick] + (rng.random(n) * sizes[pick]).astype(np.int64)]
    else:
      weights = np.asarray(self.weights or [1.0] * len(self.values), np.float64)
      lengths = rng.choice(np.asarray(self.values, np.float64), size=n, p=weights / weights.sum())
    return np.clip(np.rint(lengths), self.min, self.max).astype(np.int64)

  def sample_groups(self, rng: np.random.Generator, count: int, size: int) -> list[list[int]]:
    """`count` groups of `size` lengths. Kind 'groups' draws measured groups whole (members of
    one prompt have alike lengths: a group finishes with its longest member); a measured group
    of another size gives `size` of its members, drawn with replacement. Other kinds draw
    every member on its own."""
    if self.kind != "groups":
      return self.sample(rng, count * size).reshape(count, size).tolist()
    pick = rng.integers(len(self.groups), size=count)
    if all(len(g) == size for g in self.groups):
      rows = np.asarray(self.groups, np.int64)[pick]
    else:
      rows = np.asarray([[g[i] for i in rng.integers(len(g), size=size)]
                         for g in (self.groups[j] for j in pick)], np.int64)
    return np.clip(rows, self.min, self.max).tolist()

  def mean(self, draws: int = 200_000) -> float:
    return float(self.sample(np.random.default_rng(0), draws).mean())


@dataclasses.dataclass(frozen=True)
class LatencyModel:
  kind: str = "fixed"
  value: float = 0.0  # fixed
  median: float = 0.0  # lognormal
  sigma: float = 0.0

  def __post_init__(self):
    if self.kind not in LATENCY_KINDS:
      _fail("reward.latency.kind", self.kind, str(LATENCY_KINDS))
    _positive("reward.latency.value", self.value, zero_ok=True)
    _positive("reward.latency.median", self.median, zero_ok=True)
    _positive("reward.latency.sigma", self.sigma, zero_ok=True)

  def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
    if self.kind == "fixed":
      return np.full(n, self.value)
    return self.median * np.exp(self.sigma * rng.standard_normal(n))


@dataclasses.dataclass(frozen=True)
class RolloutCost:
  replicas: int = 1
  slots: int = 64
  decode_curve: tuple = ((1, 1e-3),)  # (active slots, seconds per decode step) points
  prefill_s_per_token: float = 0.0
  weight_load_s: float = 0.0

  def __post_init__(self):
    _count("rollout.replicas", self.replicas)
    _count("rollout.slots", self.slots)
    points = self.decode_curve
    if not points or any(len(p) != 2 for p in points):
      _fail("rollout.decode_curve", points, "a non-empty list of [active_slots, seconds]")
    for n, seconds in points:
      _positive("rollout.decode_curve active_slots", n)
      _positive("rollout.decode_curve seconds", seconds)
    _positive("rollout.prefill_s_per_token", self.prefill_s_per_token, zero_ok=True)
    _positive("rollout.weight_load_s", self.weight_load_s, zero_ok=True)

  def step_table(self, slots: int) -> np.ndarray:
    """Seconds per decode step for 0..slots active slots."""
    xs, ys = zip(*sorted((float(n), float(s)) for n, s in self.decode_curve))
    return np.interp(np.arange(slots + 1, dtype=np.float64), xs, ys)


@dataclasses.dataclass(frozen=True)
class LearnerCost:
  per_update_s: float = 0.0
  s_per_token: float = 0.0
  recompute_s_per_token: float = 0.0
  old_logprob_s_per_token: float = 0.0
  old_logprob_pass_modes: tuple = ()

  def __post_init__(self):
    for name in ("per_update_s", "s_per_token", "recompute_s_per_token",
                 "old_logprob_s_per_token"):
      _positive(f"learner.{name}", getattr(self, name), zero_ok=True)


@dataclasses.dataclass(frozen=True)
class SyncCost:
  fixed_s: float = 0.0
  bytes: float = 0.0
  bandwidth_bytes_per_s: float = 1e12

  def __post_init__(self):
    _positive("sync.fixed_s", self.fixed_s, zero_ok=True)
    _positive("sync.bytes", self.bytes, zero_ok=True)
    _positive("sync.bandwidth_bytes_per_s", self.bandwidth_bytes_per_s)

  @property
  def transfer_s(self) -> float:
    return self.fixed_s + self.bytes / self.bandwidth_bytes_per_s


@dataclasses.dataclass(frozen=True)
class Profile:
  name: str = "profile"
  prompt_tokens: int = 16
  response_length: LengthModel = LengthModel()
  rollout: RolloutCost = RolloutCost()
  reward_workers: int = 1
  reward_latency: LatencyModel = LatencyModel()
  reward_fail_prob: float = 0.0
  learner: LearnerCost = LearnerCost()
  sync: SyncCost = SyncCost()
  contention: float = 0.0
  learner_contention: float | None = None
  colocated_rollout: RolloutCost | None = None
  colocated_learner: LearnerCost | None = None
  sync_mode_overhead_s: float = 0.0
  version_overhead_s: float = 0.0
  handoff_s: float = 0.0
  buffer_s_per_sample: float = 0.0
  startup_s: float = 0.0
  shutdown_s: float = 0.0
  token_block: int = 1
  notes: tuple = ()  # every assumed number and its source, in words

  def __post_init__(self):
    _count("prompt_tokens", self.prompt_tokens)
    _count("reward_workers", self.reward_workers)
    _count("token_block", self.token_block)
    if not 0.0 <= self.reward_fail_prob <= 1.0:
      _fail("reward_fail_prob", self.reward_fail_prob, "a probability in [0, 1]")
    _positive("contention", self.contention, zero_ok=True)
    if self.learner_contention is not None:
      _positive("learner_contention", self.learner_contention, zero_ok=True)
    for name in ("sync_mode_overhead_s", "version_overhead_s", "handoff_s",
                 "buffer_s_per_sample", "startup_s", "shutdown_s"):
      _positive(name, getattr(self, name), zero_ok=True)

  def resources(self, mode: str) -> tuple[RolloutCost, LearnerCost]:
    """The rollout and learner costs a mode runs with (sync: the colocated ones, if given)."""
    if mode == "sync":
      return self.colocated_rollout or self.rollout, self.colocated_learner or self.learner
    return self.rollout, self.learner

  def to_dict(self) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(self)))

  def brief_dict(self) -> dict[str, Any]:
    """`to_dict` with measured groups of lengths described in words, for printing."""
    data = self.to_dict()
    groups = self.response_length.groups
    if groups:
      flat = np.asarray([n for g in groups for n in g])
      data["response_length"]["groups"] = (
          f"{len(groups)} measured groups: mean {flat.mean():.2f}, p50 "
          f"{np.quantile(flat, 0.5):.0f}, p90 {np.quantile(flat, 0.9):.0f}, max {flat.max()}")
    return data


_NESTED = {"response_length": LengthModel, "rollout": RolloutCost, "reward_latency": LatencyModel,
           "learner": LearnerCost, "sync": SyncCost, "colocated_rollout": RolloutCost,
           "colocated_learner": LearnerCost}


def _tuples(value):
  return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _build(cls, data: dict[str, Any], where: str):
  if not isinstance(data, dict):
    raise ValueError(f"profile field {where} must be an object, got {data!r}")
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ValueError(f"profile {where or 'top level'} has unknown fields {unknown}; allowed: "
                     f"{sorted(names)}")
  return cls(**{k: _tuples(v) for k, v in data.items()})


def profile_from_dict(data: dict[str, Any]) -> Profile:
  data = {k: v for k, v in data.items() if not k.startswith("_")}  # "_source" etc.: comments
  fields = {}
  for name, value in data.items():
    if name in _NESTED and value is not None:
      value = _build(_NESTED[name], {k: v for k, v in value.items() if not k.startswith("_")},
                     name)
    fields[name] = value
  return _build(Profile, fields, "")


def load_profile(path: str | os.PathLike) -> Profile:
  with open(path, encoding="utf-8") as f:
    return profile_from_dict(json.load(f))


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(profile.to_dict(), f, indent=1)
