"""The one record that crosses role boundaries, and the batch the learner trains on.

A `Sample` is one response to one prompt. It carries its whole provenance so that staleness,
partial rollouts and drops are observable after the fact:

- `token_versions[t]` is the policy version that generated response token t;
- `behaviour_logprobs[t]` is log pi_behaviour(token t | prefix) under that version, at the
  sampling temperature;
- `timestamps` holds one wall-clock time (time.time()) per stage it passed, and for each policy
  version that drew some of its tokens, when the decode call that drew the first of them began
  (`version_began_key`).

Samples are plain host data (numpy arrays, Python scalars): they are moved between threads,
processes and checkpoints, never traced by jax.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

# Stages a sample passes, in order; each gets a timestamp in `Sample.timestamps`.
STAGES = ("created", "generated", "rewarded", "enqueued", "consumed")
_VERSION_BEGAN = "began_v"


def version_began_key(version: int) -> str:
  """The `timestamps` key of when the sample's first token of `version` began to be drawn."""
  return f"{_VERSION_BEGAN}{int(version)}"


class RewardStatus(str, enum.Enum):
  PENDING = "pending"
  OK = "ok"
  FAILED = "failed"  # the reward function raised
  TIMEOUT = "timeout"  # the reward function did not answer in time


class FinishReason(str, enum.Enum):
  EOS = "eos"  # the end token was sampled
  LENGTH = "length"  # max response length reached (counted as `truncated` where dropped)
  ABORTED = "aborted"  # generation stopped (shutdown / failure) before it finished


# Every reason a sample may fail to reach the learner.
DROP_REASONS = (
    "stale",
    "reward_failed",
    "reward_timeout",
    "rollout_failed",
    "truncated",
    "filtered_group",
    "shutdown",
)


@dataclasses.dataclass
class Sample:
  """One response with its provenance. Arrays are numpy, length R = len(response_tokens)."""

  prompt_id: int
  group_id: int
  group_size: int
  prompt_tokens: np.ndarray  # int32 [P]
  response_tokens: np.ndarray = dataclasses.field(
      default_factory=lambda: np.zeros((0,), np.int32))  # int32 [R]
  behaviour_logprobs: np.ndarray = dataclasses.field(
      default_factory=lambda: np.zeros((0,), np.float32))  # float32 [R]
  token_versions: np.ndarray = dataclasses.field(
      default_factory=lambda: np.zeros((0,), np.int32))  # int32 [R]
  finish_reason: str = FinishReason.ABORTED.value
  reward: float = float("nan")
  reward_status: str = RewardStatus.PENDING.value
  retries: int = 0  # reward retries spent on this sample
  interruptions: int = 0  # times generation was paused by a weight swap (partial rollout)
  timestamps: dict[str, float] = dataclasses.field(default_factory=dict)
  # Task data needed by the reward function (e.g. the reference answer), JSON-serialisable.
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.prompt_tokens = np.asarray(self.prompt_tokens, np.int32)
    self.response_tokens = np.asarray(self.response_tokens, np.int32)
    self.behaviour_logprobs = np.asarray(self.behaviour_logprobs, np.float32)
    self.token_versions = np.asarray(self.token_versions, np.int32)
    if self.group_size < 1:
      raise ValueError(f"group_size must be >= 1, got {self.group_size}")
    n = len(self.response_tokens)
    if len(self.behaviour_logprobs) != n or len(self.token_versions) != n:
      raise ValueError(
          "response_tokens, behaviour_logprobs and token_versions must have one entry per "
          f"response token; got {n}, {len(self.behaviour_logprobs)}, {len(self.token_versions)}")

  # ---- provenance -------------------------------------------------------------------------
  @property
  def uid(self) -> tuple[int, int]:
    """(group_id, index in group) is unique per run; prompt_id may repeat across epochs."""
    return (self.group_id, int(self.meta.get("index_in_group", 0)))

  @property
  def num_response_tokens(self) -> int:
    return len(self.response_tokens)

  @property
  def min_version(self) -> int:
    """Oldest policy version among the response tokens (-1 for an empty response)."""
    return int(self.token_versions.min()) if len(self.token_versions) else -1

  @property
  def max_version(self) -> int:
    return int(self.token_versions.max()) if len(self.token_versions) else -1

  @property
  def version_span(self) -> int:
    """Number of weight swaps the trajectory spans (0 for a single-version response)."""
    return self.max_version - self.min_version if len(self.token_versions) else 0

  @property
  def is_partial(self) -> bool:
    return self.version_span > 0

  def max_version_gap(self, learner_version: int) -> int:
    """Age of the oldest token relative to the learner's current version."""
    return learner_version - self.min_version if len(self.token_versions) else 0

  def stamp(self, stage: str, when: float) -> None:
    if stage not in STAGES:
      raise ValueError(f"unknown stage {stage!r}; stages are {STAGES}")
    self.timestamps[stage] = float(when)

  def stamp_version_began(self, version: int, when: float) -> None:
    """When the decode call that drew this sample's first token of `version` began; the first
    stamp of a version is kept (a resumed sample draws more of it later)."""
    self.timestamps.setdefault(version_began_key(version), float(when))

  def versions_began(self) -> dict[int, float]:
    """policy version -> when this sample's first token of it began to be drawn."""
    n = len(_VERSION_BEGAN)
    return {int(key[n:]): when for key, when in self.timestamps.items()
            if key.startswith(_VERSION_BEGAN)}

  # ---- serialisation (checkpoints, queues between processes) ------------------------------
  def to_dict(self) -> dict[str, Any]:
    """JSON-serialisable form (plain Python ints / floats / lists)."""
    return {
        "prompt_id": int(self.prompt_id),
        "group_id": int(self.group_id),
        "group_size": int(self.group_size),
        "prompt_tokens": self.prompt_tokens.tolist(),
        "response_tokens": self.response_tokens.tolist(),
        "behaviour_logprobs": self.behaviour_logprobs.tolist(),
        "token_versions": self.token_versions.tolist(),
        "finish_reason": str(self.finish_reason),
        "reward": float(self.reward),
        "reward_status": str(self.reward_status),
        "retries": int(self.retries),
        "interruptions": int(self.interruptions),
        "timestamps": {k: float(v) for k, v in self.timestamps.items()},
        "meta": dict(self.meta),
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Sample:
    return cls(**d)


@dataclasses.dataclass(frozen=True)
class PolicyVersion:
  """A published set of weights: `version` counts parameter syncs, `learner_step` updates."""

  version: int
  learner_step: int
  published_at: float
