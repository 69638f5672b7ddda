"""Tests for benchmarks/roofline.py: the FLOP and byte counts of the decoder, by hand and
against the matmuls of the decoder's own traced program."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import roofline
from jaxrl_async.model import KVCache, apply, get_config, init_model, split_model

TINY = get_config("tiny")  # vocab 16, d 64, 2 layers, 4 heads of 16, 2 kv heads, d_ff 192


def test_hand_count_of_the_tiny_model():
  # q, o: 64 x 4 x 16 each; k, v: 64 x 2 x 16 each; gate, up, down: 64 x 192 each.
  assert roofline.layer_matmul_params(TINY) == 2 * 4096 + 2 * 2048 + 3 * 12288
  assert roofline.head_params(TINY) == 64 * 16
  # 10 tokens, 8 keys each: per layer 2 x 49152 + 4 x 8 x 4 x 16; the head 2 x 1024.
  assert roofline.forward_flops(TINY, 10, 8) == 10 * (2 * (2 * 49152 + 2048) + 2048)
  assert roofline.forward_flops(TINY, 10, 8, with_head=False) == 10 * 2 * (2 * 49152 + 2048)
  # keys and values of 2 layers, [3, 8, 2 kv heads, 16] float32 each.
  assert roofline.kv_cache_bytes(TINY, 3, 8) == 2 * 2 * 3 * 8 * 2 * 16 * 4
  assert roofline.param_bytes(get_config("tiny", param_dtype="bfloat16")) == 2 * TINY.num_params()
  # untied: embedding and head are 16 x 64 each
  assert roofline.block_param_bytes(TINY) == 4 * (TINY.num_params() - 2 * 16 * 64)
  prefill = roofline.prefill_work(TINY, 8)
  assert prefill.flops == roofline.forward_flops(TINY, 8, 8, with_head=False)
  assert prefill.bytes == roofline.block_param_bytes(TINY) + roofline.kv_cache_bytes(TINY, 1, 8)


def _dot_flops(jaxpr) -> int:
  """2 x (output elements) x (contracted size) summed over every dot_general, sub-jaxprs too."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      contracted = math.prod(lhs[i] for i in lhs_contract)
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * contracted
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          total += _dot_flops(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          total += _dot_flops(sub)
  return total


@pytest.fixture(scope="module")
def tiny_model():
  return split_model(init_model(TINY))


def test_forward_flops_equal_the_decoders_matmuls_without_cache(tiny_model):
  graphdef, params = tiny_model
  tokens = jnp.zeros((3, 8), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda p, t: apply(graphdef, p, t)[0])(params, tokens)
  assert _dot_flops(jaxpr.jaxpr) == roofline.forward_flops(TINY, 3 * 8, 8)


def test_decode_flops_equal_the_decoders_matmuls_with_a_cache(tiny_model):
  graphdef, params = tiny_model
  slots, cache_length = 5, 12
  cache = KVCache.zeros(TINY, slots, cache_length)
  tokens = jnp.zeros((slots, 1), jnp.int32)
  positions = jnp.zeros((slots, 1), jnp.int32)
  jaxpr = jax.make_jaxpr(lambda p, t, q, c: apply(graphdef, p, t, q, c)[0])(
      params, tokens, positions, cache)
  work = roofline.decode_step_work(TINY, slots, cache_length)
  # One query a row: the attention over the cache runs as products and sums, not dot_generals
  # (`decoder.summed_products`); its multiply-adds are still the work's.
  attention = TINY.n_layers * slots * 4 * cache_length * TINY.n_heads * TINY.resolved_head_dim
  assert _dot_flops(jaxpr.jaxpr) == work.flops - attention
  assert sum(d.flops * n for d, n in roofline.program_dots(jaxpr.jaxpr).items()) == (
      work.flops - attention)
  assert work.bytes == roofline.param_bytes(TINY) + roofline.kv_cache_bytes(TINY, slots,
                                                                            cache_length)


def test_update_counts_backward_remat_and_head_recompute():
  rows, length = 4, 8  # the model runs over 7 positions per row: the last token is a target
  forward = roofline.forward_flops(TINY, rows * 7, 7)
  head = 2 * roofline.head_params(TINY) * rows * 7
  assert roofline.model_flops_per_update(TINY, rows, length) == 3 * forward
  assert roofline.update_work(TINY, rows, length, head_recompute=False).flops == 3 * forward
  assert roofline.update_work(TINY, rows, length).flops == 3 * forward + head
  remat = get_config("tiny", remat=True)
  assert roofline.update_work(remat, rows, length).flops == 4 * forward


def test_bound_is_the_slower_of_compute_and_memory():
  work = roofline.Work(flops=2e9, bytes=1e9, dtype="float32")
  assert work.bound_s({"float32": 100.0}, 10.0) == pytest.approx(0.1)  # memory: 1 GB / 10 GB/s
  assert work.bound_s({"float32": 10.0}, 10.0) == pytest.approx(0.2)  # compute: 2 / 10 GFLOP/s
  account = roofline.fraction(work, 0.4, {"float32": 10.0}, 10.0)
  assert account["fraction_of_bound"] == pytest.approx(0.5)
  assert account["achieved_gflops"] == pytest.approx(5.0)


def test_measurements_are_positive_and_finite():
  peak = roofline.measure_matmul_peak("float32", size=128, repeats=1)
  bandwidth = roofline.measure_bandwidth(megabytes=4, repeats=1)
  assert np.isfinite(peak) and peak > 0
  assert np.isfinite(bandwidth) and bandwidth > 0


@pytest.mark.parametrize("logit_chunk_size", [0, 16])
def test_update_flops_equal_the_matmuls_of_the_learners_traced_gradient(logit_chunk_size):
  """The learner's loss and gradient (`step._loss_fn`, chunked head recomputed or not) on a
  batch of 4 rows of 8 tokens: every dot_general of the traced program, recompute included."""
  from jaxrl_async.learner import step as step_lib
  from jaxrl_async.learner.batching import TrainBatch

  graphdef, params = split_model(init_model(TINY))
  rows, length = 4, 8
  zeros = jnp.zeros((rows, length), jnp.float32)
  batch = TrainBatch(tokens=jnp.zeros((rows, length), jnp.int32), response_mask=zeros + 1,
                     behaviour_logprobs=zeros, token_versions=jnp.zeros((rows, length), jnp.int32),
                     rewards=jnp.zeros((rows,), jnp.float32),
                     sample_index=jnp.broadcast_to(jnp.arange(rows)[:, None], (rows, length)),
                     positions=None, segment_ids=None, group_index=jnp.zeros((rows,), jnp.int32))
  config = step_lib.LearnerConfig(logit_chunk_size=logit_chunk_size)

  def loss(params):
    logp, entropy, *_ = step_lib._loss_fn(params, graphdef, config, batch, None, 0.0, 0.0)
    return jnp.sum(logp) + jnp.sum(entropy)

  jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params)
  work = roofline.update_work(TINY, rows, length, head_recompute=logit_chunk_size > 0)
  assert _dot_flops(jaxpr.jaxpr) == work.flops
