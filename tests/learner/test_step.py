"""Tests for jaxrl_async.learner.step: sharded update == single-device update, on-policy
equivalences, logprobs against a numpy reference, configuration errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_async import sharding
from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import collate
from jaxrl_async.learner.step import LearnerConfig
from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
from jaxrl_async.sharding import MeshShape
from jaxrl_async.types import Sample

CONFIG = get_config("tiny")
GROUP_SIZE = 4
NUM_GROUPS = 2
SEQ_LEN = 16
NUM_UPDATES = 3


@pytest.fixture(scope="module")
def model():
  module = init_model(CONFIG, seed=0)
  graphdef, params = split_model(module)
  # Host copies: every state below is built from them, and donation never touches them.
  return graphdef, jax.device_get(params), param_logical_axes(module)


@pytest.fixture(scope="module")
def logprob_fn(model):
  return step_lib.make_logprob_fn(model[0], 1.0)


def make_batch(seed, logprob_fn=None, params=None, offset=0.0):
  """NUM_GROUPS groups of GROUP_SIZE random samples; behaviour logprobs from `params` when
  given (exactly on-policy when offset=0), else random."""
  rng = np.random.default_rng(seed)
  groups = []
  for g in range(NUM_GROUPS):
    prompt = np.concatenate([[1], rng.integers(5, 15, rng.integers(2, 6)), [4]])
    group = []
    for k in range(GROUP_SIZE):
      n = int(rng.integers(3, SEQ_LEN - len(prompt) + 1))
      group.append(Sample(prompt_id=g, group_id=g, group_size=GROUP_SIZE, prompt_tokens=prompt,
                          response_tokens=rng.integers(2, 15, n),
                          behaviour_logprobs=-rng.uniform(1.5, 3.5, n),
                          token_versions=np.zeros(n), reward=float(rng.integers(0, 3)),
                          meta={"index_in_group": k}))
    groups.append(group)
  batch = collate(groups, SEQ_LEN)
  if logprob_fn is not None:
    logp = np.asarray(logprob_fn(params, jnp.asarray(batch.tokens)))
    batch = batch.replace(behaviour_logprobs=(logp + offset) * batch.response_mask)
  return batch


def run_updates(model, mesh, config, batches, anchor_scale=0.98):
  """NUM_UPDATES updates on `mesh`; returns (host params, metrics list, state, update fn)."""
  graphdef, params, axes = model
  state = step_lib.init_train_state(params, config.optimizer(), mesh, axes)
  update = step_lib.make_update_fn(graphdef, config, GROUP_SIZE, step_lib.state_shardings(state))
  update.tx = state.tx  # the optimizer is static in the state: reuse it to reuse the compile
  metrics = []
  for batch in batches:
    batch = step_lib.shard_batch(batch, mesh)
    anchor = batch.behaviour_logprobs * anchor_scale  # a proximal policy near the behaviour one
    state, step_metrics = update(state, batch, anchor, np.float32(0), np.float32(0))
    metrics.append(jax.device_get(step_metrics))
  return jax.device_get(state.params), metrics, state, update


@pytest.fixture(scope="module")
def batches(model, logprob_fn):
  return [make_batch(seed, logprob_fn, model[1], offset=0.1 * seed) for seed in range(NUM_UPDATES)]


@pytest.fixture(scope="module")
def mesh8():
  return sharding.make_mesh(MeshShape(fsdp=4, tensor=2))


@pytest.fixture(scope="module")
def mesh1():
  return sharding.make_mesh(MeshShape(), jax.devices()[:1])


@pytest.fixture(scope="module")
def single_run(model, batches, mesh1):
  params, metrics, state, update = run_updates(model, mesh1, LearnerConfig(), batches)
  return params, metrics, state, update._cache_size(), update


@pytest.fixture(scope="module")
def sharded_run(model, batches, mesh8):
  params, metrics, state, update = run_updates(model, mesh8, LearnerConfig(), batches)
  return params, metrics, state, update, update._cache_size()


# ---- sharded == single device --------------------------------------------------------------------
def test_sharded_update_equals_single_device_update(model, single_run, sharded_run):
  initial = model[1]
  single, single_metrics, _, _, _ = single_run
  sharded, sharded_metrics, _, _, _ = sharded_run
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), single, initial))
  assert max(moved) > 1e-4  # the updates really changed the parameters
  differences = jax.tree.map(lambda a, b: np.max(np.abs(a - b)), single, sharded)
  worst = max(jax.tree.leaves(differences))
  assert worst <= 1e-5, differences
  for a, b in zip(single_metrics, sharded_metrics):
    for name in ("loss", "grad_norm", "advantage_abs_mean"):
      assert float(a[name]) == pytest.approx(float(b[name]), rel=1e-4, abs=1e-6), name


def test_parameters_and_optimizer_state_are_sharded_on_the_mesh(sharded_run, mesh8):
  _, _, state, _, _ = sharded_run
  shardings = jax.tree.leaves(step_lib.state_shardings(state).params)
  not_replicated = [s for s in shardings if any(axis is not None for axis in s.spec)]
  assert len(not_replicated) > len(shardings) // 2, [str(s.spec) for s in shardings]
  assert not all(s.is_fully_replicated for s in shardings)
  embed = state.params["embed"]
  assert embed.sharding.spec == P("tensor", "fsdp") and embed.sharding.mesh == mesh8
  assert {s.data.shape for s in embed.addressable_shards} == {(8, 16)}
  gate = state.params["blocks"][0]["mlp"]["gate"]
  assert {s.data.shape for s in gate.addressable_shards} == {(16, 96)}
  devices = set(mesh8.devices.flat)
  for leaf in jax.tree.leaves(state.opt_state) + [state.step]:
    assert set(leaf.sharding.device_set) == devices
  # Adam's moments are laid out like the parameters.
  mu = state.opt_state[1][0].mu
  assert mu["embed"].sharding.spec == P("tensor", "fsdp")
  assert int(state.step) == NUM_UPDATES


def test_update_compiles_once(single_run, sharded_run):
  assert single_run[3] == 1
  assert sharded_run[4] == 1


def test_behaviour_kl_is_the_k3_estimate_on_response_tokens():
  """KL(behaviour || current): exp(d) - d - 1 with d = current - behaviour, response tokens only;
  0 where the weights that drew the tokens are the ones trained."""
  class Batch:
    behaviour_logprobs = jnp.asarray([[0.0, -1.0, -2.0, -0.5], [0.0, -0.3, -9.0, -1.0]])

  logp = jnp.asarray([[-1.2, -2.5, -0.5], [-0.3, -1.0, -4.0]])  # positions 1..3
  mask = jnp.asarray([[1, 1, 0], [1, 0, 1]])
  total, count = step_lib.behaviour_kl(logp, Batch, mask)
  d = np.asarray(logp) - np.asarray(Batch.behaviour_logprobs)[:, 1:]
  k3 = np.exp(d) - d - 1.0
  assert float(count) == 4
  assert float(total) == pytest.approx(float(np.sum(k3 * np.asarray(mask))), rel=1e-5)
  same, _ = step_lib.behaviour_kl(Batch.behaviour_logprobs[:, 1:], Batch, mask)
  assert float(same) == 0.0


def test_update_metrics(single_run):
  _, metrics, _, _, _ = single_run
  expected = {"loss", "grad_norm", "advantage_abs_mean", "pg_loss", "clipfrac", "entropy",
              "behaviour_kl"}
  assert expected <= set(metrics[0])
  for m in metrics:
    assert np.isfinite(float(m["loss"])) and float(m["grad_norm"]) > 0
    total, count = m["entropy"]
    assert 0 < float(total) / float(count) <= np.log(CONFIG.vocab_size) + 1e-5


# ---- on-policy equivalences ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_policy_batch(model, logprob_fn):
  return make_batch(10, logprob_fn, model[1])


def _one_update(model, mesh, update, tx, batch, anchor):
  _, params, axes = model
  state = step_lib.init_train_state(params, tx, mesh, axes)
  state, metrics = update(state, batch, anchor, np.float32(0), np.float32(0))
  return jax.device_get(state.params), jax.device_get(metrics)


def test_on_policy_ppo_and_decoupled_take_the_same_step(model, mesh1, single_run,
                                                        on_policy_batch):
  """On-policy (behaviour == current), PPO on the rollout logprobs and the decoupled objective
  with a recomputed anchor (here the same logprobs) take the same step."""
  graphdef = model[0]
  batch = step_lib.shard_batch(on_policy_batch, mesh1)  # as in single_run: no recompile
  anchor = batch.behaviour_logprobs * 1.0  # recomputed under the same weights: identical
  decoupled_update = single_run[4]  # LearnerConfig(): decoupled, 'recompute'; already compiled
  ppo_config = LearnerConfig(use_rollout_log_probs=True)
  ppo_tx = ppo_config.optimizer()
  ppo_state = step_lib.init_train_state(model[1], ppo_tx, mesh1, model[2])
  ppo_update = step_lib.make_update_fn(graphdef, ppo_config, GROUP_SIZE,
                                       step_lib.state_shardings(ppo_state))
  results = {"decoupled": _one_update(model, mesh1, decoupled_update, decoupled_update.tx, batch,
                                      anchor),
             "ppo": _one_update(model, mesh1, ppo_update, ppo_tx, batch, anchor)}
  assert decoupled_update._cache_size() == 1
  reference, ref_metrics = results["decoupled"]
  assert "is_weight_max" in ref_metrics and "is_weight_max" not in results["ppo"][1]
  for name, (params, metrics) in results.items():
    differences = jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), params,
                                               reference))
    assert max(differences) <= 1e-6, name
    ratio_sum, count = metrics["ratio_mean"]
    assert float(ratio_sum) / float(count) == pytest.approx(1.0, abs=1e-5), name
    assert float(metrics["clipfrac"][0]) == 0.0, name
    assert float(metrics["loss"]) == pytest.approx(float(ref_metrics["loss"]), abs=1e-6)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.max(np.abs(a - b)), reference, model[1]))
  assert max(moved) > 1e-4


def test_kl_coef_is_applied_or_rejected(model, on_policy_batch):
  graphdef, params, axes = model
  try:
    config = LearnerConfig(kl_coef=0.5)
    mesh = sharding.make_mesh(MeshShape(), jax.devices()[:1])
    state = step_lib.init_train_state(params, config.optimizer(), mesh, axes)
    update = step_lib.make_update_fn(graphdef, config, GROUP_SIZE,
                                     step_lib.state_shardings(state))
    batch = on_policy_batch
    _, metrics = jax.eval_shape(update, state, batch, batch.behaviour_logprobs, np.float32(0),
                                np.float32(0), batch.behaviour_logprobs)  # traces only
  except ValueError as error:
    assert "kl_coef" in str(error)
    return
  assert "ref_kl" in metrics


def test_init_train_state_leaves_the_callers_params_alive(model, sharded_run, mesh8, batches):
  _, host_params, axes = model
  _, _, _, update, _ = sharded_run
  params = jax.tree.map(jnp.asarray, host_params)  # device arrays, as a caller would hold them
  state = step_lib.init_train_state(params, update.tx, mesh8, axes)
  batch = step_lib.shard_batch(batches[0], mesh8)
  state, _ = update(state, batch, batch.behaviour_logprobs, np.float32(0), np.float32(0))
  deleted = [jax.tree_util.keystr(path) for path, leaf in
             jax.tree_util.tree_flatten_with_path(params)[0] if leaf.is_deleted()]
  assert not deleted, deleted


# ---- logprobs -----------------------------------------------------------------------------------
def _np_log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sequence_logprobs_match_numpy(model, logprob_fn, temperature):
  graphdef, params, _ = model
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, (8, SEQ_LEN)), jnp.int32)
  logp, logits = jax.jit(functools.partial(step_lib.sequence_logprobs, graphdef),
                         static_argnums=2)(params, tokens, temperature)
  assert logits.shape == (8, SEQ_LEN - 1, CONFIG.vocab_size)
  reference = np.take_along_axis(_np_log_softmax(np.asarray(logits) / temperature),
                                 np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  assert logp.shape == tokens.shape
  np.testing.assert_array_equal(np.asarray(logp[:, 0]), 0.0)
  np.testing.assert_allclose(np.asarray(logp[:, 1:]), reference, atol=2e-5)
  if temperature == 1.0:  # the jitted 'recompute' function computes the same
    np.testing.assert_allclose(np.asarray(logprob_fn(params, tokens)), np.asarray(logp),
                               atol=1e-6)


# ---- batches on the mesh ------------------------------------------------------------------------
def test_shard_batch_puts_rows_over_the_batch_axes(batches, mesh8):
  sharded = step_lib.shard_batch(batches[0], mesh8)
  for name in ("tokens", "response_mask", "behaviour_logprobs", "token_versions"):
    array = getattr(sharded, name)
    assert array.sharding.spec == P(("data", "fsdp"), None), name
    assert {s.data.shape for s in array.addressable_shards} == {(2, SEQ_LEN)}
    np.testing.assert_array_equal(np.asarray(array), getattr(batches[0], name))
  assert sharded.rewards.sharding.spec == P(("data", "fsdp"))


# ---- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"learning_rate": 0.0}, r"learning_rate must be > 0, got 0.0"),
    ({"weight_decay": -1.0}, r"weight_decay must be >= 0, got -1.0"),
    ({"grad_clip": 0.0}, r"grad_clip must be > 0, got 0.0"),
    ({"temperature": 0.0}, r"temperature must be > 0 for training, got 0.0"),
    ({"proximal_logprob": "fresh"}, r"proximal_logprob must be one of .*'fresh'"),
    ({"agg_mode": "sum"}, r"agg_mode must be one of .*'sum'"),
    ({"kl_coef": -0.1}, r"kl_coef and entropy_coef must be >= 0"),
    ({"entropy_coef": -0.1}, r"kl_coef and entropy_coef must be >= 0"),
])
def test_learner_config_errors_name_the_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    LearnerConfig(**kwargs)


@pytest.mark.parametrize("kwargs, source, recompute", [
    ({}, "recompute", True),
    ({"use_rollout_log_probs": True}, "rollout", False),
    ({"proximal_logprob": "loglinear"}, "loglinear", False),
    ({"proximal_logprob": "rollout"}, "rollout", False),
])
def test_old_logprob_source(kwargs, source, recompute):
  config = LearnerConfig(**kwargs)
  assert config.old_logprob_source == source
  assert config.needs_recompute == recompute
