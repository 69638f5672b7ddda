"""Samples -> a fixed-shape `TrainBatch` (host side, numpy), so the update compiles once.

Layout: row b holds prompt then response, right-padded to `seq_len`. Per-token arrays are indexed
like `tokens`: `response_mask[b, t] = 1` when tokens[b, t] is a response token, and
`behaviour_logprobs[b, t]` / `token_versions[b, t]` describe that token. The model reads
tokens[:, :-1] and is scored on tokens[:, 1:], so a response never starts at t = 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import struct

from jaxrl_async.types import Sample


@struct.dataclass
class TrainBatch:
  tokens: np.ndarray  # int32 [B, T]
  response_mask: np.ndarray  # float32 [B, T]
  behaviour_logprobs: np.ndarray  # float32 [B, T]
  token_versions: np.ndarray  # int32 [B, T], -1 off the response
  rewards: np.ndarray  # float32 [B]
  group_index: np.ndarray  # int32 [B]: which group of the batch the row belongs to

  @property
  def batch_size(self) -> int:
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


def collate(groups: Sequence[Sequence[Sample]], seq_len: int, pad_id: int = 0,
            num_groups: int | None = None) -> TrainBatch:
  """groups: G lists of K samples (complete GRPO groups) -> a TrainBatch of B = G*K rows.

  With `num_groups` > G, empty groups are appended (no response token, reward 0), so a batch
  short of groups keeps the compiled shape and the empty rows add nothing to the loss.
  """
  if not groups:
    raise ValueError("collate needs at least one group")
  sizes = {len(group) for group in groups}
  if len(sizes) != 1:
    raise ValueError(f"all groups must have the same size, got sizes {sorted(sizes)}")
  num_groups = len(groups) if num_groups is None else num_groups
  if num_groups < len(groups):
    raise ValueError(f"num_groups={num_groups} is less than the {len(groups)} groups given")
  rows = [sample for group in groups for sample in group]
  batch = num_groups * len(groups[0])
  tokens = np.full((batch, seq_len), pad_id, np.int32)
  response_mask = np.zeros((batch, seq_len), np.float32)
  behaviour = np.zeros((batch, seq_len), np.float32)
  versions = np.full((batch, seq_len), -1, np.int32)
  for b, sample in enumerate(rows):
    prompt_len, response_len = len(sample.prompt_tokens), sample.num_response_tokens
    if prompt_len < 1:
      raise ValueError(f"sample {sample.uid} has an empty prompt")
    if prompt_len + response_len > seq_len:
      raise ValueError(
          f"sample {sample.uid}: prompt {prompt_len} + response {response_len} tokens exceed "
          f"seq_len={seq_len}")
    end = prompt_len + response_len
    tokens[b, :prompt_len] = sample.prompt_tokens
    tokens[b, prompt_len:end] = sample.response_tokens
    response_mask[b, prompt_len:end] = 1.0
    behaviour[b, prompt_len:end] = sample.behaviour_logprobs
    versions[b, prompt_len:end] = sample.token_versions
  rewards = np.zeros((batch,), np.float32)
  rewards[:len(rows)] = [sample.reward for sample in rows]
  if not np.all(np.isfinite(rewards)):
    bad = [sample.uid for sample in rows if not np.isfinite(sample.reward)]
    raise ValueError(f"samples {bad[:5]} have non-finite rewards; drop them before collate")
  group_index = np.repeat(np.arange(num_groups, dtype=np.int32), len(groups[0]))
  return TrainBatch(tokens=tokens, response_mask=response_mask, behaviour_logprobs=behaviour,
                    token_versions=versions, rewards=rewards, group_index=group_index)

