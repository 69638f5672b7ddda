"""Tests for jaxrl_async.types: Sample validation, provenance properties, serialisation."""

import json

import numpy as np
import pytest

from jaxrl_async.types import (
  DROP_REASONS,
  STAGES,
  FinishReason,
  PolicyVersion,
  RewardStatus,
  Sample,
)


def _sample(versions=(3, 3, 4, 5), **kwargs):
  n = len(versions)
  defaults = dict(prompt_id=7, group_id=2, group_size=4, prompt_tokens=[1, 5, 6, 4],
                  response_tokens=np.arange(n) + 5, behaviour_logprobs=-0.25 * np.arange(n),
                  token_versions=versions, meta={"index_in_group": 3, "target": [6, 5]})
  defaults.update(kwargs)
  return Sample(**defaults)


def test_arrays_are_converted_to_their_dtypes():
  sample = _sample()
  assert sample.prompt_tokens.dtype == np.int32
  assert sample.response_tokens.dtype == np.int32
  assert sample.behaviour_logprobs.dtype == np.float32
  assert sample.token_versions.dtype == np.int32


def test_defaults_are_an_empty_pending_aborted_response():
  sample = Sample(prompt_id=0, group_id=0, group_size=1, prompt_tokens=[1, 2])
  assert sample.num_response_tokens == 0
  assert sample.finish_reason == FinishReason.ABORTED.value == "aborted"
  assert sample.reward_status == RewardStatus.PENDING.value == "pending"
  assert np.isnan(sample.reward)
  assert (sample.min_version, sample.max_version, sample.version_span) == (-1, -1, 0)
  assert not sample.is_partial
  assert sample.max_version_gap(10) == 0
  # Default factories give every sample its own arrays / dicts.
  other = Sample(prompt_id=1, group_id=1, group_size=1, prompt_tokens=[1])
  sample.timestamps["created"] = 1.0
  assert other.timestamps == {}


@pytest.mark.parametrize("field, value", [
    ("behaviour_logprobs", [-0.1, -0.2]),
    ("token_versions", [0, 0, 0, 0, 0]),
    ("response_tokens", [5]),
])
def test_per_token_arrays_must_have_equal_lengths(field, value):
  with pytest.raises(ValueError, match=r"one entry per response token"):
    _sample(**{field: value})


def test_group_size_must_be_positive():
  with pytest.raises(ValueError, match=r"group_size must be >= 1, got 0"):
    _sample(group_size=0)


def test_provenance_properties():
  sample = _sample(versions=(3, 3, 4, 5))
  assert sample.uid == (2, 3)
  assert sample.num_response_tokens == 4
  assert (sample.min_version, sample.max_version) == (3, 5)
  assert sample.version_span == 2
  assert sample.is_partial
  assert sample.max_version_gap(6) == 3
  single = _sample(versions=(4, 4))
  assert single.version_span == 0 and not single.is_partial
  assert _sample(meta={}).uid == (2, 0)


def test_stamp_accepts_known_stages_only():
  sample = _sample()
  for i, stage in enumerate(STAGES):
    sample.stamp(stage, i + 0.5)
  assert sample.timestamps == {stage: i + 0.5 for i, stage in enumerate(STAGES)}
  with pytest.raises(ValueError, match=r"unknown stage 'trained'"):
    sample.stamp("trained", 1.0)


def _assert_same(a: Sample, b: Sample):
  for name in ("prompt_tokens", "response_tokens", "behaviour_logprobs", "token_versions"):
    np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert getattr(a, name).dtype == getattr(b, name).dtype
  for name in ("prompt_id", "group_id", "group_size", "finish_reason", "reward_status",
               "retries", "interruptions", "timestamps", "meta"):
    assert getattr(a, name) == getattr(b, name), name
  assert a.reward == b.reward or (np.isnan(a.reward) and np.isnan(b.reward))


@pytest.mark.parametrize("reward", [0.75, float("nan")])
def test_to_dict_round_trips_through_json(reward):
  sample = _sample(reward=reward, reward_status="ok", finish_reason="eos", retries=2,
                   interruptions=1)
  sample.stamp("created", 12.5)
  text = json.dumps(sample.to_dict())
  restored = Sample.from_dict(json.loads(text))
  _assert_same(sample, restored)
  for value in sample.to_dict().values():  # plain Python types only
    assert not isinstance(value, np.ndarray)


def test_enums_and_drop_reasons():
  assert [s.value for s in RewardStatus] == ["pending", "ok", "failed", "timeout"]
  assert RewardStatus("timeout") is RewardStatus.TIMEOUT
  assert {r.value for r in FinishReason} == {"eos", "length", "aborted"}
  assert len(set(DROP_REASONS)) == len(DROP_REASONS)
  assert {"stale", "reward_failed", "reward_timeout", "truncated"} <= set(DROP_REASONS)
  version = PolicyVersion(version=3, learner_step=12, published_at=1.0)
  with pytest.raises(AttributeError):
    version.version = 4  # type: ignore[misc]
