"""Samples -> a fixed-shape `TrainBatch` (host side, numpy), so the update compiles per shape.

Two layouts of the same samples:
- `collate`: row b holds sample b (prompt then response), right-padded to `seq_len`.
- `pack`: several samples share a row, one after another (first-fit by decreasing length), so the
  update does not spend most of its FLOPs on padding when lengths have a long tail. Positions
  restart at 0 in each sample and `segment_ids` keeps attention within a sample.

Per-token arrays are indexed like `tokens` [R, T]: `response_mask[r, t] = 1` when tokens[r, t] is a
response token, `behaviour_logprobs[r, t]` / `token_versions[r, t]` describe that token, and
`sample_index[r, t]` says which of the batch's N samples it belongs to (per-sample arrays,
`rewards` and `group_index`, are [N], group-major). The model reads tokens[:, :-1] and is scored on
tokens[:, 1:]; a response never starts a segment (prompts are non-empty), so a scored response
token is always predicted from its own sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import struct

from jaxrl_async.types import Sample


@struct.dataclass
class TrainBatch:
  tokens: np.ndarray  # int32 [R, T]
  positions: np.ndarray  # int32 [R, T]: position within the token's own sample (0 on padding)
  segment_ids: np.ndarray  # int32 [R, T]: 1, 2, ... for the samples of a row; 0 on padding
  sample_index: np.ndarray  # int32 [R, T]: the token's sample in [0, N) (0 on padding)
  response_mask: np.ndarray  # float32 [R, T]
  behaviour_logprobs: np.ndarray  # float32 [R, T]
  token_versions: np.ndarray  # int32 [R, T], -1 off the response
  rewards: np.ndarray  # float32 [N]
  group_index: np.ndarray  # int32 [N]: which group of the batch the sample belongs to

  @property
  def num_samples(self) -> int:
    return self.rewards.shape[0]

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]


def bucket_length(length: int, max_length: int, smallest: int = 16) -> int:
  """Smallest power-of-two multiple of `smallest` >= length, capped at max_length.

  Padding every batch to the longest possible sequence wastes most of the update on padding
  when lengths have a long tail; a few buckets keep the number of compiled shapes small.
  """
  if length > max_length:
    raise ValueError(f"sequence of {length} tokens exceeds the maximum {max_length}")
  size = smallest
  while size < length:
    size *= 2
  return min(size, max_length)


def longest_sequence(groups: Sequence[Sequence[Sample]]) -> int:
  return max(len(s.prompt_tokens) + s.num_response_tokens for group in groups for s in group)


def _check_groups(groups, num_groups):
  if not groups:
    raise ValueError("collate/pack need at least one group")
  sizes = {len(group) for group in groups}
  if len(sizes) != 1:
    raise ValueError(f"all groups must have the same size, got sizes {sorted(sizes)}")
  num_groups = len(groups) if num_groups is None else num_groups
  if num_groups < len(groups):
    raise ValueError(f"num_groups={num_groups} is less than the {len(groups)} groups given")
  return num_groups


def _sample_length(sample: Sample, seq_len: int) -> int:
  prompt_len, response_len = len(sample.prompt_tokens), sample.num_response_tokens
  if prompt_len < 1:
    raise ValueError(f"sample {sample.uid} has an empty prompt")
  if prompt_len + response_len > seq_len:
    raise ValueError(
        f"sample {sample.uid}: prompt {prompt_len} + response {response_len} tokens exceed "
        f"seq_len={seq_len}")
  return prompt_len + response_len


def _layout(groups, num_groups: int, seq_len: int, num_rows: int, pad_id: int,
            placement) -> TrainBatch:
  """Writes sample i of `groups` (group-major) at row placement[i][0], offset placement[i][1]."""
  samples = [sample for group in groups for sample in group]
  tokens = np.full((num_rows, seq_len), pad_id, np.int32)
  positions = np.zeros((num_rows, seq_len), np.int32)
  segment_ids = np.zeros((num_rows, seq_len), np.int32)
  sample_index = np.zeros((num_rows, seq_len), np.int32)
  response_mask = np.zeros((num_rows, seq_len), np.float32)
  behaviour = np.zeros((num_rows, seq_len), np.float32)
  versions = np.full((num_rows, seq_len), -1, np.int32)
  segments_in_row = np.zeros((num_rows,), np.int32)
  for i, (sample, (row, offset)) in enumerate(zip(samples, placement, strict=True)):
    prompt_len = len(sample.prompt_tokens)
    start, end = offset + prompt_len, offset + prompt_len + sample.num_response_tokens
    segments_in_row[row] += 1
    tokens[row, offset:start] = sample.prompt_tokens
    tokens[row, start:end] = sample.response_tokens
    positions[row, offset:end] = np.arange(end - offset)
    segment_ids[row, offset:end] = segments_in_row[row]
    sample_index[row, offset:end] = i
    response_mask[row, start:end] = 1.0
    behaviour[row, start:end] = sample.behaviour_logprobs
    versions[row, start:end] = sample.token_versions
  num_samples = num_groups * len(groups[0])
  rewards = np.zeros((num_samples,), np.float32)
  rewards[:len(samples)] = [sample.reward for sample in samples]
  if not np.all(np.isfinite(rewards)):
    bad = [sample.uid for sample in samples if not np.isfinite(sample.reward)]
    raise ValueError(f"samples {bad[:5]} have non-finite rewards; drop them before collate")
  group_index = np.repeat(np.arange(num_groups, dtype=np.int32), len(groups[0]))
  return TrainBatch(tokens=tokens, positions=positions, segment_ids=segment_ids,
                    sample_index=sample_index, response_mask=response_mask,
                    behaviour_logprobs=behaviour, token_versions=versions, rewards=rewards,
                    group_index=group_index)


def collate(groups: Sequence[Sequence[Sample]], seq_len: int, pad_id: int = 0,
            num_groups: int | None = None) -> TrainBatch:
  """groups: G lists of K samples (complete GRPO groups) -> one row per sample, R = N = G*K.

  With `num_groups` > G, empty groups are appended (no response token, reward 0), so a batch
  short of groups keeps the compiled shape and the empty rows add nothing to the loss.
  """
  num_groups = _check_groups(groups, num_groups)
  samples = [sample for group in groups for sample in group]
  for sample in samples:
    _sample_length(sample, seq_len)
  return _layout(groups, num_groups, seq_len, num_groups * len(groups[0]), pad_id,
                 [(b, 0) for b in range(len(samples))])


def packed_rows(needed: int, row_multiple: int = 8) -> int:
  """The row count a packed batch is padded to: `row_multiple` times 2^k or 3 * 2^k (>= needed).

  A handful of shapes per run (so a handful of compilations), at most a third of the rows
  padding past the smallest sizes, and a multiple of the devices a batch is split over when
  row_multiple is.
  """
  if needed < 1 or row_multiple < 1:
    raise ValueError(f"needed and row_multiple must be >= 1, got {needed}, {row_multiple}")
  units = -(-needed // row_multiple)
  size = 1
  while size < units:
    if size * 3 // 2 >= units and size >= 2:
      return row_multiple * (size * 3 // 2)
    size *= 2
  return row_multiple * size


def row_counts(num_samples: int, row_length: int, shortest_sample: int,
               row_multiple: int = 8) -> list[int]:
  """Every row count `pack` can give a batch of `num_samples` samples, none shorter than
  `shortest_sample` tokens, in rows of `row_length`: `packed_rows(n)` for n from the fewest
  rows they fit in (floor(row_length / shortest_sample) samples a row) to one row each."""
  for name, value in (("num_samples", num_samples), ("row_length", row_length),
                      ("shortest_sample", shortest_sample)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"row_counts: {name}={value!r} must be an int >= 1")
  if shortest_sample > row_length:
    raise ValueError(f"row_counts: shortest_sample={shortest_sample} exceeds "
                     f"row_length={row_length}")
  fewest = -(-num_samples // (row_length // shortest_sample))
  return sorted({packed_rows(n, row_multiple) for n in range(fewest, num_samples + 1)})


def blank_batch(num_rows: int, row_length: int, num_samples: int) -> TrainBatch:
  """A batch of the given shape holding nothing (no response token, zero rewards): the shape
  to compile an update for."""
  def zeros(dtype):
    return np.zeros((num_rows, row_length), dtype)

  return TrainBatch(tokens=zeros(np.int32), positions=zeros(np.int32),
                    segment_ids=zeros(np.int32), sample_index=zeros(np.int32),
                    response_mask=zeros(np.float32), behaviour_logprobs=zeros(np.float32),
                    token_versions=np.full((num_rows, row_length), -1, np.int32),
                    rewards=np.zeros((num_samples,), np.float32),
                    group_index=np.zeros((num_samples,), np.int32))


def pack(groups: Sequence[Sequence[Sample]], row_length: int, pad_id: int = 0,
         num_groups: int | None = None, row_multiple: int = 8) -> TrainBatch:
  """groups: G lists of K samples -> rows of `row_length` tokens holding several samples each.

  First-fit decreasing: samples in order of decreasing length go to the first row with room.
  The row count is `packed_rows(rows used, row_multiple)`. Per-sample arrays are as in
  `collate` (N = num_groups * K, empty groups appended), so the two layouts give the same loss.
  """
  num_groups = _check_groups(groups, num_groups)
  samples = [sample for group in groups for sample in group]
  lengths = [_sample_length(sample, row_length) for sample in samples]
  free: list[int] = []  # room left in each row
  placement: list[tuple[int, int]] = [(0, 0)] * len(samples)
  for i in sorted(range(len(samples)), key=lambda i: -lengths[i]):
    row = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
    if row == len(free):
      free.append(row_length)
    placement[i] = (row, row_length - free[row])
    free[row] -= lengths[i]
  return _layout(groups, num_groups, row_length, packed_rows(len(free), row_multiple), pad_id,
                 placement)
