"""Sequence packing: `batching.pack` loses nothing, and a packed batch trains exactly like the
one-row-per-sample batch (logprobs, loss, gradient step, every aggregation mode)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_async import sharding
from jaxrl_async.learner import aggregation
from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import collate, pack, packed_rows
from jaxrl_async.learner.step import LearnerConfig
from jaxrl_async.model import apply, get_config, init_model, param_logical_axes, split_model
from jaxrl_async.sharding import MeshShape
from jaxrl_async.types import Sample

CONFIG = get_config("tiny")
ROW = 32
GROUP_SIZE = 4


def _groups(lengths, seed=0, group_size=GROUP_SIZE):
  """Groups of samples with the given (prompt, response) lengths, random tokens and rewards."""
  rng = np.random.default_rng(seed)
  groups, group = [], []
  for i, (prompt_len, response_len) in enumerate(lengths):
    g = i // group_size
    group.append(Sample(
        prompt_id=g, group_id=g, group_size=group_size,
        prompt_tokens=rng.integers(1, 15, prompt_len),
        response_tokens=rng.integers(1, 15, response_len),
        behaviour_logprobs=-rng.uniform(1.5, 3.5, response_len),
        token_versions=np.full(response_len, i % 3), reward=float(rng.integers(0, 3)),
        meta={"index_in_group": i % group_size}))
    if len(group) == group_size:
      groups.append(group)
      group = []
  return groups


def _long_tail_lengths(seed, num_groups=4):
  rng = np.random.default_rng(seed)
  n = num_groups * GROUP_SIZE
  prompts = rng.integers(2, 8, n)
  responses = np.minimum(rng.geometric(0.25, n), ROW - prompts)
  return list(zip(prompts.tolist(), responses.tolist()))


def _per_sample(batch, values):
  """{sample: the values of its response tokens, in order} from a [R, T] array."""
  out = {}
  for row, col in zip(*np.nonzero(batch.response_mask)):
    out.setdefault(int(batch.sample_index[row, col]), []).append(float(values[row, col]))
  return out


# ---- layout --------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10), st.integers(0, 12)), min_size=2, max_size=40)
       .filter(lambda xs: len(xs) % 2 == 0),
       st.sampled_from([1, 2, 8]))
def test_pack_places_every_token_of_every_sample_once(lengths, row_multiple):
  groups = _groups(lengths, group_size=2)
  batch = pack(groups, 24, num_groups=len(groups) + 1, row_multiple=row_multiple)
  samples = [s for g in groups for s in g]
  used_rows = sum(1 for row in batch.segment_ids if row.any())
  assert batch.num_rows == packed_rows(used_rows, row_multiple)
  assert batch.num_rows % row_multiple == 0
  assert batch.num_samples == (len(groups) + 1) * 2  # an empty group appended
  for i, sample in enumerate(samples):
    rows, cols = np.nonzero((batch.sample_index == i) & (batch.segment_ids > 0))
    assert len(set(rows.tolist())) == 1, f"sample {i} split over rows {set(rows.tolist())}"
    row, cols = rows[0], np.sort(cols)
    n = len(sample.prompt_tokens) + sample.num_response_tokens
    assert cols.tolist() == list(range(cols[0], cols[0] + n))  # contiguous
    np.testing.assert_array_equal(batch.tokens[row, cols],
                                  np.concatenate([sample.prompt_tokens, sample.response_tokens]))
    np.testing.assert_array_equal(batch.positions[row, cols], np.arange(n))
    assert len(set(batch.segment_ids[row, cols].tolist())) == 1
    response = cols[len(sample.prompt_tokens):]
    np.testing.assert_array_equal(batch.response_mask[row, cols],
                                  np.r_[np.zeros(len(sample.prompt_tokens)),
                                        np.ones(len(response))])
    np.testing.assert_allclose(batch.behaviour_logprobs[row, response],
                               sample.behaviour_logprobs)
    np.testing.assert_array_equal(batch.token_versions[row, response], sample.token_versions)
    assert batch.rewards[i] == sample.reward
  # Segments of a row are distinct samples; padding is segment 0 and outside every sample.
  assert int((batch.segment_ids > 0).sum()) == sum(
      len(s.prompt_tokens) + s.num_response_tokens for s in samples)
  assert batch.response_mask.sum() == sum(s.num_response_tokens for s in samples)


def test_packed_rows_are_few_shapes_with_bounded_padding():
  sizes = [packed_rows(n, 1) for n in range(1, 97)]
  assert sorted(set(sizes)) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]
  assert all(n <= size <= max(2, 1.5 * n) for n, size in zip(range(1, 97), sizes))
  assert [packed_rows(n, 8) for n in (1, 8, 9, 17, 25, 33)] == [8, 8, 16, 24, 32, 48]


def test_pack_uses_fewer_rows_than_collate_on_a_long_tail():
  groups = _groups(_long_tail_lengths(0, num_groups=8))
  packed, padded = pack(groups, ROW), collate(groups, ROW)
  assert packed.num_rows * 2 <= padded.num_rows
  assert packed.response_mask.sum() == padded.response_mask.sum()


def test_pack_errors_name_the_problem():
  with pytest.raises(ValueError, match="exceed seq_len=8"):
    pack(_groups([(4, 5), (2, 2)], group_size=2), 8)
  with pytest.raises(ValueError, match="at least one group"):
    pack([], 8)
  with pytest.raises(ValueError, match="num_groups=1 is less than the 2 groups"):
    pack(_groups([(2, 2)] * 4, group_size=2), 8, num_groups=1)
  with pytest.raises(ValueError, match="row_multiple"):
    packed_rows(3, 0)


# ---- model and losses ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
  module = init_model(CONFIG, seed=0)
  graphdef, params = split_model(module)
  return graphdef, jax.device_get(params), param_logical_axes(module)


def test_segment_ids_keep_attention_within_a_sample(model):
  graphdef, params, _ = model
  rng = np.random.default_rng(1)
  a, b = rng.integers(1, 15, 7), rng.integers(1, 15, 5)
  row = np.concatenate([a, b, [0, 0]])[None]
  positions = np.concatenate([np.arange(7), np.arange(5), [0, 0]])[None]
  segments = np.array([[1] * 7 + [2] * 5 + [0, 0]])
  packed, _ = apply(graphdef, params, jnp.asarray(row), jnp.asarray(positions),
                    segment_ids=jnp.asarray(segments))
  alone_a, _ = apply(graphdef, params, jnp.asarray(a[None]))
  alone_b, _ = apply(graphdef, params, jnp.asarray(b[None]))
  np.testing.assert_allclose(packed[0, :7], alone_a[0], atol=1e-5)
  np.testing.assert_allclose(packed[0, 7:12], alone_b[0], atol=1e-5)
  with pytest.raises(ValueError, match="need positions"):
    apply(graphdef, params, jnp.asarray(row), segment_ids=jnp.asarray(segments))


def test_packed_logprobs_equal_unpacked(model):
  graphdef, params, _ = model
  logprobs = step_lib.make_logprob_fn(graphdef, 1.0)
  groups = _groups(_long_tail_lengths(2))
  packed, padded = pack(groups, ROW), collate(groups, ROW)
  a = _per_sample(packed, np.asarray(step_lib.batch_logprobs(logprobs, params, packed)))
  b = _per_sample(padded, np.asarray(step_lib.batch_logprobs(logprobs, params, padded)))
  assert a.keys() == b.keys() and len(a) > 0
  for i in a:
    np.testing.assert_allclose(a[i], b[i], atol=2e-5)


@pytest.mark.parametrize("mode", aggregation.AGG_MODES)
def test_aggregate_over_sequence_ids_equals_one_row_per_sequence(mode):
  rng = np.random.default_rng(3)
  values, mask = rng.normal(size=(6, 5)), rng.integers(0, 2, (6, 5)).astype(np.float32)
  mask[2] = 0  # an empty sequence
  expected = aggregation.aggregate(values, mask, mode, max_length=5)
  # The same 6 sequences, two per row of 10 tokens.
  packed_values = values.reshape(3, 10)
  packed_mask = mask.reshape(3, 10)
  ids = np.repeat(np.arange(6), 5).reshape(3, 10)
  got = aggregation.aggregate(packed_values, packed_mask, mode, max_length=5, sequence_ids=ids,
                              num_sequences=6)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  with pytest.raises(ValueError, match="num_sequences"):
    aggregation.aggregate(packed_values, packed_mask, mode, sequence_ids=ids)


def _one_update(model, config, batch, anchor="recompute", mesh_shape=None):
  graphdef, params, axes = model
  mesh = (sharding.make_mesh(MeshShape(), jax.devices()[:1]) if mesh_shape is None
          else sharding.make_mesh(mesh_shape))
  state = step_lib.init_train_state(params, config.optimizer(), mesh, axes)
  update = step_lib.make_update_fn(graphdef, config, GROUP_SIZE, step_lib.state_shardings(state))
  batch = step_lib.shard_batch(batch, mesh)
  if anchor == "recompute":
    anchor = step_lib.batch_logprobs(step_lib.make_logprob_fn(graphdef, 1.0), params, batch)
  state, metrics = update(state, batch, anchor, np.float32(0), np.float32(0))
  return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.parametrize("config", [
    LearnerConfig(learning_rate=1e-2),
    LearnerConfig(learning_rate=1e-2, agg_mode="seq-mean-token-mean", entropy_coef=0.01),
    LearnerConfig(learning_rate=1e-2, agg_mode="seq-mean-token-sum", use_rollout_log_probs=True),
    LearnerConfig(learning_rate=1e-2, proximal_logprob="loglinear"),
], ids=["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "loglinear"])
def test_packed_update_equals_unpacked_update(model, config):
  groups = _groups(_long_tail_lengths(4))
  packed_params, packed_metrics = _one_update(model, config, pack(groups, ROW, num_groups=5))
  padded_params, padded_metrics = _one_update(model, config, collate(groups, ROW, num_groups=5))
  moved = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), packed_params,
                                           model[1])))
  assert moved > 1e-4
  worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), packed_params,
                                           padded_params)))
  # Adam's first step moves a parameter by about lr * g / |g| = 1e-2, so rounding in a gradient
  # entry near 0 shows up as ~1e-4; a wrong loss or mask moves parameters by ~lr.
  assert worst <= 2e-4
  for name in ("loss", "grad_norm"):
    assert float(packed_metrics[name]) == pytest.approx(float(padded_metrics[name]), rel=1e-4)


def test_anchor_from_the_update_forward_equals_a_recomputed_anchor(model):
  """'recompute' at a window's first update: anchor_logp=None == logprobs of the same weights."""
  config = LearnerConfig(learning_rate=1e-2)
  batch = pack(_groups(_long_tail_lengths(5)), ROW)
  own, own_metrics = _one_update(model, config, batch, anchor=None)
  recomputed, metrics = _one_update(model, config, batch)
  worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), own, recomputed)))
  assert worst <= 2e-4  # as in test_packed_update_equals_unpacked_update
  assert float(own_metrics["loss"]) == pytest.approx(float(metrics["loss"]), rel=1e-4)
  ratio_sum, ratio_count = own_metrics["ratio_mean"]
  assert float(ratio_sum) / float(ratio_count) == pytest.approx(1.0, abs=1e-6)


def test_packed_update_on_an_8_device_mesh_equals_one_device(model):
  """Rows of a packed batch are split over the batch axes (row_multiple = mesh size)."""
  config = LearnerConfig(learning_rate=1e-2)
  batch = pack(_groups(_long_tail_lengths(6)), ROW, row_multiple=8)
  assert batch.num_rows % 8 == 0
  one, one_metrics = _one_update(model, config, batch)
  eight, eight_metrics = _one_update(model, config, batch, mesh_shape=MeshShape(fsdp=4, tensor=2))
  worst = max(jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), one, eight)))
  assert worst <= 2e-4  # as in test_packed_update_equals_unpacked_update
  assert float(one_metrics["loss"]) == pytest.approx(float(eight_metrics["loss"]), rel=1e-4)
