"""Chunked logprobs and entropy (`losses.chunked_logprobs_and_entropy`, `LearnerConfig.
logit_chunk_size`): equal to the unchunked ones, values and gradients, tied and untied heads."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.learner import losses
from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import collate
from jaxrl_async.learner.step import LearnerConfig
from jaxrl_async.model import get_config, init_model, split_model
from jaxrl_async.model.decoder import project_logits, unembedding
from jaxrl_async.types import Sample

SEQ_LEN = 13  # T - 1 = 12 predicted positions: chunk sizes 5 and 7 do not divide it
GROUP_SIZE = 2


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
  config = dataclasses.replace(get_config("tiny"), tie_embeddings=request.param)
  graphdef, params = split_model(init_model(config, seed=3))
  assert ("lm_head" in params) != request.param
  params = jax.device_get(params)
  if request.param:  # N(0, 1) embeddings as the head: near one-hot softmax; spread it out
    params["embed"] = params["embed"] * 0.05
  return graphdef, params


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  groups = []
  for g in range(2):
    prompt = np.concatenate([[1], rng.integers(5, 15, 3)])
    group = []
    for k in range(GROUP_SIZE):
      n = int(rng.integers(3, SEQ_LEN - len(prompt) + 1))
      group.append(Sample(prompt_id=g, group_id=g, group_size=GROUP_SIZE, prompt_tokens=prompt,
                          response_tokens=rng.integers(2, 15, n),
                          behaviour_logprobs=-rng.uniform(1.5, 3.5, n),
                          token_versions=np.zeros(n), reward=float(k), meta={"index_in_group": k}))
    groups.append(group)
  return collate(groups, SEQ_LEN)


@pytest.mark.parametrize("chunk_size", [1, 5, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_entropy_equal_the_unchunked(model, chunk_size, temperature):
  graphdef, params = model
  tokens = jnp.asarray(_batch().tokens)
  fn = jax.jit(step_lib.sequence_logprobs_and_entropy, static_argnums=(0, 3, 6))
  full_logp, full_entropy = fn(graphdef, params, tokens, temperature, None, None, 0)
  logp, entropy = fn(graphdef, params, tokens, temperature, None, None, chunk_size)
  assert logp.shape == full_logp.shape == tokens.shape
  assert entropy.shape == full_entropy.shape == (tokens.shape[0], tokens.shape[1] - 1)
  np.testing.assert_allclose(logp, full_logp, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(entropy, full_entropy, rtol=1e-5, atol=1e-5)
  assert float(jnp.min(entropy)) > 0.1  # non-degenerate distributions were compared
  # and the unchunked path is the engine's arithmetic (logits -> token_logprobs)
  ref_logp, _ = step_lib.sequence_logprobs(graphdef, params, tokens, temperature)
  np.testing.assert_allclose(full_logp, ref_logp, rtol=1e-6, atol=1e-6)


def test_chunked_function_gradients_equal_the_unchunked():
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(3, 11, 8)), jnp.float32)
  head = jnp.asarray(rng.normal(size=(8, 19)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 19, (3, 11)))
  weights = jnp.asarray(rng.normal(size=(2, 3, 11)), jnp.float32)

  def objective(chunk_size, hidden, head):
    if chunk_size == 0:
      logits = project_logits(hidden, head)
      logp = losses.token_logprobs(logits, targets, 0.9)
      entropy = losses.entropy_from_logits(logits, None, 0.9)
    else:
      logp, entropy = losses.chunked_logprobs_and_entropy(hidden, head, targets, project_logits,
                                                          0.9, chunk_size)
    return jnp.sum(weights[0] * logp) + jnp.sum(weights[1] * entropy)

  full = jax.grad(objective, argnums=(1, 2))(0, hidden, head)
  for chunk_size in (1, 4, 11, 30):
    chunked = jax.grad(objective, argnums=(1, 2))(chunk_size, hidden, head)
    for a, b in zip(chunked, full, strict=True):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert float(jnp.max(jnp.abs(full[1]))) > 0


@pytest.mark.parametrize("proximal", ["recompute", "loglinear"])
def test_update_with_chunked_logits_equals_the_unchunked(model, proximal):
  """Loss, metrics and gradients (through the updated parameters) of one update agree."""
  graphdef, params = model
  batch = _batch(1)
  results = []
  for chunk_size in (0, 5):
    config = LearnerConfig(logit_chunk_size=chunk_size, entropy_coef=0.01,
                           proximal_logprob=proximal, learning_rate=1e-2)

    def loss(params, config=config):
      logp, entropy, anchor, behaviour, mask = step_lib._loss_fn(
          params, graphdef, config, batch, None, np.float32(0), np.float32(1))
      adv = jnp.asarray(batch.rewards)[jnp.asarray(batch.sample_index)[:, 1:]] * mask
      return losses.policy_loss(logp, jax.lax.stop_gradient(anchor), adv, mask,
                                behaviour_logp=behaviour, entropy=entropy, entropy_coef=0.01)

    (total, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    results.append((total, metrics, grads))
  (total0, metrics0, grads0), (total1, metrics1, grads1) = results
  np.testing.assert_allclose(total1, total0, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics1["entropy"][0], metrics0["entropy"][0], rtol=1e-5)
  flat0, flat1 = jax.tree.leaves(grads0), jax.tree.leaves(grads1)
  assert any(float(jnp.max(jnp.abs(g))) > 0 for g in flat0)
  for a, b in zip(flat1, flat0, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_make_logprob_fn_chunked_equals_unchunked(model):
  graphdef, params = model
  tokens = jnp.asarray(_batch(2).tokens)
  full = step_lib.make_logprob_fn(graphdef, 1.0)(params, tokens)
  chunked = step_lib.make_logprob_fn(graphdef, 1.0, chunk_size=5)(params, tokens)
  np.testing.assert_allclose(chunked, full, rtol=1e-5, atol=1e-5)


def test_unembedding_is_the_decoders_head(model):
  graphdef, params = model
  tokens = jnp.asarray(_batch().tokens)
  logits, _ = step_lib.apply(graphdef, params, tokens)
  hidden, _ = step_lib.apply(graphdef, params, tokens, return_hidden=True)
  np.testing.assert_array_equal(project_logits(hidden, unembedding(params)), logits)


@pytest.mark.parametrize("value", [-1, 2.5, True, "64"])
def test_bad_chunk_sizes_are_rejected(value):
  with pytest.raises(ValueError, match="logit_chunk_size must be an int >= 0"):
    LearnerConfig(logit_chunk_size=value)
  with pytest.raises(ValueError, match="chunk_size must be an int >= 0"):
    step_lib.make_logprob_fn(None, 1.0, chunk_size=value)
  with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
    losses.chunked_logprobs_and_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((3, 4)),
                                        jnp.zeros((1, 2), jnp.int32), project_logits, 1.0, value)
