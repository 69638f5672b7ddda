"""Batch length buckets: few compiled shapes, never shorter than the longest sample."""

import numpy as np
import pytest

from jaxrl_async.learner.batching import bucket_length, collate, longest_sequence
from jaxrl_async.types import Sample


@pytest.mark.parametrize("length,expected", [(1, 16), (16, 16), (17, 32), (33, 51), (51, 51)])
def test_bucket_length(length, expected):
  assert bucket_length(length, 51) == expected


def test_bucket_length_rejects_too_long():
  with pytest.raises(ValueError, match="52 tokens exceeds the maximum 51"):
    bucket_length(52, 51)


def test_all_buckets_hold_every_length():
  for length in range(1, 200):
    assert length <= bucket_length(length, 200)
  assert len({bucket_length(n, 200) for n in range(1, 200)}) == 5  # 16, 32, 64, 128, 200


def test_longest_sequence_and_collate_at_bucket():
  group = [Sample(0, 0, 2, [1, 5, 4], [7, 2], [-1.0, -2.0], [0, 0], reward=1.0,
                  meta={"index_in_group": 0}),
           Sample(0, 0, 2, [1, 5, 4], [7, 8, 9, 2], [-1.0] * 4, [0] * 4, reward=0.0,
                  meta={"index_in_group": 1})]
  assert longest_sequence([group]) == 7
  batch = collate([group], bucket_length(7, 51))
  assert batch.tokens.shape == (2, 16)
  np.testing.assert_array_equal(batch.tokens[1, :7], [1, 5, 4, 7, 8, 9, 2])
