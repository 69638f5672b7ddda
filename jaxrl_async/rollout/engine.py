"""A decode engine with the shape of JetStream's Engine API, for our decoder.

    prefix = engine.prefill(params=params, padded_tokens=tokens, true_length=n)
    state = engine.insert(prefix, state, slot, rng=key)
    state, result = engine.generate(params, state)   # one token for every slot

Differences from JetStream, on purpose:
- `prefill` returns only the prefix. The last prompt token is fed by the first `generate` step,
  so every response token, the first included, is drawn by `generate` with the key
  fold_in(slot key, index of the token). A sample's tokens therefore depend only on its own key,
  never on which slot it ran in or what ran beside it: continuous batching equals solo decoding.
- `insert` takes the sample's key, so one prefill serves a whole GRPO group.
- `ResultTokens` carries `log_prob` (the behaviour logprob of each token) beside the tokens.

All device work is jitted once per shape: params are arguments, so `load_params` with new
weights of the same shapes and shardings never recompiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from jaxrl_async import sharding
from jaxrl_async.model import KVCache, ModelConfig, apply
from jaxrl_async.model.decoder import LOGICAL_CACHE_AXES
from jaxrl_async.rollout.sampling import SamplingConfig, sample_token


@struct.dataclass
class Prefix:
  """A prefilled prompt: its cache ([1, bucket, ...]), last token and true length."""

  cache: KVCache
  last_token: jax.Array  # int32 []
  true_length: jax.Array  # int32 []


@struct.dataclass
class DecodeState:
  """Everything the decode slots hold. S = max_concurrent_decodes."""

  cache: KVCache  # [S, cache_length, ...]
  tokens: jax.Array  # int32 [S]: the token each slot feeds next
  positions: jax.Array  # int32 [S]: the position of that token
  keys: jax.Array  # uint32 [S, 2]: each slot's sample key
  generated: jax.Array  # int32 [S]: response tokens drawn so far


@dataclasses.dataclass(frozen=True)
class ResultTokens:
  """Host-side result of one `generate` call: one row per slot, `steps` tokens per row."""

  tokens: np.ndarray  # int32 [S, steps]
  log_prob: np.ndarray  # float32 [S, steps]

  def get_result_at_slot(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
    return self.tokens[slot], self.log_prob[slot]


def raw_key(rng) -> np.ndarray:
  """A PRNG key, typed (jax.random.key) or raw (PRNGKey / uint32 [2]), as uint32 [2]."""
  if isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
    rng = jax.random.key_data(rng)
  return np.asarray(rng, np.uint32)


def prefill_buckets(max_prefill_length: int, smallest: int = 8) -> tuple[int, ...]:
  buckets, size = [], smallest
  while size < max_prefill_length:
    buckets.append(size)
    size *= 2
  return tuple(buckets) + (max_prefill_length,)


def _out(state_sh, out_shardings) -> dict:
  return {} if state_sh is None else {"out_shardings": out_shardings}


class Engine:
  """Continuous-batching decode engine over `max_concurrent_decodes` slots."""

  def __init__(self, graphdef, config: ModelConfig, *, max_concurrent_decodes: int,
               max_prefill_length: int, sampling: SamplingConfig = SamplingConfig(),
               cache_length: int | None = None, steps_per_call: int = 1,
               mesh: Mesh | None = None, logical_axes=None):
    cache_length = config.max_seq_len if cache_length is None else cache_length
    if max_concurrent_decodes < 1:
      raise ValueError(f"max_concurrent_decodes must be >= 1, got {max_concurrent_decodes}")
    if not 1 <= max_prefill_length <= cache_length:
      raise ValueError(
          f"max_prefill_length must be in [1, cache_length={cache_length}], got "
          f"{max_prefill_length}")
    if steps_per_call < 1:
      raise ValueError(f"steps_per_call must be >= 1, got {steps_per_call}")
    self.graphdef = graphdef
    self.config = config
    self.sampling = sampling
    self.cache_length = cache_length
    self.steps_per_call = steps_per_call
    self._slots = max_concurrent_decodes
    self._max_prefill_length = max_prefill_length
    self.buckets = prefill_buckets(max_prefill_length)
    self.mesh = mesh
    self.logical_axes = logical_axes
    # On a mesh the decode state (KV cache included) lives there with fixed shardings, so every
    # call returns it as it came in (no recompile) and nothing lands on another role's devices.
    state_sh = None if mesh is None else sharding.decode_state_shardings(
        mesh, jax.eval_shape(self._init_decode_state_impl), LOGICAL_CACHE_AXES)
    self.decode_state_shardings = state_sh
    self._generate = jax.jit(self._generate_impl, donate_argnums=(1,),
                             **_out(state_sh, (state_sh, None)))
    self._prefill = jax.jit(self._prefill_impl)
    self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), **_out(state_sh, state_sh))
    self._insert_many = jax.jit(self._insert_many_impl, donate_argnums=(1,),
                                **_out(state_sh, state_sh))
    self._prefill_insert = jax.jit(self._prefill_insert_impl, donate_argnums=(1,),
                                   **_out(state_sh, state_sh))
    # Built by jit so its shardings match the outputs of insert / generate (no recompile).
    self._init_decode_state = jax.jit(self._init_decode_state_impl, **_out(state_sh, state_sh))

  # ---- JetStream Engine API ---------------------------------------------------------------
  @property
  def max_concurrent_decodes(self) -> int:
    return self._slots

  @property
  def max_prefill_length(self) -> int:
    return self._max_prefill_length

  @property
  def samples_per_slot(self) -> int:
    return 1

  def load_params(self, params):
    """Place params on the engine's mesh (same shardings every time: no recompile)."""
    if self.mesh is None or self.logical_axes is None:
      return params
    return jax.device_put(params, sharding.param_shardings(self.logical_axes, params, self.mesh))

  def init_decode_state(self) -> DecodeState:
    return self._init_decode_state()

  def _init_decode_state_impl(self) -> DecodeState:
    slots = self._slots
    return DecodeState(
        cache=KVCache.zeros(self.config, slots, self.cache_length),
        tokens=jnp.zeros((slots,), jnp.int32),
        positions=jnp.zeros((slots,), jnp.int32),
        keys=jnp.zeros((slots, 2), jnp.uint32),
        generated=jnp.zeros((slots,), jnp.int32),
    )

  def prefill(self, *, params, padded_tokens, true_length: int) -> Prefix:
    """padded_tokens: [n] int32 with n a bucket size (see `pad_to_bucket`)."""
    if not 1 <= true_length <= len(padded_tokens):
      raise ValueError(f"true_length={true_length} outside [1, {len(padded_tokens)}]")
    # numpy arguments: jit converts them in its own dispatch, with no eager device op each.
    return self._prefill(params, np.asarray(padded_tokens, np.int32), np.int32(true_length))

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int, *,
             rng: jax.Array, num_generated: int = 0) -> DecodeState:
    """Put a prefix into `slot`; `num_generated` > 0 resumes a re-prefilled partial response
    (its last `num_generated` prefix tokens are response tokens), keeping the key schedule."""
    if not 0 <= slot < self._slots:
      raise ValueError(f"slot {slot} outside [0, {self._slots})")
    return self._insert(prefix, decode_state, np.int32(slot), raw_key(rng),
                        np.int32(num_generated))

  def insert_many(self, prefix: Prefix, decode_state: DecodeState, slots, *,
                  rngs) -> DecodeState:
    """`insert` of one prefix into several slots (the members of a GRPO group), each with its
    own key (rngs: uint32 [n, 2]), in one device call."""
    slots = np.asarray(slots, np.int32)
    if slots.ndim != 1 or not len(slots) or slots.min() < 0 or slots.max() >= self._slots:
      raise ValueError(f"slots must be a non-empty list in [0, {self._slots}), got {slots}")
    rngs = np.stack([raw_key(rng) for rng in rngs])
    if rngs.shape != (len(slots), 2):
      raise ValueError(f"rngs must be uint32 [{len(slots)}, 2], got {rngs.shape}")
    # Padded to every slot (rows past len(slots) are not run): one program per prefix bucket.
    count, width = len(slots), self._slots
    if count > width or len(set(slots.tolist())) != count:
      raise ValueError(f"slots must be distinct, at most {width}, got {slots}")
    padded = [np.zeros((width,), np.int32), np.zeros((width, 2), np.uint32)]
    padded[0][:count], padded[1][:count] = slots, rngs
    return self._insert_many(prefix, decode_state, *padded, np.int32(count))

  def warm_up(self, params, decode_state: DecodeState, *, resume: bool = True) -> DecodeState:
    """Runs once every program a rollout meets, at every prefill bucket: prefill and
    insert_many (admitting a group), prefill_insert (resuming partial responses; with `resume`)
    and generate, so that none compiles during a run. Writes into the slots of `decode_state`
    (returned); start from a fresh one after. `params`: any weights of the right shapes."""
    for bucket in self.buckets:
      tokens = np.ones((bucket,), np.int32)
      prefix = self.prefill(params=params, padded_tokens=tokens, true_length=bucket)
      decode_state = self.insert_many(prefix, decode_state, [0], rngs=np.zeros((1, 2), np.uint32))
      if resume:
        decode_state = self.prefill_insert(params=params, decode_state=decode_state,
                                           sequences=[tokens], slots=[0],
                                           rngs=np.zeros((1, 2), np.uint32), num_generated=[0])
    decode_state, _ = self.generate(params, decode_state)
    return decode_state

  def prefill_insert(self, *, params, decode_state: DecodeState, sequences, slots, rngs,
                     num_generated) -> DecodeState:
    """`prefill` of each sequence (int32 1-D) and `insert` of it into slots[i] with its key
    rngs[i] and num_generated[i] response tokens at its end, all in one device call: a loop over
    the rows in the program, every row padded to the bucket of the longest. Each row runs
    `prefill`'s and `insert`'s own programs, so a row whose bucket is its own holds exactly what
    the two calls would give (batching never changes a sample's tokens or logprobs), and the
    call compiles once per bucket whatever the number of rows. Used to resume many partial
    responses at once, e.g. every in-flight sample after a weight swap ('reprefill')."""
    slots = np.asarray(slots, np.int32)
    count = len(sequences)
    if not 1 <= count <= self._slots:
      raise ValueError(f"prefill_insert takes 1 to {self._slots} sequences, got {count}")
    if slots.shape != (count,) or slots.min() < 0 or slots.max() >= self._slots \
        or len(set(slots.tolist())) != count:
      raise ValueError(f"slots must be {count} distinct slots in [0, {self._slots}), got {slots}")
    rngs = np.stack([raw_key(rng) for rng in rngs])
    num_generated = np.asarray(num_generated, np.int32)
    if rngs.shape != (count, 2) or num_generated.shape != (count,):
      raise ValueError(f"rngs must be uint32 [{count}, 2] and num_generated int32 [{count}], "
                       f"got {rngs.shape} and {num_generated.shape}")
    bucket = self.bucket_of(max(len(sequence) for sequence in sequences))
    width = self._slots  # fixed: one program per bucket; rows past `count` are not run
    tokens = np.zeros((width, bucket), np.int32)
    lengths = np.ones((width,), np.int32)
    for row, sequence in enumerate(sequences):
      if not len(sequence):
        raise ValueError("cannot prefill an empty sequence")
      tokens[row, :len(sequence)] = sequence
      lengths[row] = len(sequence)
    padded = [np.zeros((width,), np.int32), np.zeros((width, 2), np.uint32),
              np.zeros((width,), np.int32)]
    for full, given in zip(padded, (slots, rngs, num_generated), strict=True):
      full[:count] = given
    return self._prefill_insert(params, decode_state, tokens, lengths, *padded, np.int32(count))

  def generate(self, params, decode_state: DecodeState) -> tuple[DecodeState, ResultTokens]:
    decode_state, (tokens, log_probs) = self._generate(params, decode_state)
    tokens, log_probs = jax.device_get((tokens, log_probs))
    return decode_state, ResultTokens(tokens=np.asarray(tokens), log_prob=np.asarray(log_probs))

  # ---- helpers ------------------------------------------------------------------------------
  def bucket_of(self, n: int) -> int:
    """The prefill length a sequence of n tokens is padded to."""
    if n == 0:
      raise ValueError("cannot prefill an empty prompt")
    if n > self._max_prefill_length:
      raise ValueError(
          f"prompt of {n} tokens exceeds max_prefill_length={self._max_prefill_length}")
    return next(b for b in self.buckets if b >= n)

  def pad_to_bucket(self, tokens: np.ndarray) -> np.ndarray:
    n = len(tokens)
    out = np.zeros((self.bucket_of(n),), np.int32)
    out[:n] = tokens
    return out

  # ---- jitted bodies --------------------------------------------------------------------------
  def _prefill_impl(self, params, tokens, true_length):
    cache = KVCache.zeros(self.config, 1, tokens.shape[0])
    _, cache = apply(self.graphdef, params, tokens[None, :], None, cache)
    return Prefix(cache=cache, last_token=tokens[true_length - 1], true_length=true_length)

  def _prefill_insert_impl(self, params, state: DecodeState, tokens, lengths, slots, rngs,
                           num_generated, count):
    def body(i, current):
      prefix = self._prefill_impl(params, tokens[i], lengths[i])
      return self._insert_impl(prefix, current, slots[i], rngs[i], num_generated[i])

    return jax.lax.fori_loop(0, count, body, state)

  def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, rng, num_generated):
    def write(slot_cache, prefix_cache):
      return jax.lax.dynamic_update_slice(slot_cache, prefix_cache.astype(slot_cache.dtype),
                                          (slot, 0, 0, 0))

    cache = jax.tree.map(write, state.cache, prefix.cache)
    return DecodeState(
        cache=cache,
        tokens=state.tokens.at[slot].set(prefix.last_token),
        positions=state.positions.at[slot].set(prefix.true_length - 1),
        keys=state.keys.at[slot].set(rng),
        generated=state.generated.at[slot].set(num_generated),
    )

  def _insert_many_impl(self, prefix: Prefix, state: DecodeState, slots, rngs, count):
    def body(i, current):
      return self._insert_impl(prefix, current, slots[i], rngs[i], jnp.int32(0))

    return jax.lax.fori_loop(0, count, body, state)

  def _decode_step(self, params, state: DecodeState):
    logits, cache = apply(self.graphdef, params, state.tokens[:, None], state.positions[:, None],
                          state.cache)
    step_keys = jax.vmap(jax.random.fold_in)(state.keys, state.generated)
    sample = functools.partial(sample_token, config=self.sampling)
    tokens, log_probs = jax.vmap(sample)(logits[:, 0], step_keys)
    # Idle slots run too (static shapes); keep their positions inside the cache.
    positions = jnp.minimum(state.positions + 1, self.cache_length - 1)
    new_state = DecodeState(cache=cache, tokens=tokens, positions=positions, keys=state.keys,
                            generated=state.generated + 1)
    return new_state, (tokens, log_probs)

  def _generate_impl(self, params, state: DecodeState):
    state, (tokens, log_probs) = jax.lax.scan(
        lambda s, _: self._decode_step(params, s), state, None, length=self.steps_per_call)
    return state, (tokens.T, log_probs.T)  # [S, steps]
