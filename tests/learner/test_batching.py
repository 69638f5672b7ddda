"""Tests for jaxrl_async.learner.batching.collate: layout, masks, versions, input errors."""

import numpy as np
import pytest

from jaxrl_async.learner.batching import TrainBatch, collate
from jaxrl_async.types import Sample


def _sample(group_id, index, prompt, response, versions=None, reward=1.0):
  n = len(response)
  versions = [group_id] * n if versions is None else versions
  return Sample(prompt_id=group_id, group_id=group_id, group_size=2, prompt_tokens=prompt,
                response_tokens=response, behaviour_logprobs=-0.1 * (np.arange(n) + 1),
                token_versions=versions, reward=reward, meta={"index_in_group": index})


def _groups():
  return [
      [_sample(0, 0, [1, 5, 6, 4], [6, 5, 2], reward=1.0),
       _sample(0, 1, [1, 5, 6, 4], [5, 2], versions=[3, 4], reward=0.0)],
      [_sample(1, 0, [1, 9, 4], [9, 9, 9, 2], reward=0.5),
       _sample(1, 1, [1, 9, 4], [], reward=0.0)],
  ]


def test_layout_prompt_then_response_right_padded():
  batch = collate(_groups(), seq_len=9, pad_id=0)
  assert isinstance(batch, TrainBatch) and batch.num_rows == batch.num_samples == 4
  assert batch.tokens.dtype == np.int32 and batch.tokens.shape == (4, 9)
  np.testing.assert_array_equal(batch.tokens, [
      [1, 5, 6, 4, 6, 5, 2, 0, 0],
      [1, 5, 6, 4, 5, 2, 0, 0, 0],
      [1, 9, 4, 9, 9, 9, 2, 0, 0],
      [1, 9, 4, 0, 0, 0, 0, 0, 0],
  ])
  np.testing.assert_array_equal(batch.response_mask, [
      [0, 0, 0, 0, 1, 1, 1, 0, 0],
      [0, 0, 0, 0, 1, 1, 0, 0, 0],
      [0, 0, 0, 1, 1, 1, 1, 0, 0],
      [0, 0, 0, 0, 0, 0, 0, 0, 0],
  ])
  assert batch.response_mask.dtype == np.float32


def test_per_token_arrays_sit_on_their_tokens():
  groups = _groups()
  batch = collate(groups, seq_len=9)
  rows = [s for g in groups for s in g]
  for b, sample in enumerate(rows):
    on = batch.response_mask[b] == 1
    np.testing.assert_array_equal(batch.tokens[b][on], sample.response_tokens)
    np.testing.assert_allclose(batch.behaviour_logprobs[b][on], sample.behaviour_logprobs)
    np.testing.assert_array_equal(batch.token_versions[b][on], sample.token_versions)
    np.testing.assert_array_equal(batch.token_versions[b][~on], -1)
    np.testing.assert_array_equal(batch.behaviour_logprobs[b][~on], 0.0)
  np.testing.assert_array_equal(batch.token_versions[1], [-1, -1, -1, -1, 3, 4, -1, -1, -1])
  np.testing.assert_array_equal(batch.rewards, [1.0, 0.0, 0.5, 0.0])
  assert batch.rewards.dtype == np.float32
  np.testing.assert_array_equal(batch.group_index, [0, 0, 1, 1])
  assert batch.group_index.dtype == np.int32


def test_pad_id_and_exact_fit():
  batch = collate(_groups(), seq_len=7, pad_id=15)  # the longest row fills all 7
  assert batch.tokens[0, -1] == 2 and batch.tokens[1, -1] == 15
  np.testing.assert_array_equal(batch.tokens[3, 3:], 15)


def test_a_response_never_starts_at_position_zero():
  batch = collate(_groups(), seq_len=9)
  assert np.all(batch.response_mask[:, 0] == 0)  # the model is scored on tokens[:, 1:]


def test_errors():
  with pytest.raises(ValueError, match="at least one group"):
    collate([], seq_len=8)
  groups = _groups()
  with pytest.raises(ValueError, match=r"sample \(0, 0\): prompt 4 \+ response 3 tokens exceed "
                                       r"seq_len=6"):
    collate(groups, seq_len=6)
  groups[1].append(_sample(1, 2, [1, 4], [2]))
  with pytest.raises(ValueError, match=r"same size, got sizes \[2, 3\]"):
    collate(groups, seq_len=9)
  groups = _groups()
  groups[1][0].reward = float("nan")
  groups[0][1].reward = float("inf")
  with pytest.raises(ValueError, match=r"samples \[\(0, 1\), \(1, 0\)\] have non-finite rewards"):
    collate(groups, seq_len=9)
  empty_prompt = _sample(2, 0, [], [5])
  with pytest.raises(ValueError, match=r"sample \(2, 0\) has an empty prompt"):
    collate([[empty_prompt]], seq_len=4)
