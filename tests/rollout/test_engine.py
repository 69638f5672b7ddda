"""Tests for jaxrl_async.rollout.engine: behaviour logprobs == learner logprobs, slot independence,
bucketing and argument errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async import sharding
from jaxrl_async.learner.step import make_logprob_fn, sequence_logprobs
from jaxrl_async.model import get_config, init_model, param_logical_axes, split_model
from jaxrl_async.rollout.engine import Engine, ResultTokens, prefill_buckets
from jaxrl_async.rollout.generation import sample_key
from jaxrl_async.rollout.sampling import SamplingConfig

CONFIG = get_config("tiny", max_seq_len=32)
SLOTS = 4
PROMPTS = [np.array([1, 5, 6, 7, 4]), np.array([1, 9, 4]), np.array([1, 5, 5, 5, 6, 6, 6, 4]),
           np.array([1, 4])]


@pytest.fixture(scope="module")
def model():
  module = init_model(CONFIG, seed=0)
  graphdef, params = split_model(module)
  return graphdef, params, param_logical_axes(module)


@pytest.fixture(scope="module")
def engines(model):
  """Compiled engines shared by the tests, by (temperature, steps_per_call)."""
  graphdef = model[0]
  built = {}

  def get(temperature=1.0, steps_per_call=1):
    key = (temperature, steps_per_call)
    if key not in built:
      built[key] = Engine(graphdef, CONFIG, max_concurrent_decodes=SLOTS, max_prefill_length=8,
                          sampling=SamplingConfig(temperature=temperature),
                          steps_per_call=steps_per_call)
    return built[key]

  return get


def decode(engine, params, placements, steps):
  """placements: {slot: (prompt, key)} -> {slot: (tokens [steps], logprobs [steps])}."""
  state = engine.init_decode_state()
  for slot, (prompt, key) in placements.items():
    prefix = engine.prefill(params=params, padded_tokens=engine.pad_to_bucket(prompt),
                            true_length=len(prompt))
    state = engine.insert(prefix, state, slot, rng=key)
  tokens, logprobs = [], []
  while sum(t.shape[1] for t in tokens) < steps:
    state, result = engine.generate(params, state)
    assert isinstance(result, ResultTokens)
    assert result.tokens.shape == result.log_prob.shape == (SLOTS, engine.steps_per_call)
    tokens.append(result.tokens)
    logprobs.append(result.log_prob)
  tokens = np.concatenate(tokens, axis=1)[:, :steps]
  logprobs = np.concatenate(logprobs, axis=1)[:, :steps]
  return {slot: (tokens[slot], logprobs[slot]) for slot in placements}


def _placements(seed=0):
  return {slot: (prompt, sample_key(seed, slot, 0)) for slot, prompt in enumerate(PROMPTS)}


# ---- behaviour logprobs == learner logprobs ----------------------------------------------------
@pytest.mark.parametrize("temperature, steps_per_call", [(1.0, 1), (0.7, 3)])
def test_behaviour_logprobs_equal_learner_logprobs(model, engines, temperature, steps_per_call):
  graphdef, params, _ = model
  steps = 12
  out = decode(engines(temperature, steps_per_call), params, _placements(), steps)
  seq_len = max(len(p) for p in PROMPTS) + steps
  rows = np.zeros((len(PROMPTS), seq_len), np.int32)  # right padding: causal, never seen
  for slot, prompt in enumerate(PROMPTS):
    rows[slot, :len(prompt) + steps] = np.concatenate([prompt, out[slot][0]])
  learner_logp = np.asarray(make_logprob_fn(graphdef, temperature)(params, jnp.asarray(rows)))
  for slot, prompt in enumerate(PROMPTS):
    behaviour = out[slot][1]
    learner = learner_logp[slot, len(prompt):len(prompt) + steps]
    assert behaviour.dtype == np.float32
    assert np.max(np.abs(behaviour - learner)) <= 1e-4, (slot, behaviour, learner)


def test_learner_logprobs_use_the_temperature(model, engines):
  graphdef, params, _ = model
  out = decode(engines(1.0, 1), params, {0: (PROMPTS[0], sample_key(0, 0, 0))}, 6)
  tokens = jnp.asarray(np.concatenate([PROMPTS[0], out[0][0]])[None])
  logprobs = jax.jit(sequence_logprobs, static_argnums=(0, 3))
  at_1, logits = logprobs(graphdef, params, tokens, 1.0)
  at_07, _ = logprobs(graphdef, params, tokens, 0.7)
  assert np.all(np.asarray(at_1[:, 0]) == 0.0)
  # Temperature-0.7 logprobs, by hand from the logits.
  scaled = np.asarray(logits, np.float64) / 0.7
  logz = np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1)) + scaled.max(-1)
  reference = np.take_along_axis(scaled, np.asarray(tokens)[:, 1:, None], -1)[..., 0] - logz
  np.testing.assert_allclose(np.asarray(at_07[:, 1:]), reference, atol=1e-5)
  assert not np.allclose(np.asarray(at_1), np.asarray(at_07), atol=1e-3)


# ---- one sample's tokens depend on its key only ------------------------------------------------
def test_tokens_do_not_depend_on_slot_or_neighbours(model, engines):
  _, params, _ = model
  engine = engines(1.0, 1)
  key = sample_key(3, 1, 2)
  alone = decode(engine, params, {0: (PROMPTS[0], key)}, 10)[0]
  crowded = decode(engine, params, {
      3: (PROMPTS[0], key), 0: (PROMPTS[2], sample_key(3, 9, 0)),
      1: (PROMPTS[1], sample_key(3, 9, 1))}, 10)[3]
  np.testing.assert_array_equal(alone[0], crowded[0])
  np.testing.assert_allclose(alone[1], crowded[1], atol=1e-5)
  other_key = decode(engine, params, {0: (PROMPTS[0], sample_key(3, 1, 3))}, 10)[0]
  assert not np.array_equal(alone[0], other_key[0])


def test_steps_per_call_does_not_change_the_tokens(model, engines):
  _, params, _ = model
  one = decode(engines(0.7, 1), params, _placements(1), 9)
  three = decode(engines(0.7, 3), params, _placements(1), 9)
  for slot in one:
    np.testing.assert_array_equal(one[slot][0], three[slot][0])
    np.testing.assert_allclose(one[slot][1], three[slot][1], atol=1e-5)


def test_typed_and_raw_keys_give_the_same_tokens(model, engines):
  _, params, _ = model
  engine = engines(1.0, 1)
  raw = decode(engine, params, {0: (PROMPTS[1], jax.random.PRNGKey(7))}, 6)[0]
  typed = decode(engine, params, {0: (PROMPTS[1], jax.random.key(7))}, 6)[0]
  as_numpy = decode(engine, params, {0: (PROMPTS[1], np.asarray(jax.random.PRNGKey(7)))}, 6)[0]
  np.testing.assert_array_equal(raw[0], typed[0])
  np.testing.assert_array_equal(raw[0], as_numpy[0])


def test_sharded_engine_matches_unsharded(model, engines):
  graphdef, params, axes = model
  mesh = sharding.make_mesh(sharding.MeshShape(fsdp=1, tensor=2), jax.devices()[:2])
  sharded = Engine(graphdef, CONFIG, max_concurrent_decodes=SLOTS, max_prefill_length=8,
                   mesh=mesh, logical_axes=axes)
  placed = sharded.load_params(params)
  gate = placed["blocks"][0]["mlp"]["gate"]
  assert gate.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert {shard.data.shape for shard in gate.addressable_shards} == {(64, 96)}
  assert engines(1.0, 1).load_params(params) is params  # no mesh: params are used as they are
  a = decode(sharded, placed, _placements(2), 6)
  b = decode(engines(1.0, 1), params, _placements(2), 6)
  for slot in a:
    np.testing.assert_array_equal(a[slot][0], b[slot][0])
    np.testing.assert_allclose(a[slot][1], b[slot][1], atol=1e-5)


# ---- buckets and argument errors ---------------------------------------------------------------
def test_prefill_buckets():
  assert prefill_buckets(32) == (8, 16, 32)
  assert prefill_buckets(20) == (8, 16, 20)
  assert prefill_buckets(8) == (8,)
  assert prefill_buckets(5) == (5,)
  assert prefill_buckets(40, smallest=4) == (4, 8, 16, 32, 40)


def test_pad_to_bucket(model):
  engine = Engine(model[0], CONFIG, max_concurrent_decodes=1, max_prefill_length=20)
  assert engine.buckets == (8, 16, 20)
  padded = engine.pad_to_bucket(np.arange(1, 10))
  assert padded.dtype == np.int32 and len(padded) == 16
  np.testing.assert_array_equal(padded, list(range(1, 10)) + [0] * 7)
  assert len(engine.pad_to_bucket(np.ones(8))) == 8
  assert len(engine.pad_to_bucket(np.ones(17))) == 20
  with pytest.raises(ValueError, match="empty prompt"):
    engine.pad_to_bucket(np.zeros((0,), np.int32))
  with pytest.raises(ValueError, match=r"prompt of 21 tokens exceeds max_prefill_length=20"):
    engine.pad_to_bucket(np.ones(21))


@pytest.mark.parametrize("kwargs, match", [
    ({"max_concurrent_decodes": 0}, r"max_concurrent_decodes must be >= 1, got 0"),
    ({"max_prefill_length": 0}, r"max_prefill_length must be in \[1, cache_length=32\], got 0"),
    ({"max_prefill_length": 33}, r"max_prefill_length.*cache_length=32.*got 33"),
    ({"max_prefill_length": 17, "cache_length": 16}, r"cache_length=16\], got 17"),
    ({"steps_per_call": 0}, r"steps_per_call must be >= 1, got 0"),
])
def test_constructor_errors_name_the_argument(model, kwargs, match):
  args = dict(max_concurrent_decodes=2, max_prefill_length=8)
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    Engine(model[0], CONFIG, **args)


def test_prefill_and_insert_argument_errors(model, engines):
  _, params, _ = model
  engine = engines(1.0, 1)
  assert (engine.max_concurrent_decodes, engine.max_prefill_length) == (SLOTS, 8)
  assert engine.samples_per_slot == 1 and engine.cache_length == CONFIG.max_seq_len
  padded = engine.pad_to_bucket(PROMPTS[0])
  with pytest.raises(ValueError, match=r"true_length=0 outside \[1, 8\]"):
    engine.prefill(params=params, padded_tokens=padded, true_length=0)
  with pytest.raises(ValueError, match=r"true_length=9 outside"):
    engine.prefill(params=params, padded_tokens=padded, true_length=9)
  prefix = engine.prefill(params=params, padded_tokens=padded, true_length=len(PROMPTS[0]))
  assert int(prefix.true_length) == 5 and int(prefix.last_token) == PROMPTS[0][-1]
  with pytest.raises(ValueError, match=rf"slot {SLOTS} outside \[0, {SLOTS}\)"):
    engine.insert(prefix, engine.init_decode_state(), SLOTS, rng=jax.random.PRNGKey(0))


def test_insert_many_equals_inserts_one_by_one(model):
  graphdef, params, _ = model
  engine = Engine(graphdef, CONFIG, max_concurrent_decodes=4, max_prefill_length=8)
  prompt = np.asarray(PROMPTS[0], np.int32)
  prefix = engine.prefill(params=params, padded_tokens=engine.pad_to_bucket(prompt),
                          true_length=len(prompt))
  keys = [sample_key(0, 5, m) for m in range(3)]
  one_by_one = engine.init_decode_state()
  for slot, key in zip((3, 0, 2), keys):
    one_by_one = engine.insert(prefix, one_by_one, slot, rng=key)
  together = engine.insert_many(prefix, engine.init_decode_state(), [3, 0, 2], rngs=keys)
  for a, b in zip(jax.tree.leaves(one_by_one), jax.tree.leaves(together)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  engine.insert_many(prefix, engine.init_decode_state(), [1], rngs=keys[:1])
  assert engine._insert_many._cache_size() == 1  # one program whatever the group's size
  with pytest.raises(ValueError, match="slots must be distinct"):
    engine.insert_many(prefix, engine.init_decode_state(), [1, 1], rngs=keys[:2])
  with pytest.raises(ValueError, match="slots must be a non-empty list"):
    engine.insert_many(prefix, engine.init_decode_state(), [4], rngs=keys[:1])
  with pytest.raises(ValueError, match="rngs must be uint32"):
    engine.insert_many(prefix, engine.init_decode_state(), [0, 1], rngs=keys[:1])


def test_prefill_insert_equals_one_prefill_and_insert_each(model):
  """A batched re-prefill holds, row for row, exactly what one prefill and insert each would:
  the same caches, last tokens, positions, keys and response counts (bit for bit), whatever
  the number of rows (one program per bucket)."""
  graphdef, params, _ = model
  engine = Engine(graphdef, CONFIG, max_concurrent_decodes=SLOTS, max_prefill_length=16)
  sequences = [np.asarray(PROMPTS[p].tolist() + [3, 4][:i], np.int32)
               for i, p in enumerate((1, 3, 0))]
  assert {engine.bucket_of(len(s)) for s in sequences} == {8}  # one bucket: the rows' own
  slots, keys, generated = [2, 0, 3], [sample_key(1, 7, m) for m in range(3)], [0, 1, 2]
  for n in (3, 1):
    one_by_one = engine.init_decode_state()
    for sequence, slot, key, k in zip(sequences[:n], slots, keys, generated):
      prefix = engine.prefill(params=params, padded_tokens=engine.pad_to_bucket(sequence),
                              true_length=len(sequence))
      one_by_one = engine.insert(prefix, one_by_one, slot, rng=key, num_generated=k)
    together = engine.prefill_insert(params=params, decode_state=engine.init_decode_state(),
                                     sequences=sequences[:n], slots=slots[:n], rngs=keys[:n],
                                     num_generated=generated[:n])
    for a, b in zip(jax.tree.leaves(one_by_one), jax.tree.leaves(together)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert engine._prefill_insert._cache_size() == 1


def test_prefill_insert_argument_errors(model):
  graphdef, params, _ = model
  engine = Engine(graphdef, CONFIG, max_concurrent_decodes=2, max_prefill_length=8)
  state = engine.init_decode_state()
  key = sample_key(0, 0, 0)

  def call(sequences, slots, rngs=None, generated=None):
    engine.prefill_insert(params=params, decode_state=state, sequences=sequences, slots=slots,
                          rngs=[key] * len(slots) if rngs is None else rngs,
                          num_generated=[0] * len(slots) if generated is None else generated)

  with pytest.raises(ValueError, match="takes 1 to 2 sequences, got 0"):
    call([], [])
  with pytest.raises(ValueError, match="takes 1 to 2 sequences, got 3"):
    call([PROMPTS[1]] * 3, [0, 1, 1])
  with pytest.raises(ValueError, match=r"slots must be 2 distinct slots in \[0, 2\)"):
    call([PROMPTS[1]] * 2, [1, 1])
  with pytest.raises(ValueError, match=r"slots must be 1 distinct slots in \[0, 2\)"):
    call([PROMPTS[1]], [2])
  with pytest.raises(ValueError, match=r"rngs must be uint32 \[2, 2\] and num_generated"):
    call([PROMPTS[1]] * 2, [0, 1], rngs=[key])
  with pytest.raises(ValueError, match="exceeds max_prefill_length=8"):
    call([np.ones(9, np.int32)], [0])
  with pytest.raises(ValueError, match="empty"):
    call([PROMPTS[1], np.zeros(0, np.int32)], [0, 1])
