"""Tests for jaxrl_async.learner.losses: numpy references, hand-computed values, invariants."""

import functools
import math

import hypothesis
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async import sharding
from jaxrl_async.learner import losses
from jaxrl_async.learner import proximal as proximal_lib


@functools.cache
def _compiled(fn, **static):
  return jax.jit(functools.partial(fn, **static))


def jit_call(fn, *arrays, **static):
  """fn(*arrays, **static) as one compiled program: one compile per shape instead of one per op."""
  return _compiled(fn, **static)(*arrays)


AGG_MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


# ---- numpy references (loops over tokens) -------------------------------------------------------
def ref_aggregate(values, mask, mode, max_length=None):
  batch, length = values.shape
  row_sums, row_counts = [], []
  for b in range(batch):
    total, count = 0.0, 0
    for t in range(length):
      if mask[b, t]:
        total += float(values[b, t])
        count += 1
    row_sums.append(total)
    row_counts.append(count)
  nonempty = [b for b in range(batch) if row_counts[b] > 0]
  if mode == "token-mean":
    return sum(row_sums) / max(sum(row_counts), 1)
  if mode == "seq-mean-token-mean":
    return sum(row_sums[b] / row_counts[b] for b in nonempty) / max(len(nonempty), 1)
  if mode == "seq-mean-token-sum":
    return sum(row_sums[b] for b in nonempty) / max(len(nonempty), 1)
  assert mode == "seq-mean-token-sum-norm"
  return sum(row_sums) / (batch * (length if max_length is None else max_length))


def ref_ppo_token(logp, old_logp, advantage, clip_low, clip_high, dual_clip):
  """-> (loss, ratio, clipped, dual_clipped) of one token."""
  ratio = math.exp(logp - old_logp)
  unclipped = -ratio * advantage
  clipped = -min(max(ratio, 1 - clip_low), 1 + clip_high) * advantage
  loss = max(unclipped, clipped)
  dual_active = False
  if dual_clip is not None and advantage < 0 and loss > -dual_clip * advantage:
    loss, dual_active = -dual_clip * advantage, True
  return loss, ratio, clipped > unclipped, dual_active


def ref_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.2,
                    dual_clip=None, agg_mode="token-mean", behaviour_logp=None, is_cap=None,
                    is_cap_mode="mask"):
  """Clipped PPO, or decoupled PPO when behaviour_logp is given (old_logp is then proximal)."""
  token_loss = np.zeros(logp.shape)
  sums = dict(clipfrac=0.0, dual_clip_frac=0.0, ratio_mean=0.0, approx_kl=0.0,
              is_weight_mean=0.0, masked_fraction=0.0, capped_fraction=0.0)
  weight_max, count = 0.0, 0
  for b in range(logp.shape[0]):
    for t in range(logp.shape[1]):
      if not mask[b, t]:
        continue
      count += 1
      loss, ratio, clipped, dual = ref_ppo_token(logp[b, t], old_logp[b, t], advantages[b, t],
                                                 clip_low, clip_high, dual_clip)
      if behaviour_logp is not None:
        weight = math.exp(old_logp[b, t] - behaviour_logp[b, t])
        sums["is_weight_mean"] += weight
        weight_max = max(weight_max, weight)
        if is_cap is not None and weight > is_cap:
          sums["capped_fraction"] += 1
          if is_cap_mode == "mask":
            sums["masked_fraction"] += 1
            weight = 0.0
          else:
            weight = is_cap
        loss *= weight
      token_loss[b, t] = loss
      sums["clipfrac"] += clipped
      sums["dual_clip_frac"] += dual
      sums["ratio_mean"] += ratio
      sums["approx_kl"] += old_logp[b, t] - logp[b, t]
  metrics = {k: (v, count) for k, v in sums.items()}
  metrics["is_weight_max"] = weight_max
  return ref_aggregate(token_loss, mask, agg_mode), metrics


def ref_kl(logp, ref_logp, kind):
  d = ref_logp - logp
  if kind == "k1":
    return -d
  if kind == "k2":
    return 0.5 * d * d
  if kind == "low_var_kl":
    d = min(max(d, -20.0), 20.0)
    return min(max(math.exp(d) - d - 1, -10.0), 10.0)
  return math.exp(d) - d - 1


def assert_metrics_close(got, expected, rtol=1e-5, atol=1e-6):
  for key, value in expected.items():
    if key not in got:
      continue
    if isinstance(value, tuple):
      np.testing.assert_allclose(got[key][0], value[0], rtol=rtol, atol=atol, err_msg=key)
      np.testing.assert_allclose(got[key][1], value[1], err_msg=key)
    else:
      np.testing.assert_allclose(got[key], value, rtol=rtol, atol=atol, err_msg=key)


def random_batch(seed, batch=4, length=6, spread=0.6):
  rng = np.random.default_rng(seed)
  old_logp = rng.uniform(-3, -0.1, (batch, length)).astype(np.float32)
  logp = (old_logp + rng.normal(0, spread, (batch, length))).astype(np.float32)
  behaviour_logp = (old_logp + rng.normal(0, 1.0, (batch, length))).astype(np.float32)
  advantages = rng.normal(0, 1, (batch, length)).astype(np.float32)
  lengths = rng.integers(0, length + 1, batch)
  lengths[0] = length
  lengths[-1] = 0  # an all-masked row
  mask = np.arange(length)[None, :] < lengths[:, None]
  return logp, old_logp, behaviour_logp, advantages, mask


# ---- aggregate -----------------------------------------------------------------------------------
def test_aggregate_hand_computed():
  values = jnp.array([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 99.0, 99.0], [7.0, 7.0, 7.0, 7.0]])
  mask = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
  expected = {"token-mean": 40 / 6, "seq-mean-token-mean": (2.5 + 15) / 2,
              "seq-mean-token-sum": (10 + 30) / 2, "seq-mean-token-sum-norm": 40 / (3 * 4)}
  for mode, value in expected.items():
    assert jit_call(losses.aggregate, values, mask, mode=mode) == pytest.approx(value), mode
  assert jit_call(losses.aggregate, values, mask, mode="seq-mean-token-sum-norm",
                  max_length=8) == pytest.approx(40 / (3 * 8))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_matches_reference(mode):
  _, _, _, values, mask = random_batch(0)
  np.testing.assert_allclose(losses.aggregate(values, mask, mode),
                             ref_aggregate(values, mask, mode), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_empty_mask_is_zero_with_finite_gradient(mode):
  values = jnp.array([[1.0, jnp.inf], [jnp.nan, 2.0]])
  mask = jnp.zeros((2, 2), bool)
  loss, grad = jax.jit(jax.value_and_grad(lambda v: losses.aggregate(v, mask, mode)))(values)
  assert loss == 0.0
  np.testing.assert_array_equal(grad, np.zeros((2, 2)))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_parts_sum_over_halves(mode):
  _, _, _, values, mask = random_batch(3)
  num_a, den_a = losses.aggregate_parts(values[:2], mask[:2], mode, max_length=7)
  num_b, den_b = losses.aggregate_parts(values[2:], mask[2:], mode, max_length=7)
  whole = losses.aggregate(values, mask, mode, max_length=7)
  np.testing.assert_allclose((num_a + num_b) / max(den_a + den_b, 1.0), whole, rtol=1e-5)


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(hnp.arrays(np.float32, (3, 5), elements=st.floats(-10, 10, width=32)),
                  st.integers(1, 5))
def test_aggregate_modes_agree_for_equal_lengths(values, row_length):
  mask = np.arange(5)[None, :] < np.full((3, 1), row_length)
  agg = {mode: float(jit_call(losses.aggregate, values, mask, mode=mode)) for mode in AGG_MODES}
  token_mean, token_sum = agg["token-mean"], agg["seq-mean-token-sum"]
  np.testing.assert_allclose(agg["seq-mean-token-mean"], token_mean, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(token_sum, row_length * token_mean, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(agg["seq-mean-token-sum-norm"], token_sum / 5, rtol=1e-4, atol=1e-4)


# ---- clipped PPO ---------------------------------------------------------------------------------
# One row, five tokens, one per branch; a second row that is all padding, full of garbage.
#   ratio 1.5, A=+1: clipped at 1.2        -> loss -1.2, clipfrac
#   ratio 0.5, A=+1: unclipped             -> loss -0.5
#   ratio 0.5, A=-1: clipped at 0.8        -> loss  0.8, clipfrac
#   ratio 1.5, A=-1: unclipped             -> loss  1.5 (dual bound 3 not reached)
#   ratio 4.0, A=-1: unclipped, dual at 3  -> loss  4.0, or 3.0 with dual_clip=3
HAND_RATIOS = np.array([1.5, 0.5, 0.5, 1.5, 4.0])
HAND_OLD = np.array([[-1.0] * 5, [0.0] * 5], np.float32)
HAND_LOGP = np.array([list(-1.0 + np.log(HAND_RATIOS)), [200.0, np.nan, -np.inf, 0, 0]],
                     np.float32)
HAND_ADV = np.array([[1.0, 1.0, -1.0, -1.0, -1.0], [np.inf, 1.0, 1.0, np.nan, -1.0]], np.float32)
HAND_MASK = np.array([[1] * 5, [0] * 5], bool)


def test_clipped_policy_loss_hand_computed():
  loss, metrics = jit_call(losses.clipped_policy_loss, HAND_LOGP, HAND_OLD, HAND_ADV, HAND_MASK)
  np.testing.assert_allclose(loss, (-1.2 - 0.5 + 0.8 + 1.5 + 4.0) / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["clipfrac"], (2.0, 5.0))
  np.testing.assert_allclose(metrics["dual_clip_frac"], (0.0, 5.0))
  np.testing.assert_allclose(metrics["ratio_mean"], (8.0, 5.0), rtol=1e-6)
  np.testing.assert_allclose(metrics["approx_kl"][0], -np.log(HAND_RATIOS).sum(), rtol=1e-5)

  loss, metrics = jit_call(losses.clipped_policy_loss, HAND_LOGP, HAND_OLD, HAND_ADV, HAND_MASK,
                           dual_clip=3.0)
  np.testing.assert_allclose(loss, (-1.2 - 0.5 + 0.8 + 1.5 + 3.0) / 5, rtol=1e-6)
  np.testing.assert_allclose(metrics["dual_clip_frac"], (1.0, 5.0))
  np.testing.assert_allclose(metrics["clipfrac"], (2.0, 5.0))


def test_clip_higher_is_asymmetric():
  # clip_high=0.28 (DAPO): ratio 1.5 with A=+1 is clipped at 1.28; the low side still at 0.8.
  loss, _ = jit_call(losses.clipped_policy_loss, HAND_LOGP, HAND_OLD, HAND_ADV, HAND_MASK,
                     clip_low=0.2, clip_high=0.28)
  np.testing.assert_allclose(loss, (-1.28 - 0.5 + 0.8 + 1.5 + 4.0) / 5, rtol=1e-6)


def test_clipped_gradient_hand_computed_and_padding_has_none():
  grad = jax.jit(jax.grad(lambda lp: losses.clipped_policy_loss(
      lp, HAND_OLD, HAND_ADV, HAND_MASK, dual_clip=3.0)[0]))(HAND_LOGP)
  # d(-r A)/d logp = -r A on unclipped tokens; clipped and dual-clipped tokens have none.
  np.testing.assert_allclose(grad[0], np.array([0.0, -0.5, 0.0, 1.5, 0.0]) / 5, rtol=1e-6)
  np.testing.assert_array_equal(grad[1], np.zeros(5))


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_clipped_policy_loss_matches_reference(agg_mode, dual_clip):
  for seed in (2, 3):
    logp, old_logp, _, advantages, mask = random_batch(seed, spread=1.0)
    loss, metrics = losses.clipped_policy_loss(logp, old_logp, advantages, mask, clip_low=0.2,
                                               clip_high=0.28, dual_clip=dual_clip,
                                               agg_mode=agg_mode)
    ref_loss, ref_metrics = ref_policy_loss(logp, old_logp, advantages, mask, 0.2, 0.28,
                                            dual_clip, agg_mode)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert_metrics_close(metrics, ref_metrics)
    assert ref_metrics["clipfrac"][0] > 0  # the data reach the clipped branch
    if dual_clip is not None:
      assert ref_metrics["dual_clip_frac"][0] > 0


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    hnp.arrays(np.float32, (3, 4), elements=st.floats(-3, 3, width=32)),
    hnp.arrays(np.float32, (3, 4), elements=st.floats(-5, 5, width=32)),
    hnp.arrays(np.bool_, (3, 4)))
def test_clip_fractions_are_fractions_and_disjoint(log_ratio, advantages, mask):
  _, metrics = _jitted_clipped(log_ratio, jnp.zeros((3, 4)), advantages, mask)
  (clipped, count), (dual, dual_count) = metrics["clipfrac"], metrics["dual_clip_frac"]
  assert count == dual_count == mask.sum()
  assert 0 <= clipped <= count and 0 <= dual <= count
  assert clipped + dual <= count  # the dual clip acts only where the PPO clip does not


_jitted_clipped = jax.jit(functools.partial(losses.clipped_policy_loss, dual_clip=3.0))


# ---- decoupled PPO -------------------------------------------------------------------------------
def test_decoupled_hand_computed():
  # Current == proximal (ratio 1), A = +1, so each token's PPO loss is -1 and the loss is -w.
  proximal = jnp.array([[-1.0, -1.0, -1.0, -1.0]])
  behaviour = proximal - jnp.log(jnp.array([[2.0, 0.5, 10.0, 1.0]]))  # w = 2, 0.5, 10, 1
  advantages, mask = jnp.ones((1, 4)), jnp.array([[1, 1, 1, 0]], bool)
  arrays = (proximal, proximal, behaviour, advantages, mask)
  loss, metrics = jit_call(losses.decoupled_policy_loss, *arrays, is_cap=5.0, is_cap_mode="mask")
  np.testing.assert_allclose(loss, -(2.0 + 0.5 + 0.0) / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["masked_fraction"], (1.0, 3.0))
  np.testing.assert_allclose(metrics["is_weight_mean"], (12.5, 3.0), rtol=1e-6)
  np.testing.assert_allclose(metrics["is_weight_max"], 10.0, rtol=1e-6)

  loss, metrics = jit_call(losses.decoupled_policy_loss, *arrays, is_cap=5.0, is_cap_mode="clamp")
  np.testing.assert_allclose(loss, -(2.0 + 0.5 + 5.0) / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["masked_fraction"], (0.0, 3.0))
  np.testing.assert_allclose(metrics["capped_fraction"], (1.0, 3.0))

  loss, _ = jit_call(losses.decoupled_policy_loss, *arrays, is_cap=None)
  np.testing.assert_allclose(loss, -(2.0 + 0.5 + 10.0) / 3, rtol=1e-6)

  # Valid weights below 1 and a padded token with w = 8: the maximum is over valid tokens only.
  behaviour = proximal - jnp.log(jnp.array([[0.5, 0.25, 0.125, 8.0]]))
  _, metrics = jit_call(losses.decoupled_policy_loss, proximal, proximal, behaviour, advantages,
                        mask, is_cap=5.0, is_cap_mode="mask")
  np.testing.assert_allclose(metrics["is_weight_max"], 0.5, rtol=1e-6)


@pytest.mark.parametrize("is_cap,is_cap_mode", [(2.0, "mask"), (2.0, "clamp"), (None, "mask")])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dual_clip", [None, 2.0])
def test_decoupled_matches_reference(is_cap, is_cap_mode, agg_mode, dual_clip):
  logp, proximal, behaviour, advantages, mask = random_batch(4, spread=0.8)
  loss, metrics = losses.decoupled_policy_loss(logp, proximal, behaviour, advantages, mask,
                                               clip_low=0.2, clip_high=0.3, dual_clip=dual_clip,
                                               is_cap=is_cap, is_cap_mode=is_cap_mode,
                                               agg_mode=agg_mode)
  ref_loss, ref_metrics = ref_policy_loss(logp, proximal, advantages, mask, 0.2, 0.3, dual_clip,
                                          agg_mode, behaviour, is_cap, is_cap_mode)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
  assert_metrics_close(metrics, ref_metrics)
  if is_cap is not None:
    assert ref_metrics["capped_fraction"][0] > 0  # the data exceed the cap


def _assert_decoupled_equals_clipped(transform, agg_mode, dual_clip, is_cap_mode):
  logp, old_logp, _, advantages, mask = random_batch(5, spread=1.0)
  kwargs = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, agg_mode=agg_mode)

  def decoupled(lp):
    return losses.decoupled_policy_loss(lp, old_logp, old_logp, advantages, mask, is_cap=1.0,
                                        is_cap_mode=is_cap_mode, **kwargs)

  def clipped(lp):
    return losses.clipped_policy_loss(lp, old_logp, advantages, mask, **kwargs)

  (loss_d, metrics_d), grad_d = transform(jax.value_and_grad(decoupled, has_aux=True))(logp)
  (loss_c, metrics_c), grad_c = transform(jax.value_and_grad(clipped, has_aux=True))(logp)
  assert loss_d == loss_c
  np.testing.assert_array_equal(grad_d, grad_c)
  for key, value in metrics_c.items():
    np.testing.assert_array_equal(metrics_d[key], value, err_msg=key)
  np.testing.assert_array_equal(metrics_d["masked_fraction"][0], 0.0)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
def test_decoupled_equals_clipped_when_proximal_is_behaviour(agg_mode):
  for dual_clip in (None, 3.0):
    for is_cap_mode in ("mask", "clamp"):
      _assert_decoupled_equals_clipped(lambda f: f, agg_mode, dual_clip, is_cap_mode)


def test_decoupled_equals_clipped_when_proximal_is_behaviour_under_jit():
  _assert_decoupled_equals_clipped(jax.jit, "seq-mean-token-mean", 3.0, "mask")


def test_decoupled_overflowing_weights_stay_finite():
  # Weights exp(100) overflow to inf: masked (or clamped) tokens must not turn the loss into NaN.
  proximal = jnp.zeros((2, 3))
  behaviour = jnp.array([[-100.0, 0.0, -0.1], [-100.0, -100.0, -100.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0]], bool)
  logp = jnp.full((2, 3), 0.1)
  for mode in ("mask", "clamp"):
    def objective(lp, mode=mode):
      return losses.decoupled_policy_loss(lp, proximal, behaviour, jnp.ones((2, 3)), mask,
                                          is_cap_mode=mode)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(objective, has_aux=True))(logp)
    assert np.isfinite(loss) and np.all(np.isfinite(grad)), mode
    np.testing.assert_allclose(metrics["capped_fraction"], (3.0, 5.0))


# ---- proximal logprobs ---------------------------------------------------------------------------
def test_loglinear_hand_computed():
  behaviour = jnp.full((1, 5), -2.0)
  current = jnp.full((1, 5), -1.0)
  versions = jnp.array([[3, 4, 5, 2, 0]])
  got = jit_call(proximal_lib.loglinear_proximal_logprob, behaviour, current, versions, 4, 5)
  # alpha = (4 - v) / (5 - v): 1/2, 0 (token of the proximal version), 1 (v == current),
  # 2/3, 4/5.
  np.testing.assert_allclose(got, [[-1.5, -2.0, -1.0, -2 + 2 / 3, -2 + 4 / 5]], rtol=1e-6)


def test_loglinear_alpha_edge_cases():
  behaviour = jnp.full((1, 4), -3.0)
  current = jnp.full((1, 4), -1.0)
  # Proximal older than the token (alpha < 0 -> 0) and proximal newer than current (-> 1).
  loglinear = jax.jit(proximal_lib.loglinear_proximal_logprob)
  got = loglinear(behaviour, current, jnp.array([[3, 3, 3, 4]]), 2, 4.0)
  np.testing.assert_allclose(got, [[-3.0, -3.0, -3.0, -1.0]])
  got = loglinear(behaviour, current, jnp.array([[3, 3, 4, 0]]), 7, 4.0)
  np.testing.assert_allclose(got, [[-1.0, -1.0, -1.0, -1.0]])
  # Fractional current version: (4 - 3) / (4.5 - 3) = 2/3.
  got = loglinear(behaviour, current, jnp.array([[3, 4, 4, 4]]), 4, 4.5)
  np.testing.assert_allclose(got[0, 0], -3.0 + 2 * 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(got[0, 1:], [-3.0] * 3)


def test_loglinear_matches_reference_and_stops_gradient():
  rng = np.random.default_rng(6)
  behaviour = rng.uniform(-4, 0, (3, 5)).astype(np.float32)
  current = rng.uniform(-4, 0, (3, 5)).astype(np.float32)
  versions = rng.integers(0, 6, (3, 5))
  got = proximal_lib.loglinear_proximal_logprob(behaviour, current, versions, 4, 6)
  for b in range(3):
    for t in range(5):
      v = versions[b, t]
      alpha = 1.0 if v == 6 else min(max((4 - v) / (6 - v), 0.0), 1.0)
      np.testing.assert_allclose(got[b, t], behaviour[b, t] + alpha * (current[b, t] -
                                                                        behaviour[b, t]),
                                 rtol=1e-5, atol=1e-6)
  grad = jax.grad(lambda cur: jnp.sum(proximal_lib.loglinear_proximal_logprob(
      behaviour, cur, versions, 4, 6)))(jnp.asarray(current))
  np.testing.assert_array_equal(grad, np.zeros((3, 5)))


def test_proximal_logprob_dispatch():
  behaviour, current, recomputed = (jnp.full((1, 2), x) for x in (-2.0, -1.0, -1.7))
  versions = jnp.array([[0, 1]])
  np.testing.assert_array_equal(
      proximal_lib.proximal_logprob("rollout", behaviour_logp=behaviour), behaviour)
  np.testing.assert_array_equal(
      proximal_lib.proximal_logprob("recompute", behaviour_logp=behaviour, recomputed_logp=recomputed),
      recomputed)
  np.testing.assert_allclose(
      proximal_lib.proximal_logprob("loglinear", behaviour_logp=behaviour, current_logp=current,
                              token_versions=versions, proximal_version=1, current_version=2),
      [[-1.5, -2.0]])
  grad = jax.grad(lambda r: jnp.sum(proximal_lib.proximal_logprob(
      "recompute", behaviour_logp=behaviour, recomputed_logp=r)))(recomputed)
  np.testing.assert_array_equal(grad, np.zeros((1, 2)))


def test_proximal_logprob_missing_inputs_raise():
  behaviour = jnp.zeros((1, 2))
  with pytest.raises(ValueError, match="recomputed_logp"):
    proximal_lib.proximal_logprob("recompute", behaviour_logp=behaviour)
  with pytest.raises(ValueError, match="token_versions, proximal_version"):
    proximal_lib.proximal_logprob("loglinear", behaviour_logp=behaviour, current_logp=behaviour,
                            current_version=3)
  with pytest.raises(ValueError, match="source.*recompute.*got 'behaviour'"):
    proximal_lib.proximal_logprob("behaviour", behaviour_logp=behaviour)


# ---- KL, entropy, logprobs -----------------------------------------------------------------------
def test_kl_penalty_hand_computed():
  logp, ref_logp = jnp.array([[-1.0, -2.0]]), jnp.array([[-2.0, -2.0]])
  np.testing.assert_allclose(jit_call(losses.kl_penalty, logp, ref_logp, kind="k1"), [[1.0, 0.0]])
  np.testing.assert_allclose(jit_call(losses.kl_penalty, logp, ref_logp, kind="k2"), [[0.5, 0.0]])
  np.testing.assert_allclose(jit_call(losses.kl_penalty, logp, ref_logp, kind="k3"),
                             [[math.exp(-1), 0.0]], rtol=1e-6)
  # low_var_kl: d = 30 is clipped to 20, and exp(20) - 21 to 10; d = 1 is plain k3.
  np.testing.assert_allclose(jit_call(losses.kl_penalty, jnp.array([[-31.0, -2.0]]),
                                      jnp.array([[-1.0, -1.0]]), kind="low_var_kl"),
                             [[10.0, math.e - 2]], rtol=1e-6)
  # Far outside the clip range exp(d) would overflow; the gradient must stay finite (and zero).
  grad = jax.jit(jax.grad(lambda lp: jnp.sum(losses.kl_penalty(lp, jnp.zeros((1, 2)),
                                                               "low_var_kl"))))(
      jnp.array([[-100.0, 100.0]]))
  np.testing.assert_array_equal(grad, [[0.0, 0.0]])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_penalty_matches_reference(kind):
  rng = np.random.default_rng(7)
  logp = rng.uniform(-5, 0, (3, 4)).astype(np.float32)
  ref_logp = rng.uniform(-5, 0, (3, 4)).astype(np.float32)
  got = losses.kl_penalty(logp, ref_logp, kind)
  expected = [[ref_kl(float(a), float(b), kind) for a, b in zip(r1, r2)]
              for r1, r2 in zip(logp, ref_logp)]
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_k3_is_an_unbiased_estimate_of_kl():
  # Categorical p, q over 3 outcomes: sum_x p(x) k(x) equals KL(p || q) for k1 and k3.
  p, q = np.array([0.6, 0.3, 0.1]), np.array([0.2, 0.5, 0.3])
  exact = float(np.sum(p * np.log(p / q)))
  logp, ref_logp = jnp.log(p)[None], jnp.log(q)[None]
  for kind in ("k1", "k3"):
    estimate = jit_call(losses.kl_penalty, logp, ref_logp, kind=kind)[0]
    np.testing.assert_allclose(np.sum(p * estimate), exact, rtol=1e-5)


def test_entropy_hand_computed_and_stable():
  logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [0.0, -jnp.inf, 0.0, -jnp.inf],
                       [1e4, 0.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]]])
  mask = jnp.array([[1, 1, 1, 0]])

  def entropy_and_grad(x):
    return (losses.entropy_from_logits(x, mask),
            jax.grad(lambda y: jnp.sum(losses.entropy_from_logits(y, mask)))(x))

  got, grad = jax.jit(entropy_and_grad)(logits)
  np.testing.assert_allclose(got, [[math.log(4), math.log(2), 0.0, 0.0]], atol=1e-6)
  assert np.all(np.isfinite(grad))
  # Temperature 2 on logits [ln 9, 0]: p = [3/4, 1/4].
  hot = jit_call(losses.entropy_from_logits, jnp.array([[[math.log(9.0), 0.0]]]), temperature=2.0)
  np.testing.assert_allclose(hot, [[-(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]], rtol=1e-6)


def test_entropy_matches_reference():
  logits = np.random.default_rng(8).normal(0, 3, (2, 3, 7)).astype(np.float32)
  got = losses.entropy_from_logits(logits)
  for b in range(2):
    for t in range(3):
      z = logits[b, t].astype(np.float64)
      p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
      np.testing.assert_allclose(got[b, t], -np.sum(p * np.log(p)), rtol=1e-5)


def test_token_logprobs_hand_computed():
  logits = jnp.array([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
  got = jit_call(losses.token_logprobs, logits, jnp.array([[1, 0]]))
  np.testing.assert_allclose(got, [[math.log(0.75), math.log(0.25)]], rtol=1e-6)
  hot = jit_call(losses.token_logprobs, logits, jnp.array([[1, 0]]), temperature=2.0)
  s3 = math.sqrt(3.0)
  np.testing.assert_allclose(hot, [[math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))]], rtol=1e-6)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_equal_gathered_log_softmax(temperature):
  rng = np.random.default_rng(9)
  logits = jnp.asarray(rng.normal(0, 4, (3, 5, 11)), jnp.bfloat16)
  targets = jnp.asarray(rng.integers(0, 11, (3, 5)))
  got = losses.token_logprobs(logits, targets, temperature)
  assert got.dtype == jnp.float32
  full = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  np.testing.assert_array_equal(got, jnp.take_along_axis(full, targets[..., None], -1)[..., 0])
  # Gradient: one-hot(target) - softmax, as for the full log-softmax.
  grad = jax.jit(jax.grad(lambda x: jnp.sum(losses.token_logprobs(x, targets, temperature))))(
      logits.astype(jnp.float32))
  expected = (jax.nn.one_hot(targets, 11) - jax.nn.softmax(full, axis=-1)) / temperature
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-6)
  big = jit_call(losses.token_logprobs, np.array([[[1e30, 1e30, -1e30, 1e30]]], np.float32),
                 np.array([[0]]))
  np.testing.assert_allclose(big, [[-math.log(3.0)]], rtol=1e-6)


# ---- the combined objective ----------------------------------------------------------------------
@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_policy_loss_combines_terms(decoupled, agg_mode):
  logp, old_logp, behaviour, advantages, mask = random_batch(10)
  ref_logp = old_logp - 0.3
  entropy = np.abs(np.random.default_rng(10).normal(size=logp.shape)).astype(np.float32)
  total, metrics = losses.policy_loss(
      logp, old_logp, advantages, mask, behaviour_logp=behaviour if decoupled else None,
      ref_logp=ref_logp, entropy=entropy, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01,
      agg_mode=agg_mode, max_length=8, is_cap=2.0)
  pg, ref_metrics = ref_policy_loss(logp, old_logp, advantages, mask, agg_mode=agg_mode,
                                    behaviour_logp=behaviour if decoupled else None, is_cap=2.0)
  pg = pg * 6 / 8 if agg_mode == "seq-mean-token-sum-norm" else pg  # max_length 8, not T = 6
  kl = np.vectorize(lambda a, b: ref_kl(a, b, "k3"))(logp, ref_logp)
  expected = (pg + 0.1 * ref_aggregate(kl, mask, agg_mode, 8) -
              0.01 * ref_aggregate(entropy, mask, agg_mode, 8))
  np.testing.assert_allclose(total, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["pg_loss"], (pg, 1.0), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["kl"][0], np.sum(kl * mask), rtol=1e-5)
  np.testing.assert_allclose(metrics["entropy"], (np.sum(entropy * mask), mask.sum()), rtol=1e-5)
  assert_metrics_close(metrics, ref_metrics)
  expected_keys = {"pg_loss", "kl", "entropy", "clipfrac", "dual_clip_frac", "ratio_mean",
                   "approx_kl"}
  if decoupled:
    expected_keys |= {"is_weight_mean", "is_weight_max", "capped_fraction", "masked_fraction"}
  assert set(metrics) == expected_keys


def test_policy_loss_without_optional_terms_is_the_policy_term():
  logp, old_logp, _, advantages, mask = random_batch(11)
  total, metrics = losses.policy_loss(logp, old_logp, advantages, mask)
  pg, _ = losses.clipped_policy_loss(logp, old_logp, advantages, mask)
  assert total == pg
  assert "kl" not in metrics and "entropy" not in metrics


def test_padding_garbage_reaches_neither_loss_nor_gradient_nor_metrics():
  logp, old_logp, behaviour, advantages, mask = random_batch(12)
  pad = ~mask
  # Values that overflow exp() in either direction, and NaN, on padded tokens only.
  logp = np.where(pad, -300.0, logp).astype(np.float32)
  ref_logp = np.where(pad, 300.0, old_logp).astype(np.float32)
  proximal = np.where(pad, 200.0, old_logp).astype(np.float32)
  behaviour = np.where(pad, -200.0, behaviour).astype(np.float32)
  advantages = np.where(pad, np.nan, advantages).astype(np.float32)
  entropy = np.where(pad, np.inf, 1.0).astype(np.float32)

  for agg_mode in ("token-mean", "seq-mean-token-mean"):
    def objective(lp, ent, agg_mode=agg_mode):
      return losses.policy_loss(lp, proximal, advantages, mask, behaviour_logp=behaviour,
                                ref_logp=ref_logp, entropy=ent, kl_coef=0.1, entropy_coef=0.01,
                                dual_clip=3.0, agg_mode=agg_mode)

    (loss, metrics), (grad_logp, grad_entropy) = jax.value_and_grad(
        objective, argnums=(0, 1), has_aux=True)(logp, entropy)
    assert np.isfinite(loss)
    assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(metrics)), metrics
    np.testing.assert_array_equal(np.asarray(grad_logp)[pad], 0.0)
    np.testing.assert_array_equal(np.asarray(grad_entropy)[pad], 0.0)
    assert np.all(np.isfinite(grad_logp)) and np.any(np.asarray(grad_logp)[mask] != 0.0)


# ---- (sum, count) metrics, jit, vmap -------------------------------------------------------------
def _reduce(metrics_a, metrics_b):
  return {k: (max(a, metrics_b[k]) if k.endswith("_max") else (a[0] + metrics_b[k][0],
                                                               a[1] + metrics_b[k][1]))
          for k, a in metrics_a.items()}


def test_metrics_summed_over_halves_equal_whole_batch():
  logp, old_logp, behaviour, advantages, mask = random_batch(13)
  kwargs = dict(ref_logp=old_logp - 0.2, entropy=np.ones_like(logp), behaviour_logp=behaviour,
                dual_clip=2.0, is_cap=2.0)

  def metrics_of(rows):
    return losses.policy_loss(logp[rows], old_logp[rows], advantages[rows], mask[rows],
                              **{k: v[rows] if isinstance(v, np.ndarray) else v
                                 for k, v in kwargs.items()})[1]

  whole = metrics_of(slice(None))
  halves = _reduce(metrics_of(slice(0, 2)), metrics_of(slice(2, 4)))
  for key, value in whole.items():
    if key == "pg_loss":  # a per-call scalar: (loss, 1) per half
      assert halves[key][1] == 2.0
      continue
    np.testing.assert_allclose(halves[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_jit_and_vmap_match_eager():
  batches = [random_batch(20 + i) for i in range(3)]
  stacked = [jnp.stack(arrays) for arrays in zip(*batches)]  # each [M, B, T]
  fn = functools.partial(losses.policy_loss, kl_coef=0.05, kl_kind="low_var_kl",
                         dual_clip=3.0, is_cap=2.0, is_cap_mode="clamp",
                         agg_mode="seq-mean-token-mean")

  def call(logp, old_logp, behaviour, advantages, mask):
    return fn(logp, old_logp, advantages, mask, behaviour_logp=behaviour, ref_logp=old_logp - 0.1)

  eager = [call(*batch) for batch in batches]
  jitted = jax.jit(call)(*batches[0])
  np.testing.assert_allclose(jitted[0], eager[0][0], rtol=1e-6)
  assert jax.tree.structure(jitted[1]) == jax.tree.structure(eager[0][1])
  for got, expected in zip(jax.tree.leaves(jitted[1]), jax.tree.leaves(eager[0][1])):
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
  vmapped = jax.jit(jax.vmap(call))(*stacked)
  for m in range(3):
    np.testing.assert_allclose(vmapped[0][m], eager[m][0], rtol=1e-6)
    for got, expected in zip(jax.tree.leaves(vmapped[1]), jax.tree.leaves(eager[m][1])):
      np.testing.assert_allclose(got[m], expected, rtol=1e-5, atol=1e-6)


def test_batch_sharded_over_devices_matches_unsharded():
  if jax.device_count() < 2:
    pytest.skip("needs several (forced host) devices")
  batches = [random_batch(40 + i) for i in range(2)]
  arrays = [np.concatenate(parts) for parts in zip(*batches)]  # [8, T]: rows over devices
  mesh = sharding.make_mesh()
  sharded = [jax.device_put(x, sharding.batch_sharding(mesh, x.shape)) for x in arrays]
  assert len({shard.device for shard in sharded[0].addressable_shards}) > 1

  def call(logp, old_logp, behaviour, advantages, mask):
    return losses.policy_loss(logp, old_logp, advantages, mask, behaviour_logp=behaviour,
                              ref_logp=old_logp - 0.1, kl_coef=0.05, dual_clip=3.0, is_cap=2.0,
                              agg_mode="seq-mean-token-mean")

  update = jax.jit(jax.value_and_grad(call, has_aux=True))
  (loss, metrics), grad = update(*sharded)
  (loss_ref, metrics_ref), grad_ref = update(*arrays)
  np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
  np.testing.assert_allclose(grad, grad_ref, rtol=1e-6, atol=1e-9)
  for got, expected in zip(jax.tree.leaves(metrics), jax.tree.leaves(metrics_ref)):
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_vmap_of_logprob_helpers():
  rng = np.random.default_rng(30)
  logits = jnp.asarray(rng.normal(size=(2, 3, 4, 5)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 5, (2, 3, 4)))
  mask = jnp.asarray(rng.integers(0, 2, (2, 3, 4)), bool)
  logprobs = jax.jit(jax.vmap(losses.token_logprobs))(logits, targets)
  entropy = jax.jit(jax.vmap(losses.entropy_from_logits))(logits, mask)
  versions = jnp.asarray(rng.integers(0, 4, (2, 3, 4)))
  loglinear = jax.jit(jax.vmap(proximal_lib.loglinear_proximal_logprob,
                               in_axes=(0, 0, 0, None, 0)))
  proximal = loglinear(logprobs, logprobs * 0.5, versions, 2, jnp.array([3.0, 4.0]))
  for m, current_version in enumerate((3.0, 4.0)):
    np.testing.assert_allclose(logprobs[m], jit_call(losses.token_logprobs, logits[m], targets[m]),
                               rtol=1e-6)
    np.testing.assert_allclose(entropy[m], jit_call(losses.entropy_from_logits, logits[m],
                                                    mask[m]), rtol=1e-5)
    np.testing.assert_allclose(proximal[m], jit_call(
        proximal_lib.loglinear_proximal_logprob, logprobs[m], logprobs[m] * 0.5, versions[m], 2,
        current_version), rtol=1e-6)


# ---- bad configuration ---------------------------------------------------------------------------
def test_bad_modes_raise_naming_the_argument():
  x, mask = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
  with pytest.raises(ValueError, match="agg_mode.*token-mean.*got 'token_mean'"):
    losses.aggregate(x, mask, "token_mean")
  with pytest.raises(ValueError, match="agg_mode.*'mean'"):
    losses.clipped_policy_loss(x, x, x, mask, agg_mode="mean")
  with pytest.raises(ValueError, match="is_cap_mode.*mask.*clamp.*got 'clip'"):
    losses.decoupled_policy_loss(x, x, x, x, mask, is_cap_mode="clip")
  with pytest.raises(ValueError, match="kind.*'k4'"):
    losses.kl_penalty(x, x, "k4")
  with pytest.raises(ValueError, match="kl_kind.*'kl'"):
    losses.policy_loss(x, x, x, mask, ref_logp=x, kl_kind="kl")


def test_bad_numbers_raise_naming_the_argument():
  x, mask = jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
  with pytest.raises(ValueError, match="dual_clip.*1.0"):
    losses.clipped_policy_loss(x, x, x, mask, dual_clip=1.0)
  with pytest.raises(ValueError, match="clip_low.*-0.1"):
    losses.clipped_policy_loss(x, x, x, mask, clip_low=-0.1)
  with pytest.raises(ValueError, match="clip_low.*1.5"):
    losses.clipped_policy_loss(x, x, x, mask, clip_low=1.5)
  with pytest.raises(ValueError, match="clip_high"):
    losses.clipped_policy_loss(x, x, x, mask, clip_high=-1.0)
  with pytest.raises(ValueError, match="is_cap.*0.5"):
    losses.decoupled_policy_loss(x, x, x, x, mask, is_cap=0.5)
  with pytest.raises(ValueError, match="temperature"):
    losses.token_logprobs(jnp.zeros((1, 1, 2)), jnp.zeros((1, 1), jnp.int32), temperature=0.0)
  with pytest.raises(ValueError, match="max_length"):
    losses.aggregate(x, mask, "seq-mean-token-sum-norm", max_length=0)
  with pytest.raises(ValueError, match="kl_coef.*ref_logp"):
    losses.policy_loss(x, x, x, mask, kl_coef=0.1)
  with pytest.raises(ValueError, match="entropy_coef.*entropy"):
    losses.policy_loss(x, x, x, mask, entropy_coef=0.1)


def test_shape_mismatch_fails_at_trace_time():
  with pytest.raises(AssertionError, match="advantages"):
    losses.clipped_policy_loss(jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros((2,)),
                               jnp.ones((2, 3)))
