"""Group assembly: why a sample (and so its group) is dropped, and the group records.

A group is released to the learner only whole. If any member carries a failure, every member
is counted under one reason, the first of `GROUP_DROP_PRIORITY` found among the members:

  rollout_failed  finish_reason 'aborted' (generation never finished)
  reward_failed   reward_status 'failed', or a reward that was never set ('pending'), or a
                  non-finite reward under status 'ok' (a NaN reward is counted,
                  never trained on)
  reward_timeout  reward_status 'timeout'
  truncated       finish_reason 'length', only when the buffer drops truncated samples

The order follows the pipeline: a sample whose generation failed has no meaningful reward, and a
reward failure outranks a policy choice (truncation).
"""

from __future__ import annotations

import bisect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from jaxrl_async.types import FinishReason, RewardStatus, Sample

GROUP_DROP_PRIORITY = ("rollout_failed", "reward_failed", "reward_timeout", "truncated")
NO_DROP = len(GROUP_DROP_PRIORITY)  # rank of a sample with nothing wrong

_FINISH_REASONS = frozenset(r.value for r in FinishReason)
_REWARD_STATUSES = frozenset(r.value for r in RewardStatus)

GroupFilter = Callable[[list[Sample]], bool]


def sample_drop_rank(sample: Sample, drop_truncated: bool) -> int:
  """Index into GROUP_DROP_PRIORITY of the sample's own failure, or NO_DROP."""
  finish = sample.finish_reason
  status = sample.reward_status
  if finish not in _FINISH_REASONS:
    raise ValueError(f"Sample.finish_reason={finish!r} is not one of {sorted(_FINISH_REASONS)}")
  if status not in _REWARD_STATUSES:
    raise ValueError(f"Sample.reward_status={status!r} is not one of {sorted(_REWARD_STATUSES)}")
  if finish == "aborted":
    return 0
  if status == "timeout":
    return 2
  if status != "ok" or not math.isfinite(sample.reward):  # 'failed', 'pending', or NaN reward
    return 1
  if drop_truncated and finish == "length":
    return 3
  return NO_DROP


def drop_uniform_reward(group: Sequence[Sample]) -> bool:
  """Group filter of DAPO's dynamic sampling: keep a group only if its rewards differ.

  A group whose rewards are all equal has zero GRPO advantage everywhere and teaches nothing.
  Returns True to keep. Rewards are compared exactly (they are usually 0/1 verifier scores);
  a group of size 1 is always uniform, so this filter drops every such group.
  """
  first = group[0].reward
  return any(sample.reward != first for sample in group[1:])


class PartialGroup:
  """A group whose members are still arriving; `slots[i]` is member i (index_in_group)."""

  __slots__ = ("admitted", "count", "drop_rank", "group_id", "min_version", "slots")

  def __init__(self, group_id: int, group_size: int, admitted: bool):
    self.group_id = group_id
    self.slots: list[Sample | None] = [None] * group_size
    self.count = 0
    self.admitted = admitted
    self.drop_rank = NO_DROP
    self.min_version: int | None = None

  def add(self, index: int, sample: Sample, drop_rank: int, min_version: int | None) -> None:
    self.slots[index] = sample
    self.count += 1
    self.drop_rank = min(self.drop_rank, drop_rank)
    if min_version is not None and (self.min_version is None or min_version < self.min_version):
      self.min_version = min_version

  def members(self) -> list[Sample]:
    return [sample for sample in self.slots if sample is not None]


class ReadyGroup:
  """A whole group that passed the drop checks and the filter, waiting for the learner."""

  __slots__ = ("admitted", "min_version", "samples")

  def __init__(self, samples: list[Sample], admitted: bool, min_version: int | None):
    self.samples = samples
    self.admitted = admitted
    self.min_version = min_version  # oldest token version in the group; None: no tokens

  def is_stale(self, learner_version: int, max_version_gap: int | None) -> bool:
    return (max_version_gap is not None and self.min_version is not None
            and learner_version - self.min_version > max_version_gap)


def sample_min_version(sample: Sample) -> int | None:
  """The oldest token version (`Sample.min_version`, which a subclass may know without a pass
  over the array), None for an empty response."""
  return sample.min_version if sample.token_versions.size else None


def index_in_group(sample: Sample, group_size: int) -> int:
  index = sample.meta.get("index_in_group", 0)
  if type(index) is int and 0 <= index < group_size:  # the common case, without the ABC check
    return index
  if isinstance(index, numbers.Integral) and not isinstance(index, bool):
    index = int(index)
  if not isinstance(index, int) or not 0 <= index < group_size:
    raise ValueError(f"Sample.meta['index_in_group']={index!r} must be an int in "
                     f"[0, {group_size}) (group {sample.group_id})")
  return index


# ---- JSON form of samples (checkpoints) ---------------------------------------------------
def encode_sample(sample: Sample) -> dict[str, Any]:
  """Sample.to_dict, with a non-finite reward written as a string so the state is strict JSON."""
  data = sample.to_dict()
  if not math.isfinite(data["reward"]):
    data["reward"] = repr(data["reward"])  # 'nan', 'inf', '-inf'
  return data


def decode_sample(data: dict[str, Any]) -> Sample:
  data = dict(data)
  data["reward"] = float(data["reward"])
  return Sample.from_dict(data)


def take_oldest(ready: list, num_groups: int) -> tuple[list, list]:
  """(taken, kept): the `num_groups` ready groups with the oldest tokens, oldest first (arrival
  order among equals; a group without tokens counts as newest), and the rest in their order.
  A group that waited for its longest member arrives behind newer ones; taking it first keeps
  it within the age bound instead of dropping it later as stale (the long responses would be
  the ones lost)."""
  newest = math.inf
  order = sorted(range(len(ready)), key=lambda i: (
      newest if ready[i].min_version is None else ready[i].min_version))
  if num_groups >= len(ready):
    return [ready[i] for i in order], []
  chosen = set(order[:num_groups])
  return [ready[i] for i in order[:num_groups]], [
      group for i, group in enumerate(ready) if i not in chosen]


class AgeBoundWait:
  """version_gap_policy 'wait': when a take must wait for a group not yet whole.

  A group whose oldest token has version m may be consumed up to learner version
  m + max_version_gap. The take that closes learner version L (the one that brings the groups
  taken at L to `groups_per_version`) waits while a group that is not yet whole may hold a
  token of version <= L - max_version_gap: after it that group could only be dropped as stale.
  Earlier takes of the version do not wait (the group may be whole by the last one), and the
  oldest groups are taken first (`take_oldest`).

  Two kinds of group are not yet whole: partly arrived ones (their oldest arrived token is
  known; a member still out is assumed no older, as a group's members start together) and
  admitted ones with no member arrived yet, whose tokens are no older than the rollout version
  they were admitted at. Those admission versions are kept. An admission that names its group
  (every Rollouter's does) is retired by that group's first arrival. One that does not is
  retired by some group's first arrival: the newest unnamed admission not newer than the
  group's oldest token (the one it most likely came from). That guess can retire the wrong
  admission, for instance when a group admitted just before a weight swap starts after it,
  and leave an old version standing for a newer group, which holds takes it should not.
  The drop at take stays the hard bound, for what these estimates miss.
  """

  __slots__ = ("by_group", "groups_per_version", "in_flight", "max_version_gap", "taken",
               "version")

  def __init__(self, max_version_gap: int, groups_per_version: int):
    self.max_version_gap = max_version_gap
    self.groups_per_version = groups_per_version
    self.version, self.taken = -1, 0  # groups taken at learner version `version`
    self.by_group: dict[int, int] = {}  # named admissions with nothing arrived: id -> version
    self.in_flight: list[int] = []  # versions of the unnamed ones with nothing arrived, sorted

  def admitted(self, rollout_version: int, group_id: int | None = None) -> None:
    if group_id is None:
      self.in_flight.append(rollout_version)  # versions only grow: stays sorted
    else:
      self.by_group[group_id] = rollout_version

  def started(self, group_id: int, min_version: int | None) -> None:
    if self.by_group.pop(group_id, None) is not None or not self.in_flight:
      return
    index = len(self.in_flight) - 1
    if min_version is not None:
      index = max(0, bisect.bisect_right(self.in_flight, min_version) - 1)
    del self.in_flight[index]

  def holds(self, partial_groups, learner_version: int, num_groups: int) -> bool:
    taken = self.taken if learner_version == self.version else 0
    if taken + num_groups < self.groups_per_version:
      return False
    edge = learner_version - self.max_version_gap
    if self.in_flight and self.in_flight[0] <= edge:
      return True
    if any(version <= edge for version in self.by_group.values()):
      return True
    return any(group.min_version is not None and group.min_version <= edge
               for group in partial_groups)

  def took(self, learner_version: int, num_groups: int) -> None:
    if learner_version != self.version:
      self.version, self.taken = learner_version, 0
    self.taken += num_groups


def split_stale(ready: list, learner_version: int, max_version_gap: int) -> tuple[list, list]:
  """(fresh, stale) ready groups, each in its order: a group is stale when any of its tokens
  is more than `max_version_gap` versions older than `learner_version`."""
  fresh, stale = [], []
  for group in ready:
    (stale if group.is_stale(learner_version, max_version_gap) else fresh).append(group)
  return fresh, stale
