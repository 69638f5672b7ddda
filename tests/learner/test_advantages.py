"""Tests for jaxrl_async.learner.advantages against numpy references and hand-computed values."""

import functools

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.learner import advantages as adv_lib


@functools.cache
def _compiled(fn, **static):
  return jax.jit(functools.partial(fn, **static))


def jit_call(fn, *arrays, **static):
  """fn(*arrays, **static) as one compiled program: one compile per shape instead of one per op."""
  return _compiled(fn, **static)(*arrays)


def reference_group_advantages(rewards, normalize_std=True, eps=1e-6, ddof=0):
  """Loop over groups; rewards: list of 1-d arrays (ragged allowed)."""
  out = []
  for group in rewards:
    group = np.asarray(group, np.float64)
    centred = group - group.mean()
    if normalize_std:
      var = np.sum(centred**2) / max(len(group) - ddof, 1)
      centred = centred / (np.sqrt(var) + eps)
    out.append(centred)
  return out


# ---- hand-computed values ----------------------------------------------------------------------
def test_grpo_hand_computed():
  rewards = jnp.array([[0.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
  got = jit_call(adv_lib.group_advantages, rewards)
  # {0, 1} and {1, 2}: mean +-0.5, population std 0.5; {1, 3}: mean +-1, std 1.
  half = 0.5 / (0.5 + 1e-6)
  expected = [[-half, half], [-half, half], [-1.0 / (1.0 + 1e-6), 1.0 / (1.0 + 1e-6)]]
  np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_grpo_three_responses_hand_computed():
  got = jit_call(adv_lib.group_advantages, jnp.array([[1.0, 2.0, 3.0]]), eps=0.0)
  # mean 2, population std sqrt(2/3) = 0.8164966
  np.testing.assert_allclose(got, [[-1.2247449, 0.0, 1.2247449]], rtol=1e-6)
  unbiased = jit_call(adv_lib.group_advantages, jnp.array([[1.0, 2.0, 3.0]]), eps=0.0,
                      ddof=1)
  np.testing.assert_allclose(unbiased, [[-1.0, 0.0, 1.0]], rtol=1e-6)


def test_eps_is_added_to_the_std():
  got = jit_call(adv_lib.group_advantages, jnp.array([[0.0, 1.0]]), eps=0.1)
  np.testing.assert_allclose(got, [[-0.5 / 0.6, 0.5 / 0.6]], rtol=1e-6)  # not / sqrt(0.25 + eps)
  flat = jit_call(adv_lib.advantages_from_flat, jnp.array([0.0, 1.0]), jnp.array([0, 0]),
                  num_groups=1, eps=0.1)
  np.testing.assert_allclose(flat, [-0.5 / 0.6, 0.5 / 0.6], rtol=1e-6)


def test_dr_grpo_is_centred_only():
  got = jit_call(adv_lib.group_advantages, jnp.array([[1.0, 2.0, 6.0], [0.0, 0.0, 3.0]]),
                 normalize_std=False)
  np.testing.assert_allclose(got, [[-2.0, -1.0, 3.0], [-1.0, -1.0, 2.0]], rtol=1e-6)


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("ddof", [0, 1])
def test_equal_rewards_give_zero_not_nan(normalize_std, ddof):
  # 2.7014287 * 6 / 6 != 2.7014287 in float32: a naive mean would leave a residue ~ eps.
  rewards = jnp.array([[1.0] * 6, [0.0] * 6, [0.3] * 6, [2.7014287] * 6], jnp.float32)
  got = jit_call(adv_lib.group_advantages, rewards, normalize_std=normalize_std, ddof=ddof)
  np.testing.assert_array_equal(got, np.zeros((4, 6)))
  flat = jit_call(adv_lib.advantages_from_flat, rewards.reshape(-1), jnp.arange(24) // 6,
                  num_groups=4, normalize_std=normalize_std, ddof=ddof)
  np.testing.assert_array_equal(flat, np.zeros(24))


def test_group_of_one_is_zero():
  for ddof in (0, 1):
    got = jit_call(adv_lib.group_advantages, jnp.array([[5.0], [-2.0]]), ddof=ddof)
    np.testing.assert_array_equal(got, np.zeros((2, 1)))


def test_integer_rewards_become_float():
  got = jit_call(adv_lib.group_advantages, jnp.array([[0, 1]], jnp.int32))
  assert jnp.issubdtype(got.dtype, jnp.floating)
  np.testing.assert_allclose(got, [[-1.0, 1.0]], rtol=1e-5)


# ---- numpy reference ---------------------------------------------------------------------------
@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("ddof", [0, 1])
def test_group_advantages_match_reference(normalize_std, ddof):
  rewards = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
  rewards[2] = 0.7  # one degenerate group
  got = jit_call(adv_lib.group_advantages, rewards, normalize_std=normalize_std, ddof=ddof)
  expected = reference_group_advantages(rewards, normalize_std, ddof=ddof)
  np.testing.assert_allclose(got, np.stack(expected), rtol=1e-5, atol=1e-6)


def test_flat_ragged_interleaved_groups_match_reference():
  rewards = np.array([1.0, 0.0, 5.0, 1.0, 2.0, 9.0, 3.0, 4.0], np.float32)
  group_ids = np.array([0, 1, 2, 0, 1, -1, 0, 3], np.int32)  # -1: padding row
  got = np.asarray(jit_call(adv_lib.advantages_from_flat, rewards, group_ids, num_groups=4))
  expected = np.zeros(8)
  for group in range(4):
    rows = np.flatnonzero(group_ids == group)
    expected[rows] = reference_group_advantages([rewards[rows]])[0]
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
  assert got[5] == 0.0  # padding row
  assert got[2] == 0.0 and got[7] == 0.0  # singleton groups
  # Group 0 = {1, 1, 3}: mean 5/3, std sqrt(8/9).
  np.testing.assert_allclose(got[[0, 3, 6]], np.array([-2, -2, 4]) / 3 / (np.sqrt(8 / 9) + 1e-6),
                             rtol=1e-5)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_flat_equals_grouped_for_contiguous_groups(normalize_std):
  rewards = jnp.asarray(np.random.default_rng(1).normal(size=12), jnp.float32)
  by_group = jit_call(adv_lib.group_advantages, adv_lib.grouped(rewards, 3),
                      normalize_std=normalize_std)
  flat = jit_call(adv_lib.advantages_from_flat, rewards, jnp.arange(12) // 3, num_groups=4,
                  normalize_std=normalize_std)
  np.testing.assert_allclose(flat, by_group.reshape(-1), rtol=1e-5, atol=1e-6)


def test_grouped_reshapes_group_by_group():
  np.testing.assert_array_equal(adv_lib.grouped(jnp.arange(6), 2), [[0, 1], [2, 3], [4, 5]])


def test_broadcast_to_tokens_hand_computed():
  mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 1, 1]], bool)
  got = adv_lib.broadcast_to_tokens(jnp.array([0.5, -2.0, 3.0]), mask)
  np.testing.assert_array_equal(got, [[0.5, 0.5, 0.0], [0.0, 0.0, 0.0], [3.0, 3.0, 3.0]])
  float_mask = adv_lib.broadcast_to_tokens(jnp.array([0.5, -2.0, 3.0]), mask.astype(jnp.float32))
  np.testing.assert_array_equal(got, float_mask)


# ---- bad configuration ---------------------------------------------------------------------------
def test_bad_group_size_raises():
  with pytest.raises(ValueError, match="group_size=4"):
    adv_lib.grouped(jnp.zeros(6), 4)
  with pytest.raises(ValueError, match="group_size"):
    adv_lib.grouped(jnp.zeros(6), 0)


def test_bad_ddof_raises():
  with pytest.raises(ValueError, match="ddof.*2"):
    adv_lib.group_advantages(jnp.zeros((2, 2)), ddof=2)


# ---- jit / vmap ----------------------------------------------------------------------------------
def test_jit_and_vmap_match_eager():
  rewards = jnp.asarray(np.random.default_rng(2).normal(size=(3, 4, 5)), jnp.float32)
  fn = functools.partial(adv_lib.group_advantages, normalize_std=True)
  eager = np.stack([fn(r) for r in rewards])
  np.testing.assert_allclose(jax.jit(fn)(rewards[0]), eager[0], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jax.jit(jax.vmap(fn))(rewards), eager, rtol=1e-6, atol=1e-7)

  flat = rewards.reshape(3, 20)
  ids = jnp.arange(20) // 5
  flat_fn = functools.partial(adv_lib.advantages_from_flat, num_groups=4)
  np.testing.assert_allclose(jax.jit(flat_fn)(flat[1], ids), flat_fn(flat[1], ids), rtol=1e-6)
  np.testing.assert_allclose(jax.jit(jax.vmap(flat_fn, in_axes=(0, None)))(flat, ids),
                             eager.reshape(3, 20), rtol=1e-5, atol=1e-6)

  mask = jnp.arange(6)[None, :] < jnp.array([[2], [6], [0], [4]])
  adv = jnp.array([1.0, -1.0, 2.0, 0.5])
  np.testing.assert_array_equal(jax.jit(adv_lib.broadcast_to_tokens)(adv, mask),
                                adv_lib.broadcast_to_tokens(adv, mask))


# ---- properties ----------------------------------------------------------------------------------
@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(hnp.arrays(np.float32, (4, 6), elements=st.floats(-5, 5, width=32)))
def test_grpo_groups_are_centred_and_unit_std(rewards):
  got = np.asarray(jit_call(adv_lib.group_advantages, rewards, eps=1e-6))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got.mean(axis=1), 0.0, atol=1e-4)
  std = rewards.astype(np.float64).std(axis=1)
  for group, group_std in zip(got, std):
    if group_std > 1e-3:
      np.testing.assert_allclose(group.std(), 1.0, rtol=1e-2)
    # |r - mean| <= sqrt(K - 1) * std (Samuelson), so eps only ever shrinks advantages.
    assert np.all(np.abs(group) <= np.sqrt(5.0) + 1e-4)
