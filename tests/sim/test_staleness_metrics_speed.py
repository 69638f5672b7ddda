"""The batched `staleness_metrics` gives exactly the values of the per-sample original."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_async.metrics import staleness_metrics
from jaxrl_async.types import Sample


def reference_staleness_metrics(groups, learner_version: int) -> dict:
  """The per-sample formulation the faster one replaced, kept as the reference."""
  gaps, partial, spans, samples = [], 0, [0], 0
  for group in groups:
    for sample in group:
      samples += 1
      gaps.append(learner_version - sample.token_versions)
      partial += sample.is_partial
      spans.append(sample.version_span)
  gaps = np.concatenate(gaps) if gaps else np.zeros((0,), np.int32)
  counts = np.bincount(np.maximum(gaps, 0).astype(np.int64)) if gaps.size else []
  return {
      "algo/version_gap_mean": float(gaps.mean()) if gaps.size else 0.0,
      "algo/version_gap_max": float(gaps.max()) if gaps.size else 0.0,
      "algo/stale_ratio": float(np.mean(gaps >= 1)) if gaps.size else 0.0,
      "algo/partial_ratio": partial / max(samples, 1),
      "algo/max_partial_span": float(max(spans)),
      "algo/version_gap_counts": [int(c) for c in counts],
  }


def _sample(versions: list[int]) -> Sample:
  n = len(versions)
  return Sample(prompt_id=0, group_id=0, group_size=1, prompt_tokens=np.zeros(1, np.int32),
                response_tokens=np.zeros(n, np.int32),
                behaviour_logprobs=np.zeros(n, np.float32),
                token_versions=np.asarray(sorted(versions), np.int32))


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.lists(st.lists(st.integers(0, 12), max_size=9), max_size=4),
                       max_size=5),
       learner_version=st.integers(0, 14))
def test_same_values_as_the_per_sample_reference(groups, learner_version):
  built = [[_sample(versions) for versions in group] for group in groups]
  new = staleness_metrics(built, learner_version)
  old = reference_staleness_metrics(built, learner_version)
  assert list(new) == list(old)
  for name, value in old.items():
    assert type(new[name]) is type(value), name
    assert new[name] == value or (value != value and new[name] != new[name]), name


def test_mixed_dtypes_fall_back_to_one_subtraction_per_array():
  a, b = _sample([1, 2]), _sample([3])
  b.token_versions = np.asarray([3], np.int64)
  assert staleness_metrics([[a, b]], 5) == reference_staleness_metrics([[a, b]], 5)
