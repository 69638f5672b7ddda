"""Sample and buffer builders shared by the buffer tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxrl_async.buffer import VersionedBuffer
from jaxrl_async.types import Sample

# Independent restatement of the documented group drop order (groups.py).
EXPECTED_PRIORITY = ("rollout_failed", "reward_failed", "reward_timeout", "truncated")


def make_sample(group_id: int, index: int, group_size: int,
                token_versions: Sequence[int] = (0, 0), *, reward: float = 1.0,
                reward_status: str = "ok", finish_reason: str = "eos",
                prompt_id: int | None = None) -> Sample:
  num_tokens = len(token_versions)
  return Sample(
      prompt_id=group_id if prompt_id is None else prompt_id, group_id=group_id,
      group_size=group_size, prompt_tokens=np.array([1, 2, 3], np.int32),
      response_tokens=np.arange(num_tokens, dtype=np.int32) + 10,
      behaviour_logprobs=np.full((num_tokens,), -0.5, np.float32),
      token_versions=np.asarray(token_versions, np.int32), finish_reason=finish_reason,
      reward=reward, reward_status=reward_status, meta={"index_in_group": index})


def make_group(group_id: int, group_size: int, version: int = 0,
               rewards: Sequence[float] | None = None, **kwargs: Any) -> list[Sample]:
  rewards = rewards if rewards is not None else [float(i % 2) for i in range(group_size)]
  return [make_sample(group_id, i, group_size, (version, version), reward=rewards[i], **kwargs)
          for i in range(group_size)]


def make_buffer(**overrides: Any) -> VersionedBuffer:
  config = dict(group_size=2, groups_per_version=2, staleness_threshold=0.0,
                max_version_gap=None, capacity=None)
  config.update(overrides)
  if config["capacity"] is None:
    budget = int(np.floor((1 + config["staleness_threshold"]) * config["groups_per_version"]))
    config["capacity"] = config["group_size"] * budget
  return VersionedBuffer(**config)


def expected_drop_reason(samples: Sequence[Sample], drop_truncated: bool) -> str | None:
  """The reason a whole group is dropped for, restated from the documented rules."""
  found = set()
  for sample in samples:
    if sample.finish_reason == "aborted":
      found.add("rollout_failed")
    elif sample.reward_status == "timeout":
      found.add("reward_timeout")
    elif sample.reward_status != "ok" or not np.isfinite(sample.reward):
      found.add("reward_failed")
    elif drop_truncated and sample.finish_reason == "length":
      found.add("truncated")
  for reason in EXPECTED_PRIORITY:
    if reason in found:
      return reason
  return None


def put_group(buffer: VersionedBuffer, samples: Sequence[Sample], timeout: float = 1.0) -> None:
  for sample in samples:
    buffer.put(sample, timeout)
