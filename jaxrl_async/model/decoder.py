"""A flax.nnx decoder of the Llama 3 / Qwen2 / Qwen3 family with an explicit, static KV cache.

Every parameter names its logical axes (`out_sharding` metadata); `jaxrl_async.sharding` maps them
to a mesh. The cache is an explicit pytree passed in and returned, so the forward pass is a pure
function of (params, tokens, positions, cache) and one jitted decode step serves any weights.

Attention masks come from positions: the query at position p sees cache slots s <= p. A
sequence is always laid out from position 0, so right padding and stale cache entries beyond the
current position are never seen. Without a cache, rows may hold several sequences (packing):
`segment_ids` then restricts attention to keys of the query's own segment, and positions restart
at 0 in each segment.

Layouts follow Hugging Face's so that `model.weights` maps checkpoints one to one: RoPE rotates
the two halves of each head (not interleaved pairs), Qwen3's q/k norms act on each head before
RoPE, and the tied head is the embedding's transpose.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxrl_async.model.config import (
  LinearRopeScaling,
  ModelConfig,
  RopeScaling,
  YarnRopeScaling,
)
from jaxrl_async.model.softmax import softmax


def dense(spec: str, x: jax.Array, weight: jax.Array) -> jax.Array:
  """einsum(spec, x, weight) in x's dtype, accumulated in float32.

  Asking for a float32 result keeps low-precision operands as they are: XLA:CPU runs a bf16 x bf16
  -> f32 dot natively, while a bf16 result makes it upcast the whole weight matrix on every call.
  Rounding the float32 sum to x's dtype is what a bf16 dot does on every backend.
  """
  out = jnp.einsum(spec, x, weight.astype(x.dtype), preferred_element_type=jnp.float32)
  return out.astype(x.dtype)


def summed_products(x: jax.Array, y: jax.Array, axis: int) -> jax.Array:
  """sum(x * y, axis) as `dense` sums (in float32, to x's dtype): decode's one-query attention."""
  return jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32), axis=axis).astype(x.dtype)


def _param(rngs: nnx.Rngs, init, shape, axes, dtype=jnp.float32) -> nnx.Param:
  return nnx.Param(init(rngs.params(), shape, jnp.dtype(dtype)), out_sharding=axes,
                   eager_sharding=False)


@struct.dataclass
class KVCache:
  """Per-layer keys and values: each [B, S, kv_heads, head_dim], S = cache length."""

  keys: tuple[jax.Array, ...]
  values: tuple[jax.Array, ...]

  @classmethod
  def zeros(cls, config: ModelConfig, batch: int, length: int | None = None) -> KVCache:
    length = config.max_seq_len if length is None else length
    shape = (batch, length, config.n_kv_heads, config.resolved_head_dim)
    layers = [jnp.zeros(shape, jnp.dtype(config.dtype)) for _ in range(2 * config.n_layers)]
    return cls(keys=tuple(layers[:config.n_layers]), values=tuple(layers[config.n_layers:]))

  @property
  def length(self) -> int:
    return self.keys[0].shape[1]


LOGICAL_CACHE_AXES = ("batch", "cache_length", "kv_heads", "head_dim")


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, rngs: nnx.Rngs, dtype=jnp.float32):
    del rngs
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), jnp.dtype(dtype)), out_sharding=("norm",),
                           eager_sharding=False)

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (normed * self.scale[...]).astype(x.dtype)


def rope_tables(angles: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sin, cos) of angles [B, T, K], each [B, T, K] float32, computed once and kept in memory.

  XLA:CPU counts sin and cos as cheap and fuses them into every consumer, so each query and key
  head (and the backward pass, twice per element) recomputed them. A gather is never fused into a
  consumer that reuses its elements, so the tables go through an identity gather along T
  (B, the axis a mesh shards, passes through it untouched): the same values, computed once.
  """
  assert angles.ndim == 3, angles.shape
  tables = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-2)  # [B, T, 2, K]
  tables = jnp.take(tables, jnp.arange(angles.shape[1]), axis=1, mode="clip",
                    unique_indices=True, indices_are_sorted=True)
  return tables[:, :, 0], tables[:, :, 1]


def rotary_embedding(x: jax.Array, positions: jax.Array, theta: float,
                     scaling: RopeScaling | LinearRopeScaling | YarnRopeScaling | None = None
                     ) -> jax.Array:
  """RoPE (Su et al. 2021), half-split layout. x: [B, T, H, D], positions: [B, T].

  scaling: a frequency scaling (Llama 3.x `RopeScaling`, `LinearRopeScaling`,
  `YarnRopeScaling`), or None. YaRN's attention_factor multiplies the rotated vectors.
  """
  half = x.shape[-1] // 2
  freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [D/2]
  if scaling is not None:
    freqs = scaling.scale_frequencies(freqs, theta)
  angles = positions[..., None].astype(jnp.float32) * freqs  # [B, T, D/2]
  sin, cos = rope_tables(angles)
  sin, cos = sin[:, :, None, :], cos[:, :, None, :]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  if scaling is not None and scaling.attention_factor != 1.0:
    out = out * scaling.attention_factor
  return out.astype(x.dtype)


def project(x: jax.Array, weight: jax.Array, contract: int = 1) -> jax.Array:
  """x [..., *weight.shape[:contract]] times weight, over those axes -> [..., *weight.shape[contract:]],
  as one 2-D matmul (`dense`'s dtypes).

  Leading axes are flattened first: with them kept as einsum batch axes, the backward pass of
  XLA:CPU transposes the cotangents through slow strided loop fusions (twice the MLP's time).
  """
  in_shape, out_shape = weight.shape[:contract], weight.shape[contract:]
  assert x.shape[x.ndim - contract:] == in_shape, (x.shape, weight.shape)
  lead = x.shape[:x.ndim - contract]
  flat = dense("nd,df->nf", x.reshape(-1, math.prod(in_shape)),
               weight.reshape(math.prod(in_shape), math.prod(out_shape)))
  return flat.reshape(*lead, *out_shape)


def embed_tokens(embed: jax.Array, tokens: jax.Array) -> jax.Array:
  """embed [V, D] rows of tokens [B, T] -> [B, T, D] (NaN rows for ids outside [0, V)).

  16-bit floats are gathered as their uint16 bits (the same values): XLA:CPU otherwise converts
  the whole embedding to float32 first.
  """
  if jnp.issubdtype(embed.dtype, jnp.floating) and embed.dtype.itemsize == 2:
    bits = jax.lax.bitcast_convert_type
    nan_bits = int(np.asarray(np.nan, embed.dtype).view(np.uint16))
    rows = jnp.take(bits(embed, jnp.uint16), tokens, axis=0, mode="fill", fill_value=nan_bits)
    return bits(rows, embed.dtype)
  return jnp.take(embed, tokens, axis=0)


def write_cache(cache: jax.Array, rows: jax.Array, positions: jax.Array,
                new: jax.Array) -> jax.Array:
  """cache [B, S, ...] with new [B, T, ...] written at (rows [B, 1], positions [B, T]); writes
  past the cache end (padding of an over-long bucket) are dropped.

  16-bit floats are written as their uint16 bits (the same values): XLA:CPU has no bf16
  scatter and would convert the whole cache to float32 and back at every write.
  """
  new = new.astype(cache.dtype)
  if jnp.issubdtype(cache.dtype, jnp.floating) and cache.dtype.itemsize == 2:
    bits = jax.lax.bitcast_convert_type
    written = bits(cache, jnp.uint16).at[rows, positions].set(bits(new, jnp.uint16), mode="drop")
    return bits(written, cache.dtype)
  return cache.at[rows, positions].set(new, mode="drop")


class Attention(nnx.Module):
  """Grouped-query attention reading and writing an explicit per-layer cache."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    d, h, kv, hd = config.d_model, config.n_heads, config.n_kv_heads, config.resolved_head_dim
    init = nnx.initializers.normal(stddev=d ** -0.5)
    pd = config.param_dtype
    self.config = config
    self.q = _param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), pd)
    self.k = _param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
    self.v = _param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pd)
    self.o = _param(rngs, nnx.initializers.normal(stddev=(h * hd) ** -0.5), (h, hd, d),
                    ("heads", "head_dim", "embed"), pd)
    if config.qkv_bias:
      zeros = nnx.initializers.zeros
      self.q_bias = _param(rngs, zeros, (h, hd), ("heads", "head_dim"), pd)
      self.k_bias = _param(rngs, zeros, (kv, hd), ("kv_heads", "head_dim"), pd)
      self.v_bias = _param(rngs, zeros, (kv, hd), ("kv_heads", "head_dim"), pd)
    if config.qk_norm:
      self.q_norm = RMSNorm(hd, config.norm_eps, rngs, pd)
      self.k_norm = RMSNorm(hd, config.norm_eps, rngs, pd)

  def __call__(self, x, positions, cache_kv, segment_ids=None):
    """x: [B, T, D]; positions: [B, T]; cache_kv: (k, v) each [B, S, KV, Dh] or None;
    segment_ids: [B, T] or None (no cache only): a query sees keys of its own segment only."""
    cfg = self.config
    dtype = x.dtype
    q = project(x, self.q[...])
    k = project(x, self.k[...])
    v = project(x, self.v[...])
    if cfg.qkv_bias:
      q, k, v = (q + self.q_bias[...].astype(dtype), k + self.k_bias[...].astype(dtype),
                 v + self.v_bias[...].astype(dtype))
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = rotary_embedding(q, positions, cfg.rope_theta, cfg.rope_scaling)
    k = rotary_embedding(k, positions, cfg.rope_theta, cfg.rope_scaling)

    if cache_kv is None:
      keys, values, key_positions = k, v, positions  # [B, T, ...]
      new_cache = None
    else:
      cache_k, cache_v = cache_kv
      rows = jnp.arange(x.shape[0])[:, None]
      keys = write_cache(cache_k, rows, positions, k)
      values = write_cache(cache_v, rows, positions, v)
      key_positions = jnp.broadcast_to(jnp.arange(keys.shape[1]), (x.shape[0], keys.shape[1]))
      new_cache = (keys, values)

    batch, length, heads, head_dim = q.shape
    groups = heads // cfg.n_kv_heads
    q = q.reshape(batch, length, cfg.n_kv_heads, groups, head_dim)
    one_query = length == 1 and cache_kv is not None  # decode: one-row dots, slow on XLA:CPU
    scores = (jnp.moveaxis(summed_products(q, keys[:, :, :, None], -1), 1, 3)[:, :, :, None]
              if one_query else dense("btkgd,bskd->bkgts", q, keys)).astype(jnp.float32)
    scores = scores * (head_dim ** -0.5)
    visible = key_positions[:, None, None, None, :] <= positions[:, None, None, :, None]
    if segment_ids is not None:
      visible &= segment_ids[:, None, None, None, :] == segment_ids[:, None, None, :, None]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = softmax(scores).astype(dtype)
    out = (summed_products(jnp.moveaxis(probs[:, :, :, 0], 3, 1)[..., None],
                           values[:, :, :, None], 1)[:, None]
           if one_query else dense("bkgts,bskd->btkgd", probs, values))
    out = out.reshape(batch, length, heads, head_dim)
    return project(out, self.o[...], contract=2), new_cache


class MLP(nnx.Module):
  """SwiGLU feed-forward (Shazeer 2020)."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    d, f, pd, normal = config.d_model, config.d_ff, config.param_dtype, nnx.initializers.normal
    self.gate = _param(rngs, normal(stddev=d ** -0.5), (d, f), ("embed", "mlp"), pd)
    self.up = _param(rngs, normal(stddev=d ** -0.5), (d, f), ("embed", "mlp"), pd)
    self.down = _param(rngs, normal(stddev=f ** -0.5), (f, d), ("mlp", "embed"), pd)

  def __call__(self, x):
    hidden = jax.nn.silu(project(x, self.gate[...])) * project(x, self.up[...])
    return project(hidden, self.down[...])


class Block(nnx.Module):

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.attn_norm = RMSNorm(config.d_model, config.norm_eps, rngs, config.param_dtype)
    self.attn = Attention(config, rngs)
    self.mlp_norm = RMSNorm(config.d_model, config.norm_eps, rngs, config.param_dtype)
    self.mlp = MLP(config, rngs)

  def __call__(self, x, positions, cache_kv, segment_ids=None):
    attn_out, new_cache = self.attn(self.attn_norm(x), positions, cache_kv, segment_ids)
    x = x + attn_out
    return x + self.mlp(self.mlp_norm(x)), new_cache


class Decoder(nnx.Module):
  """tokens [B, T] int32, positions [B, T] -> logits [B, T, V] float32 (and the new cache)."""

  def __init__(self, config: ModelConfig, rngs: nnx.Rngs):
    self.config = config
    pd = config.param_dtype
    self.embed = _param(rngs, nnx.initializers.normal(stddev=1.0),
                        (config.vocab_size, config.d_model), ("vocab", "embed"), pd)
    self.blocks = nnx.List([Block(config, rngs) for _ in range(config.n_layers)])
    self.final_norm = RMSNorm(config.d_model, config.norm_eps, rngs, pd)
    if not config.tie_embeddings:
      self.lm_head = _param(rngs, nnx.initializers.normal(stddev=config.d_model ** -0.5),
                            (config.d_model, config.vocab_size), ("embed", "vocab"), pd)

  def __call__(self, tokens, positions=None, cache: KVCache | None = None, segment_ids=None,
               return_hidden: bool = False):
    """return_hidden: the final-normed hidden states [B, T, D] (compute dtype) instead of the
    logits; `project_logits(hidden, unembedding(params))` gives the logits."""
    if tokens.ndim != 2:
      raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
    if segment_ids is not None:
      if cache is not None:
        raise ValueError("segment_ids (packed rows) cannot be used with a KV cache")
      if positions is None:
        raise ValueError("segment_ids (packed rows) need positions that restart in each segment")
      if segment_ids.shape != tokens.shape:
        raise ValueError(f"segment_ids must be shaped like tokens {tokens.shape}, got "
                         f"{segment_ids.shape}")
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    dtype = jnp.dtype(self.config.dtype)
    x = embed_tokens(self.embed[...], tokens).astype(dtype)
    new_keys, new_values = [], []
    if cache is None and self.config.remat:
      x = _remat_blocks(list(self.blocks), x, positions, segment_ids)
    else:
      for i, block in enumerate(self.blocks):
        layer_cache = None if cache is None else (cache.keys[i], cache.values[i])
        x, layer_new = block(x, positions, layer_cache, segment_ids)
        if layer_new is not None:
          new_keys, new_values = new_keys + [layer_new[0]], new_values + [layer_new[1]]
    x = self.final_norm(x)
    new_cache = None if cache is None else KVCache(tuple(new_keys), tuple(new_values))
    if return_hidden:
      return x, new_cache
    if self.config.tie_embeddings:
      return project_logits(x, self.embed[...], vocab_major=True), new_cache
    return project_logits(x, self.lm_head[...]), new_cache


def project_logits(hidden: jax.Array, head: jax.Array, vocab_major: bool = False) -> jax.Array:
  """The unembedding: hidden [..., D] (after the final norm) @ head [D, V] -> float32 logits;
  with `vocab_major`, head is [V, D] (a tied embedding as stored).

  The decoder's own head, so that logits computed from returned hidden states (e.g. in chunks)
  equal the decoder's. A tied embedding is contracted as it is stored: its transpose would be
  materialised (XLA:CPU copies the whole [V, D] matrix on every call).
  """
  spec = "...d,vd->...v" if vocab_major else "...d,dv->...v"
  if hidden.dtype == jnp.float32:
    return jnp.einsum(spec, hidden, head.astype(jnp.float32))
  # no float32 copy of the (large) head; accumulate in float32
  return jnp.einsum(spec, hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)


def unembedding(params) -> jax.Array:
  """The head [D, V] of a params dict (`split_model`): lm_head, or the tied embedding's
  transpose (`head_of` gives it as stored, for `project_logits`)."""
  return params["lm_head"] if "lm_head" in params else params["embed"].T


def head_of(params) -> tuple[jax.Array, bool]:
  """(head, vocab_major) for `project_logits`: lm_head [D, V], or the tied embedding [V, D]."""
  return (params["lm_head"], False) if "lm_head" in params else (params["embed"], True)


def _remat_blocks(blocks: list[Block], x, positions, segment_ids):
  """Gradient checkpointing: the blocks' parameters stacked and scanned over, each step
  rematerialised, so the backward pass recomputes one block's activations at a time.

  The scan matters: XLA's CPU scheduler hoists the recomputation of unrolled checkpointed
  blocks into the forward pass (their activations then all stay live, and remat saves nothing),
  while a loop body cannot be hoisted. The stacked copy of the block parameters is the price.
  """
  graphdef, first = nnx.split(blocks[0])
  states = [first, *(nnx.split(block)[1] for block in blocks[1:])]
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)

  @jax.checkpoint
  def step(h, state):
    return nnx.merge(graphdef, state)(h, positions, None, segment_ids)[0], None

  return jax.lax.scan(step, x, stacked)[0]


def init_model(config: ModelConfig, seed: int = 0) -> Decoder:
  return Decoder(config, nnx.Rngs(params=seed))


def split_model(model: Decoder):
  """(graphdef, params): the static structure and the parameters as a plain nested dict.

  Plain dicts of arrays are what jit, optax, orbax and device transfers all take as they are.
  """
  graphdef, state = nnx.split(model, nnx.Param)
  return graphdef, nnx.to_pure_dict(state)


def param_logical_axes(model: Decoder):
  """Nested dict, like the params, of each parameter's logical axis names (a tuple)."""
  _, state = nnx.split(model, nnx.Param)
  axes = jax.tree.map(lambda var: var.get_metadata()["out_sharding"], state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(axes)


def abstract_params(config: ModelConfig):
  """(graphdef, params as ShapeDtypeStructs, logical axes) without allocating weights."""
  model = nnx.eval_shape(lambda: init_model(config))
  graphdef, params = split_model(model)
  return graphdef, params, param_logical_axes(model)


def apply(graphdef, params, tokens, positions=None, cache: KVCache | None = None,
          segment_ids=None, return_hidden: bool = False):
  """Pure forward pass: merge the module inside the traced function and run it.
  return_hidden: (final hidden states [B, T, D], cache) instead of (logits, cache)."""
  model = nnx.merge(graphdef, params)
  return model(tokens, positions, cache, segment_ids, return_hidden=return_hidden)
