"""The update compiled ahead of time: the row counts a packed batch can have, the executables
picked by shape, and the same result as the jitted update, unsharded and sharded."""

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_async.config import RunConfig
from jaxrl_async.learner.batching import blank_batch, pack, row_counts
from jaxrl_async.learner.compiled import AheadOfTime, shape_key
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.run import build as build_lib
from jaxrl_async.sharding import MeshShape
from jaxrl_async.tasks.reverse import DigitReverseTask
from tests.learner.test_packing import _groups


# ---- which row counts ------------------------------------------------------------------------
def test_row_counts_by_hand():
  # 64 samples of >= 6 tokens in rows of 51: at most 8 a row, so 8 rows at the fewest.
  assert row_counts(64, 51, 6, row_multiple=1) == [8, 12, 16, 24, 32, 48, 64]
  # One sample a row at the most: 4 samples -> 4 rows; two fit a row -> 2 at the fewest.
  assert row_counts(4, 10, 5, row_multiple=1) == [2, 3, 4]
  # Rows in multiples of the 8 devices a batch is split over: one count here.
  assert row_counts(8, 20, 6, row_multiple=8) == [8]


def test_row_counts_errors_name_the_argument():
  with pytest.raises(ValueError, match="shortest_sample=0"):
    row_counts(8, 20, 0)
  with pytest.raises(ValueError, match="shortest_sample=21 exceeds row_length=20"):
    row_counts(8, 20, 21)
  with pytest.raises(ValueError, match="num_samples=0"):
    row_counts(0, 20, 4)


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9), st.integers(0, 10_000), st.sampled_from([1, 2, 8]))
def test_a_packed_batch_always_has_one_of_the_row_counts(prompt_min, seed, row_multiple):
  """Whatever the lengths (within the task's bounds), pack's row count is one of row_counts."""
  row = 24
  rng = np.random.default_rng(seed)
  n = 16
  prompts = rng.integers(prompt_min, 10, n)
  responses = rng.integers(1, row - prompts + 1)
  groups = _groups(list(zip(prompts.tolist(), responses.tolist())))
  batch = pack(groups, row, row_multiple=row_multiple)
  assert batch.num_rows in row_counts(n, row, prompt_min + 1, row_multiple)


def test_blank_batch_has_the_shape_of_a_packed_batch():
  groups = _groups([(3, 2)] * 8)
  packed = pack(groups, 16, row_multiple=1)
  blank = blank_batch(packed.num_rows, 16, 8)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), blank) == jax.tree.map(
      lambda x: (x.shape, x.dtype), packed)
  assert not blank.response_mask.any()


# ---- executables by shape -------------------------------------------------------------------
def test_calls_take_the_executable_of_their_shape_else_the_jit_path():
  fn = AheadOfTime(jax.jit(lambda scale, x, y=None: scale * x.sum() + (0 if y is None else y)))
  fn.compile(2.0, np.ones((3,), np.float32), None)
  assert fn(2.0, np.ones((3,), np.float32), None) == 6.0
  assert fn.calls == {"ahead_of_time": 1, "jit": 0}
  assert fn(2.0, np.ones((4,), np.float32), None) == 8.0  # another shape
  assert fn(2.0, np.ones((3,), np.float32), np.float32(1)) == 7.0  # y given: another key
  assert fn.calls == {"ahead_of_time": 1, "jit": 2}
  assert shape_key((np.ones(3), None)) != shape_key((np.ones(3), np.ones(())))
  assert shape_key((np.ones(3, np.float32),)) != shape_key((np.ones(3, np.int32),))


def _parts(**overrides):
  config = RunConfig(task=DigitReverseTask(0, max_len=6),
                     warm_start=WarmStartConfig(steps=5, batch_size=8), group_size=4,
                     mini_batch_size=2, max_concurrent_decodes=8, eval_size=8,
                     total_samples=64, **overrides)
  return build_lib.build(config, log=lambda *a: None)


def _real_groups(parts, seed):
  task = parts.task
  rng = np.random.default_rng(seed)
  problems = [next(parts.rollout.prompts) for _ in range(parts.config.groups_per_update)]
  lengths = []
  for problem in problems:
    for _ in range(parts.config.group_size):
      lengths.append((len(problem.prompt_tokens),
                      int(rng.integers(1, task.max_response_len + 1))))
  return _groups(lengths, seed=seed, group_size=parts.config.group_size)


@pytest.mark.parametrize("mesh", [MeshShape(), MeshShape(data=2, fsdp=2)],
                         ids=["one_device", "data2_fsdp2"])
@pytest.mark.parametrize("trigger", [1, 2])
def test_the_compiled_update_equals_the_jitted_one(mesh, trigger):
  parts = _parts(learner_mesh=mesh, trigger_parameter_sync_step=trigger)
  counts = sorted({r for (_, shapes) in parts.learner.update.executables
                   for r in [shapes[0][0][0]]})
  assert counts == row_counts(parts.config.groups_per_update * parts.config.group_size,
                              parts.learner.seq_len,
                              1 + min(len(p.prompt_tokens) for p in parts.rollout.eval_problems),
                              parts.learner.mesh.size)
  # 'recompute' with two updates a version: the anchored update is compiled too.
  assert len(parts.learner.update.executables) == len(counts) * (2 if trigger == 2 else 1)
  plain = dataclasses.replace(parts.learner, update=parts.learner.update.jitted,
                              logprobs=parts.learner.logprobs.jitted)
  window = build_lib.copy_params(parts.learner.initial_state.params)
  for seed in range(3):
    groups = _real_groups(parts, seed)
    rows = pack(groups, parts.learner.seq_len, num_groups=parts.config.groups_per_update,
                row_multiple=parts.learner.mesh.size).num_rows
    assert rows in counts
    for local in range(trigger):
      state = jax.tree.map(lambda x: x.copy(), parts.learner.initial_state)
      before = dict(parts.learner.update.calls)
      ahead, ahead_metrics = build_lib.learner_update(parts.learner, state, groups, window, 0,
                                                      local)
      assert parts.learner.update.calls["ahead_of_time"] == before["ahead_of_time"] + 1
      assert parts.learner.update.calls["jit"] == before["jit"]
      state = jax.tree.map(lambda x: x.copy(), parts.learner.initial_state)
      jitted, jitted_metrics = build_lib.learner_update(plain, state, groups, window, 0,
                                                        local)
      for a, b in zip(jax.tree.leaves(ahead.params), jax.tree.leaves(jitted.params),
                      strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
      np.testing.assert_allclose(float(ahead_metrics["loss"]), float(jitted_metrics["loss"]))


def test_off_compiles_nothing_ahead():
  parts = _parts(precompile_updates=False)
  assert parts.learner.update.executables == {}
  groups = _real_groups(parts, 0)
  build_lib.learner_update(parts.learner, jax.tree.map(lambda x: x.copy(), parts.learner.initial_state), groups,
                            None, 0, 0)
  assert parts.learner.update.calls == {"ahead_of_time": 0, "jit": 1}


def test_a_row_count_below_the_estimate_takes_the_jit_path():
  """A prompt shorter than every held-out one can pack into fewer rows than compiled."""
  parts = _parts()
  fewest = min(shapes[0][0][0] for _, shapes in parts.learner.update.executables)
  short = _groups([(1, 1)] * (parts.config.groups_per_update * parts.config.group_size),
                  group_size=parts.config.group_size)
  rows = pack(short, parts.learner.seq_len, num_groups=parts.config.groups_per_update,
              row_multiple=parts.learner.mesh.size).num_rows
  assert rows < fewest
  _, metrics = build_lib.learner_update(parts.learner, jax.tree.map(lambda x: x.copy(), parts.learner.initial_state),
                                         short, None, 0, 0)
  assert parts.learner.update.calls == {"ahead_of_time": 0, "jit": 1}
  assert np.isfinite(float(metrics["loss"]))
