"""Tests for jaxrl_async.model.decoder: cache == full forward, RoPE, GQA shapes, masking."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.model import (
  KVCache,
  abstract_params,
  apply,
  get_config,
  init_model,
  param_logical_axes,
  split_model,
)
from jaxrl_async.model.decoder import embed_tokens, rope_tables, rotary_embedding, write_cache

CONFIG = get_config("tiny")


@pytest.fixture(scope="module")
def tiny():
  model = init_model(CONFIG, seed=0)
  graphdef, params = split_model(model)
  return graphdef, params, param_logical_axes(model)


@functools.cache
def _jit_apply(graphdef):
  return jax.jit(functools.partial(apply, graphdef))


def _tokens(batch, length, seed=0, vocab=CONFIG.vocab_size):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (batch, length)), jnp.int32)


# ---- shapes -------------------------------------------------------------------------------------
def test_gqa_parameter_and_cache_shapes(tiny):
  _, params, _ = tiny
  d, h, kv, hd = CONFIG.d_model, CONFIG.n_heads, CONFIG.n_kv_heads, CONFIG.resolved_head_dim
  assert kv < h  # the tiny model really groups queries
  attn = params["blocks"][0]["attn"]
  assert attn["q"].shape == (d, h, hd)
  assert attn["k"].shape == attn["v"].shape == (d, kv, hd)
  assert attn["o"].shape == (h, hd, d)
  assert params["embed"].shape == (CONFIG.vocab_size, d)
  assert params["lm_head"].shape == (d, CONFIG.vocab_size)
  assert len(params["blocks"]) == CONFIG.n_layers
  cache = KVCache.zeros(CONFIG, batch=3, length=10)
  assert cache.length == 10
  assert len(cache.keys) == len(cache.values) == CONFIG.n_layers
  assert all(k.shape == (3, 10, kv, hd) for k in cache.keys + cache.values)
  assert KVCache.zeros(CONFIG, batch=1).length == CONFIG.max_seq_len


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads(tiny):
  """Query head h reads kv head h // (n_heads / n_kv_heads): repeating each kv head that many
  times gives a multi-head model with the same logits."""
  graphdef, params, _ = tiny
  groups = CONFIG.n_heads // CONFIG.n_kv_heads
  mha_graphdef, _, _ = abstract_params(get_config("tiny", n_kv_heads=CONFIG.n_heads))
  mha_params = jax.tree.map(lambda x: x, params)
  for block in mha_params["blocks"].values():
    for name in ("k", "v"):
      block["attn"][name] = jnp.repeat(block["attn"][name], groups, axis=1)
  tokens = _tokens(2, 8, seed=12)
  gqa, _ = _jit_apply(graphdef)(params, tokens)
  mha, _ = jax.jit(functools.partial(apply, mha_graphdef))(mha_params, tokens)
  np.testing.assert_allclose(np.asarray(mha), np.asarray(gqa), atol=1e-5)


def test_forward_shapes_and_dtype(tiny):
  graphdef, params, _ = tiny
  logits, cache = _jit_apply(graphdef)(params, _tokens(2, 8))
  assert logits.shape == (2, 8, CONFIG.vocab_size) and logits.dtype == jnp.float32
  assert cache is None
  assert np.all(np.isfinite(np.asarray(logits)))


def test_tokens_must_be_rank_2(tiny):
  graphdef, params, _ = tiny
  with pytest.raises(ValueError, match=r"tokens must be \[B, T\]"):
    apply(graphdef, params, jnp.zeros((5,), jnp.int32))


def test_logical_axes_match_params(tiny):
  _, params, axes = tiny
  flat_params = jax.tree_util.tree_flatten_with_path(params)[0]
  flat_axes = dict(jax.tree_util.tree_flatten_with_path(
      axes, is_leaf=lambda x: isinstance(x, tuple))[0])
  assert len(flat_params) == len(flat_axes)
  for path, leaf in flat_params:
    assert len(flat_axes[path]) == leaf.ndim, (path, flat_axes[path], leaf.shape)
  assert flat_axes[(jax.tree_util.DictKey("embed"),)] == ("vocab", "embed")


def test_abstract_params_match_real_params(tiny):
  _, params, axes = tiny
  _, abstract, abstract_axes = abstract_params(CONFIG)
  assert jax.tree.structure(abstract) == jax.tree.structure(params)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, p: a.shape == p.shape and a.dtype == p.dtype,
                                          abstract, params)))
  assert abstract_axes == axes


def test_seed_changes_params_and_is_deterministic():
  _, a = split_model(init_model(CONFIG, seed=3))
  _, b = split_model(init_model(CONFIG, seed=3))
  _, c = split_model(init_model(CONFIG, seed=4))
  np.testing.assert_array_equal(a["embed"], b["embed"])
  assert not np.allclose(a["embed"], c["embed"])


# ---- the cache ------------------------------------------------------------------------------------
# Shapes are kept to a few ([2, 8] tokens, caches of 8) so that the jitted forward compiles rarely.
def test_incremental_decoding_equals_full_forward(tiny):
  graphdef, params, _ = tiny
  fwd = _jit_apply(graphdef)
  tokens = _tokens(2, 8, seed=3)
  full, _ = fwd(params, tokens)
  prompt_len = 4
  cache = KVCache.zeros(CONFIG, batch=2, length=8)
  positions = jnp.broadcast_to(jnp.arange(prompt_len), (2, prompt_len))
  logits, cache = fwd(params, tokens[:, :prompt_len], positions, cache)
  steps = [logits]
  for t in range(prompt_len, tokens.shape[1]):
    logits, cache = fwd(params, tokens[:, t:t + 1], jnp.full((2, 1), t, jnp.int32), cache)
    steps.append(logits)
  incremental = jnp.concatenate(steps, axis=1)
  assert incremental.shape == full.shape
  np.testing.assert_allclose(np.asarray(incremental), np.asarray(full), atol=1e-4, rtol=0)


def test_decoding_rows_at_different_positions_matches_each_row_alone(tiny):
  graphdef, params, _ = tiny
  fwd = _jit_apply(graphdef)
  tokens = _tokens(2, 8, seed=4)
  full, _ = fwd(params, tokens)  # causal: row b's logits at n depend on tokens[b, :n + 1] only
  lengths = [2, 6]  # row b has lengths[b] tokens in the cache, then one step at its own position
  # Prefill all 8 tokens: row 0 is left with stale entries past position 2, which must be unseen.
  _, cache = fwd(params, (tokens + 3) % CONFIG.vocab_size, None, KVCache.zeros(CONFIG, 2, 8))
  _, cache = fwd(params, tokens[:, :4], None, cache)  # the real tokens, then two more steps
  step_tokens = jnp.stack([tokens[0, 2], tokens[1, 6]])[:, None]
  _, cache = fwd(params, tokens[:, 4:5], jnp.asarray([[4], [4]], jnp.int32), cache)
  _, cache = fwd(params, tokens[:, 5:6], jnp.asarray([[5], [5]], jnp.int32), cache)
  step_positions = jnp.asarray(lengths, jnp.int32)[:, None]
  logits, _ = fwd(params, step_tokens, step_positions, cache)
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(logits[b, 0]), np.asarray(full[b, n]), atol=1e-4)


def test_writes_past_the_cache_end_are_dropped(tiny):
  graphdef, params, _ = tiny
  fwd = _jit_apply(graphdef)
  tokens = _tokens(2, 8, seed=5)
  logits, new_cache = fwd(params, tokens, None, KVCache.zeros(CONFIG, batch=2, length=4))
  full, _ = fwd(params, tokens)
  np.testing.assert_allclose(np.asarray(logits[:, :4]), np.asarray(full[:, :4]), atol=1e-4)
  assert new_cache.length == 4


def test_cache_holds_the_keys_of_written_positions_only(tiny):
  graphdef, params, _ = tiny
  tokens = _tokens(2, 4, seed=6)
  _, cache = _jit_apply(graphdef)(params, tokens, None, KVCache.zeros(CONFIG, 2, 8))
  for keys in (np.asarray(cache.keys[0]), np.asarray(cache.values[1])):
    assert np.all(np.abs(keys[:, :4]).sum(axis=(-1, -2)) > 0)
    np.testing.assert_array_equal(keys[:, 4:], 0.0)


# ---- masking ------------------------------------------------------------------------------------
def test_causal_future_tokens_do_not_change_past_logits(tiny):
  graphdef, params, _ = tiny
  fwd = _jit_apply(graphdef)
  tokens = _tokens(2, 8, seed=7)
  changed = tokens.at[:, 6:].set((tokens[:, 6:] + 1) % CONFIG.vocab_size)
  a, _ = fwd(params, tokens)
  b, _ = fwd(params, changed)
  np.testing.assert_allclose(np.asarray(a[:, :6]), np.asarray(b[:, :6]), atol=1e-5)
  assert not np.allclose(np.asarray(a[:, 6:]), np.asarray(b[:, 6:]), atol=1e-3)


# ---- RoPE ---------------------------------------------------------------------------------------
def test_rope_dot_product_depends_only_on_relative_position():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32)

  def dot(m, n):
    rq = rotary_embedding(q, jnp.full((1, 1), m), 10_000.0)
    rk = rotary_embedding(k, jnp.full((1, 1), n), 10_000.0)
    return float(jnp.sum(rq * rk))

  for m, n in [(3, 1), (10, 2), (5, 5), (0, 7)]:
    for shift in (1, 13, 40):
      assert dot(m + shift, n + shift) == pytest.approx(dot(m, n), abs=1e-4)
  assert abs(dot(3, 1) - dot(1, 3)) > 1e-3  # it does depend on the offset (and its sign)


def test_rope_is_a_rotation_and_identity_at_position_zero():
  x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 5, 3, 8)), jnp.float32)
  positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
  rotated = rotary_embedding(x, positions, 10_000.0)
  np.testing.assert_allclose(np.linalg.norm(rotated, axis=-1), np.linalg.norm(x, axis=-1),
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(rotated[:, 0]), np.asarray(x[:, 0]), atol=1e-7)
  assert not np.allclose(np.asarray(rotated[:, 1]), np.asarray(x[:, 1]))


def test_rope_matches_a_numpy_reference():
  x = np.random.default_rng(2).normal(size=(1, 3, 1, 4)).astype(np.float32)
  positions = np.array([[0, 1, 5]])
  theta = 100.0
  out = np.asarray(rotary_embedding(jnp.asarray(x), jnp.asarray(positions), theta))
  for t, p in enumerate(positions[0]):
    for i in range(2):  # half-split layout: pairs (i, i + D/2)
      angle = p * theta ** (-i / 2)
      a, b = x[0, t, 0, i], x[0, t, 0, i + 2]
      assert out[0, t, 0, i] == pytest.approx(a * np.cos(angle) - b * np.sin(angle), abs=1e-5)
      assert out[0, t, 0, i + 2] == pytest.approx(b * np.cos(angle) + a * np.sin(angle), abs=1e-5)


def test_rope_tables_are_sin_and_cos_of_the_angles_under_jit():
  angles = jnp.asarray(np.random.default_rng(3).uniform(-50, 5000, size=(3, 7, 8)), jnp.float32)
  sin, cos = jax.jit(rope_tables)(angles)
  np.testing.assert_array_equal(np.asarray(sin), np.asarray(jax.jit(jnp.sin)(angles)))
  np.testing.assert_array_equal(np.asarray(cos), np.asarray(jax.jit(jnp.cos)(angles)))


def _fused_sin_cos_rope(x, positions, theta):
  """RoPE with sin and cos left to XLA's fusion (the formula without `rope_tables`)."""
  half = x.shape[-1] // 2
  angles = positions[..., None].astype(jnp.float32) * theta ** (
      -jnp.arange(half, dtype=jnp.float32) / half)
  sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def test_rope_and_its_gradient_equal_the_plain_formula_under_jit():
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.normal(size=(2, 9, 3, 16)), jnp.float32)
  positions = jnp.asarray(rng.integers(0, 100_000, size=(2, 9)), jnp.int32)
  cotangent = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
  for rope in (rotary_embedding, _fused_sin_cos_rope):
    out, vjp = jax.jit(lambda x, rope=rope: jax.vjp(lambda y: rope(y, positions, 1e6), x))(x)
    grad = jax.jit(vjp)(cotangent)[0]
    if rope is rotary_embedding:
      expected_out, expected_grad = out, grad
  np.testing.assert_array_equal(np.asarray(expected_out), np.asarray(out))
  np.testing.assert_array_equal(np.asarray(expected_grad), np.asarray(grad))


def test_sin_and_cos_are_computed_once_per_update(tiny):
  """XLA:CPU would recompute them inside every RoPE fusion (each head, forward and backward)."""
  graphdef, params, _ = tiny
  tokens = _tokens(4, 8, seed=5)
  positions = jnp.broadcast_to(jnp.arange(8), (4, 8))

  def loss(params):
    return jnp.sum(apply(graphdef, params, tokens, positions)[0] ** 2)

  hlo = jax.jit(jax.grad(loss)).lower(params).compile().as_text()
  assert hlo.count(" sine(") == 1 and hlo.count(" cosine(") == 1


def test_model_logits_are_invariant_to_shifting_all_positions(tiny):
  graphdef, params, _ = tiny
  fwd = _jit_apply(graphdef)
  tokens = _tokens(2, 8, seed=8)
  base = jnp.broadcast_to(jnp.arange(8), (2, 8))
  a, _ = fwd(params, tokens, base)
  b, _ = fwd(params, tokens, base + 9)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


# ---- variants, jit and vmap ---------------------------------------------------------------------
@pytest.mark.parametrize("overrides", [
    {"tie_embeddings": True, "qkv_bias": True, "n_kv_heads": 1},  # Qwen2-like, multi-query
    {"n_kv_heads": 4, "head_dim": 8},  # plain multi-head, head_dim != d_model / n_heads
])
def test_variants_cache_equals_full_forward(overrides):
  config = get_config("tiny", n_layers=1, **overrides)
  graphdef, params = split_model(init_model(config, seed=2))
  attn = params["blocks"][0]["attn"]
  assert attn["k"].shape == (config.d_model, config.n_kv_heads, config.resolved_head_dim)
  assert ("lm_head" in params) != config.tie_embeddings
  if config.qkv_bias:  # biases start at 0; make them matter
    rng = np.random.default_rng(0)
    for name in ("q_bias", "k_bias", "v_bias"):
      attn[name] = jnp.asarray(rng.normal(size=attn[name].shape), jnp.float32)
  fwd = jax.jit(functools.partial(apply, graphdef))
  tokens = _tokens(2, 8, seed=9)
  full, _ = fwd(params, tokens)
  _, cache = fwd(params, tokens[:, :7], None, KVCache.zeros(config, 2, 8))
  last, _ = fwd(params, tokens[:, 7:], jnp.full((2, 1), 7), cache)
  np.testing.assert_allclose(np.asarray(last[:, 0]), np.asarray(full[:, 7]), atol=1e-4)


def test_bfloat16_activations_track_float32(tiny):
  graphdef32, params, _ = tiny
  config16 = get_config("tiny", dtype="bfloat16")
  graphdef16, _, _ = abstract_params(config16)
  tokens = _tokens(2, 8, seed=10)
  logits16, _ = jax.jit(functools.partial(apply, graphdef16))(params, tokens)
  logits32, _ = _jit_apply(graphdef32)(params, tokens)
  assert logits16.dtype == jnp.float32
  difference = np.max(np.abs(np.asarray(logits16) - np.asarray(logits32)))
  assert 0 < difference < 0.25
  assert KVCache.zeros(config16, 1, 4).keys[0].dtype == jnp.bfloat16


def test_vmap_over_rows_agrees_with_the_batched_forward(tiny):
  graphdef, params, _ = tiny
  tokens = _tokens(2, 8, seed=11)
  batched, _ = _jit_apply(graphdef)(params, tokens)
  mapped = jax.jit(jax.vmap(lambda row: apply(graphdef, params, row[None])[0][0]))(tokens)
  np.testing.assert_allclose(np.asarray(mapped), np.asarray(batched), atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_gathers_and_cache_writes_move_the_same_values_as_plain_indexing(dtype):
  """16-bit rows go through their uint16 bits: the same values as jnp.take and .at[].set, NaN
  rows for out-of-range ids, writes past the cache end dropped."""
  rng = np.random.default_rng(0)
  embed = jnp.asarray(rng.normal(size=(11, 6)), dtype)
  tokens = jnp.asarray([[0, 3, 10], [11, 40, -1]])  # 11 and 40 are past the end; -1 the last
  got = np.asarray(embed_tokens(embed, tokens).astype(jnp.float32))
  want = np.asarray(jnp.take(embed, tokens, axis=0).astype(jnp.float32))
  np.testing.assert_array_equal(got, want)
  assert np.isnan(got[1, 0]).all() and np.isnan(got[1, 1]).all()
  cache = jnp.asarray(rng.normal(size=(2, 5, 3)), dtype)
  new = jnp.asarray(rng.normal(size=(2, 2, 3)), jnp.float32)  # cast to the cache's dtype
  rows, positions = jnp.asarray([[0], [1]]), jnp.asarray([[1, 2], [4, 5]])  # 5: past the end
  got = write_cache(cache, rows, positions, new)
  want = cache.at[rows, positions].set(new.astype(dtype), mode="drop")
  assert got.dtype == cache.dtype
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(want.astype(jnp.float32)))
