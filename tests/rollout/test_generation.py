"""Tests for jaxrl_async.rollout.generation (and evaluate): continuous batching == solo decoding,
weight swaps without recompiles, partial rollouts, input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.learner.step import make_logprob_fn
from jaxrl_async.model import get_config, init_model, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.evaluate import EVAL_SEED_OFFSET, evaluate
from jaxrl_async.rollout.generation import (
  ContinuousBatcher,
  GenerationRequest,
  sample_key,
  sample_keys,
)
from jaxrl_async.tasks.base import Problem
from jaxrl_async.types import Sample

CONFIG = get_config("tiny", max_seq_len=32)
SLOTS = 4
EOS = 2  # sampled now and then by the random tiny model: responses of varied lengths
NEVER = -1  # an end token that is never sampled: every response runs to max_response_len
MAX_RESPONSE = 10
SEED = 11


@pytest.fixture(scope="module")
def model():
  graphdef, params = split_model(init_model(CONFIG, seed=0))
  _, new_params = split_model(init_model(CONFIG, seed=1))
  return graphdef, params, new_params


@pytest.fixture(scope="module")
def engine(model):
  return Engine(model[0], CONFIG, max_concurrent_decodes=SLOTS, max_prefill_length=32)


@pytest.fixture(scope="module")
def logprob_fn(model):
  return make_logprob_fn(model[0], 1.0)


def _prompt(length, salt=0):
  rng = np.random.default_rng([length, salt])
  return np.concatenate([[1], rng.integers(5, 15, size=length - 2), [4]]).astype(np.int32)


def make_requests(prompt_lengths=(3, 9, 5, 14, 2, 7, 12, 4, 6, 16, 10, 8, 3),
                  group_size=1):
  """One GRPO group per prompt length; members of a group share one prompt array."""
  requests = []
  for group_id, length in enumerate(prompt_lengths):
    prompt = _prompt(length, group_id)
    for index in range(group_size):
      sample = Sample(prompt_id=group_id, group_id=group_id, group_size=group_size,
                      prompt_tokens=prompt, meta={"index_in_group": index})
      requests.append(GenerationRequest(sample, sample_key(SEED, group_id, index)))
  return requests


def by_uid(samples):
  return {s.uid: s for s in samples}


def full_logprobs(logprob_fn, params, sample):
  """The learner's logprobs of the sample's response tokens (a full forward, no cache)."""
  tokens = np.concatenate([sample.prompt_tokens, sample.response_tokens])[None]
  padded = np.zeros((1, CONFIG.max_seq_len), np.int32)  # one shape: one compile
  padded[:, :tokens.shape[1]] = tokens
  logp = np.asarray(logprob_fn(params, jnp.asarray(padded)))[0]
  start = len(sample.prompt_tokens)
  return logp[start:start + sample.num_response_tokens]


# ---- sample keys --------------------------------------------------------------------------------
def test_sample_key_is_a_function_of_seed_group_and_member():
  key = sample_key(0, 3, 1)
  assert key.dtype == np.uint32 and key.shape == (2,)
  np.testing.assert_array_equal(key, sample_key(0, 3, 1))
  others = [sample_key(1, 3, 1), sample_key(0, 4, 1), sample_key(0, 3, 0)]
  assert all(not np.array_equal(key, other) for other in others)


def test_sample_keys_are_fold_ins_of_seed_group_and_member():
  for seed, group_id in [(0, 0), (5, 123_456), (1_000_003, 255)]:
    group_key = jax.random.fold_in(jax.random.PRNGKey(seed), group_id)
    want = np.stack([np.asarray(jax.random.fold_in(group_key, m), np.uint32) for m in (0, 2, 7)])
    np.testing.assert_array_equal(sample_keys(seed, group_id, [0, 2, 7]), want)
    np.testing.assert_array_equal(sample_key(seed, group_id, 2), want[1])


# ---- continuous batching == solo decoding ------------------------------------------------------
def _mixed_requests():
  """13 single prompts of lengths 2..16 and two GRPO groups of 3 (one prefill per group)."""
  groups = make_requests((5, 11), group_size=3)
  for request in groups:  # group ids past the single prompts' keep uids distinct
    request.sample.group_id += 100
    request.key = sample_key(SEED, request.sample.group_id, request.sample.meta["index_in_group"])
  return make_requests(group_size=1) + groups


def test_continuous_batching_equals_solo_decoding(model, engine, logprob_fn):
  _, params, _ = model
  requests = _mixed_requests()
  assert len(requests) > 4 * SLOTS
  batcher = ContinuousBatcher(engine, eos_id=EOS, max_response_len=MAX_RESPONSE,
                              clock=lambda: 5.0)
  batcher.set_params(params, 0)
  batched = batcher.run_to_completion(requests)
  assert batcher.idle and batcher.num_active == 0 and batcher.num_pending == 0

  # No sample lost or duplicated, and slots were refilled many times.
  uids = [s.uid for s in batched]
  assert len(uids) == len(set(uids)) == len(requests)
  lengths = [s.num_response_tokens for s in batched]
  assert len(set(lengths)) > 2, lengths  # varied lengths: slots free up at different steps
  assert {s.finish_reason for s in batched} == {"eos", "length"}
  assert batcher.tokens_generated == sum(lengths)
  assert batcher.slot_steps % SLOTS == 0 and batcher.slot_steps >= sum(lengths)

  batched = by_uid(batched)
  for request in _mixed_requests():
    solo = ContinuousBatcher(engine, eos_id=EOS, max_response_len=MAX_RESPONSE)
    solo.set_params(params, 0)
    [alone] = solo.run_to_completion([request])
    together = batched[alone.uid]
    np.testing.assert_array_equal(together.response_tokens, alone.response_tokens)
    np.testing.assert_allclose(together.behaviour_logprobs, alone.behaviour_logprobs, atol=1e-5)
    assert together.finish_reason == alone.finish_reason
    np.testing.assert_array_equal(together.token_versions, 0)
    assert together.timestamps["generated"] == 5.0
    # EOS ends a response; LENGTH means max_response_len tokens without EOS.
    if together.finish_reason == "eos":
      assert together.response_tokens[-1] == EOS and EOS not in together.response_tokens[:-1]
    else:
      assert together.num_response_tokens == MAX_RESPONSE and EOS not in together.response_tokens
  # The behaviour logprobs are the learner's (spot check on a few samples).
  for sample in list(batched.values())[:4]:
    np.testing.assert_allclose(sample.behaviour_logprobs,
                               full_logprobs(logprob_fn, params, sample), atol=1e-4)


def test_members_of_a_group_share_a_prefill_but_not_their_tokens(model, engine):
  _, params, _ = model
  shared = make_requests((6,), group_size=4)
  assert len({id(r.sample.prompt_tokens) for r in shared}) == 1
  copies = make_requests((6,), group_size=4)
  for request in copies:  # the same prompts, as separate arrays: one prefill each
    request.sample.prompt_tokens = request.sample.prompt_tokens.copy()
  outputs = []
  for requests in (shared, copies):
    batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
    batcher.set_params(params, 0)
    outputs.append(by_uid(batcher.run_to_completion(requests)))
  for uid, sample in outputs[0].items():
    np.testing.assert_array_equal(sample.response_tokens, outputs[1][uid].response_tokens)
  responses = {tuple(s.response_tokens.tolist()) for s in outputs[0].values()}
  assert len(responses) == 4  # each member draws with its own key


def test_steps_per_call_stops_at_eos_inside_a_call(model, engine):
  _, params, _ = model
  multi = Engine(model[0], CONFIG, max_concurrent_decodes=SLOTS, max_prefill_length=32,
                 steps_per_call=3)
  results = []
  for eng in (engine, multi):
    batcher = ContinuousBatcher(eng, eos_id=EOS, max_response_len=MAX_RESPONSE)
    batcher.set_params(params, 0)
    results.append(by_uid(batcher.run_to_completion(make_requests())))
  for uid, sample in results[0].items():
    np.testing.assert_array_equal(sample.response_tokens, results[1][uid].response_tokens)
    assert sample.finish_reason == results[1][uid].finish_reason
  assert any(s.finish_reason == "eos" and s.num_response_tokens % 3 for s in results[1].values())


# ---- weight swaps ------------------------------------------------------------------------------
def _cache_sizes(engine):
  return {name: getattr(engine, name)._cache_size()
          for name in ("_generate", "_prefill", "_insert", "_insert_many", "_prefill_insert")}


def test_after_warm_up_nothing_compiles_during_generation(model):
  """`Engine.warm_up` runs every program a rollout meets at every bucket: admissions of groups
  of any size, swaps with samples in flight ('reprefill') and decoding then compile nothing."""
  graphdef, params, new_params = model
  engine = Engine(graphdef, CONFIG, max_concurrent_decodes=SLOTS, max_prefill_length=32)
  engine.warm_up(params, engine.init_decode_state())
  sizes = _cache_sizes(engine)
  assert sizes == {"_generate": 1, "_prefill": len(engine.buckets), "_insert": 0,
                   "_insert_many": len(engine.buckets),
                   "_prefill_insert": len(engine.buckets)}
  batcher = ContinuousBatcher(engine, eos_id=EOS, max_response_len=MAX_RESPONSE)
  batcher.set_params(params, 0)
  batcher.submit(make_requests(group_size=3))
  for version in range(1, 4):
    for _ in range(3):
      batcher.step()
    batcher.set_params((params, new_params)[version % 2], version,
                       partial_strategy="reprefill")
  while not batcher.idle:
    batcher.step()
  assert _cache_sizes(engine) == sizes


def test_weight_swap_does_not_recompile(model, engine):
  _, params, new_params = model
  assert hasattr(engine._generate, "_cache_size")
  batcher = ContinuousBatcher(engine, eos_id=EOS, max_response_len=MAX_RESPONSE)
  batcher.set_params(params, 0)
  before = by_uid(batcher.run_to_completion(make_requests()))  # warm-up: every bucket used
  sizes = _cache_sizes(engine)
  assert sizes["_generate"] == 1

  batcher.set_params(new_params, 1)  # idle: no strategy needed
  after = by_uid(batcher.run_to_completion(make_requests()))
  assert _cache_sizes(engine) == sizes
  assert all(np.all(s.token_versions == 1) for s in after.values())
  assert any(not np.array_equal(before[u].response_tokens, after[u].response_tokens)
             for u in before)  # the new weights are really used

  batcher.submit(make_requests())
  for _ in range(3):
    batcher.step()
  assert batcher.set_params(params, 2, partial_strategy="keep_kv") == SLOTS
  while not batcher.idle:
    batcher.step()
  assert _cache_sizes(engine) == sizes


# ---- partial rollouts ----------------------------------------------------------------------------
SWAP_AT = 4


def _run_with_swap(engine, params, new_params, strategy, prompt_lengths=(5, 9, 3)):
  """Three samples: SWAP_AT tokens under version 0, then a swap to version 1, then the rest."""
  batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  batcher.set_params(params, 0)
  batcher.submit(make_requests(prompt_lengths))
  finished = []
  for _ in range(SWAP_AT):
    finished += batcher.step()
  assert not finished and batcher.num_active == len(prompt_lengths)
  if strategy is not None:
    assert batcher.set_params(new_params, 1, partial_strategy=strategy) == len(prompt_lengths)
  while not batcher.idle:
    finished += batcher.step()
  return by_uid(finished)


@pytest.fixture(scope="module")
def unswapped(model, engine):
  return _run_with_swap(engine, model[1], model[2], None)


@pytest.mark.parametrize("strategy", ["reprefill", "keep_kv"])
def test_partial_rollout_versions_switch_at_the_interruption(model, engine, logprob_fn,
                                                              unswapped, strategy):
  _, params, new_params = model
  swapped = _run_with_swap(engine, params, new_params, strategy)
  expected_versions = [0] * SWAP_AT + [1] * (MAX_RESPONSE - SWAP_AT)
  for uid, sample in swapped.items():
    np.testing.assert_array_equal(sample.token_versions, expected_versions)
    assert sample.interruptions == 1 and sample.is_partial and sample.version_span == 1
    assert sample.finish_reason == "length"
    # Up to the swap, nothing differs from a run without a swap.
    np.testing.assert_array_equal(sample.response_tokens[:SWAP_AT],
                                  unswapped[uid].response_tokens[:SWAP_AT])
    old = full_logprobs(logprob_fn, params, sample)
    new = full_logprobs(logprob_fn, new_params, sample)
    np.testing.assert_allclose(sample.behaviour_logprobs[:SWAP_AT], old[:SWAP_AT], atol=1e-4)
    after_swap = np.abs(sample.behaviour_logprobs[SWAP_AT:] - new[SWAP_AT:])
    if strategy == "reprefill":  # the whole prefix is recomputed under the new weights
      assert after_swap.max() <= 1e-4, after_swap
    else:  # keep_kv attends to keys and values computed by the old weights
      assert after_swap.max() > 1e-3, after_swap
  assert any(not np.array_equal(s.response_tokens, unswapped[u].response_tokens)
             for u, s in swapped.items())


def test_each_version_is_stamped_with_the_call_that_drew_its_first_token(model, engine):
  _, params, new_params = model
  ticks = iter(range(100, 1000))  # the batcher reads its clock once per step, then at finishes
  batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE,
                              clock=lambda: float(next(ticks)))
  batcher.set_params(params, 0)
  batcher.submit(make_requests((5, 9)))
  calls = []
  for _ in range(SWAP_AT):
    before = next(ticks)  # the step's clock read comes right after this one
    batcher.step()
    calls.append(before + 1)
  batcher.set_params(new_params, 1, partial_strategy="keep_kv")
  before = next(ticks)
  finished = batcher.step()
  first_under_1 = before + 1
  while not batcher.idle:
    finished += batcher.step()
  assert len(finished) == 2
  for sample in finished:  # both started in the first call and ran on after the swap
    assert sample.versions_began() == {0: calls[0], 1: first_under_1}
    assert sample.timestamps["generated"] > first_under_1


def test_reprefill_is_one_prefill_call_per_bucket_not_per_sample(model, engine, monkeypatch):
  """Four in-flight samples in two prefill buckets: two batched prefill calls at the swap, no
  single prefill, and the same tokens and logprobs (bit for bit) as one prefill each."""
  _, params, new_params = model
  lengths = (3, 5, 9, 12)  # + SWAP_AT tokens: buckets 8, 16, 16, 16
  batched = _run_with_swap(engine, params, new_params, "reprefill", lengths)
  calls = []
  monkeypatch.setattr(engine, "prefill", lambda **kw: calls.append("prefill") or
                      Engine.prefill(engine, **kw))
  monkeypatch.setattr(engine, "prefill_insert", lambda **kw: calls.append(
      len(kw["sequences"])) or Engine.prefill_insert(engine, **kw))

  batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  batcher.set_params(params, 0)
  batcher.submit(make_requests(lengths))
  for _ in range(SWAP_AT):
    batcher.step()
  calls.clear()
  batcher.set_params(new_params, 1, partial_strategy="reprefill")
  assert sorted(calls) == [1, 3]  # one call per bucket, every in-flight sample in one of them
  # One prefill and insert per sample (what a swap did before) draws the same numbers.
  single = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  single.set_params(params, 0)
  single.submit(make_requests(lengths))
  for _ in range(SWAP_AT):
    single.step()
  single.set_params(new_params, 1, partial_strategy="keep_kv")
  for i, slot in enumerate(single._slots):
    sequence = np.concatenate([slot.request.sample.prompt_tokens, slot.tokens]).astype(np.int32)
    prefix = Engine.prefill(engine, params=new_params,
                            padded_tokens=engine.pad_to_bucket(sequence),
                            true_length=len(sequence))
    single._state = engine.insert(prefix, single._state, i, rng=slot.request.key,
                                  num_generated=len(slot.tokens))
  finished = []
  while not single.idle:
    finished += single.step()
  for uid, sample in by_uid(finished).items():
    np.testing.assert_array_equal(sample.response_tokens, batched[uid].response_tokens)
    np.testing.assert_array_equal(sample.behaviour_logprobs, batched[uid].behaviour_logprobs)


def test_reprefill_equals_resuming_a_submitted_partial_sample(model, engine):
  _, params, new_params = model
  swapped = _run_with_swap(engine, params, new_params, "reprefill")
  batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  batcher.set_params(new_params, 1)
  requests = make_requests((5, 9, 3))
  for request in requests:
    done = swapped[request.sample.uid]
    request.sample.response_tokens = done.response_tokens[:SWAP_AT]
    request.sample.behaviour_logprobs = done.behaviour_logprobs[:SWAP_AT]
    request.sample.token_versions = done.token_versions[:SWAP_AT]
  resumed = by_uid(batcher.run_to_completion(requests))
  for uid, sample in resumed.items():
    np.testing.assert_array_equal(sample.response_tokens, swapped[uid].response_tokens)
    np.testing.assert_allclose(sample.behaviour_logprobs, swapped[uid].behaviour_logprobs,
                               atol=1e-5)
    np.testing.assert_array_equal(sample.token_versions, swapped[uid].token_versions)


def test_set_params_with_samples_in_flight_needs_a_strategy(model, engine):
  _, params, new_params = model
  batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  with pytest.raises(RuntimeError, match="set_params must be called before step"):
    batcher.step()
  batcher.set_params(params, 0)
  batcher.submit(make_requests((4, 6)))
  batcher.step()
  with pytest.raises(RuntimeError, match="2 samples in flight"):
    batcher.set_params(new_params, 1)
  with pytest.raises(ValueError, match=r"partial_strategy must be one of.*'drop'"):
    batcher.set_params(new_params, 1, partial_strategy="drop")
  assert batcher.version == 0
  aborted = batcher.abort_active()
  assert len(aborted) == 2 and batcher.idle
  assert all(s.finish_reason == "aborted" and s.num_response_tokens == 1 for s in aborted)
  assert batcher.set_params(new_params, 1) == 0


def test_take_pending_and_step_without_admission(model, engine):
  _, params, _ = model
  batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  batcher.set_params(params, 0)
  requests = make_requests((3, 4, 5, 6, 7, 8))
  batcher.submit(requests)
  assert batcher.num_pending == 6 and not batcher.idle
  assert batcher.step(admit=False) == [] and batcher.num_active == 0
  batcher.step()
  assert batcher.num_active == SLOTS and batcher.num_pending == 2
  taken = batcher.take_pending()
  assert [r.sample.uid for r in taken] == [r.sample.uid for r in requests[SLOTS:]]
  assert batcher.num_pending == 0


def test_run_to_completion_step_limit(model, engine):
  batcher = ContinuousBatcher(engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  batcher.set_params(model[1], 0)
  with pytest.raises(RuntimeError, match="did not finish within 3 steps"):
    batcher.run_to_completion(make_requests((4,)), max_steps=3)


# ---- input errors ------------------------------------------------------------------------------
def test_prompt_longer_than_the_cache_is_rejected_at_submit(engine):
  batcher = ContinuousBatcher(engine, eos_id=EOS, max_response_len=MAX_RESPONSE)
  too_long = make_requests((23,))  # 23 + 10 > 32
  with pytest.raises(ValueError, match=r"prompt of 23 tokens \+ max_response_len=10 exceeds "
                                       r"the cache length 32"):
    batcher.submit(too_long)
  assert batcher.num_pending == 0
  batcher.submit(make_requests((22,)))  # exactly fills the cache
  assert batcher.num_pending == 1
  with pytest.raises(ValueError, match="max_response_len must be >= 1, got 0"):
    ContinuousBatcher(engine, eos_id=EOS, max_response_len=0)


@pytest.fixture(scope="module")
def short_prefill_engine(model):
  """A cache of 32 but prefills of at most 8 tokens."""
  return Engine(model[0], CONFIG, max_concurrent_decodes=2, max_prefill_length=8)


def test_prompt_longer_than_max_prefill_length_is_rejected_at_submit(short_prefill_engine):
  batcher = ContinuousBatcher(short_prefill_engine, eos_id=EOS, max_response_len=MAX_RESPONSE)
  with pytest.raises(ValueError, match="max_prefill_length"):
    batcher.submit(make_requests((12,)))  # 12 + 10 <= 32 fits the cache, 12 > 8 does not


def test_reprefill_of_a_partial_longer_than_max_prefill_length(model, short_prefill_engine):
  _, params, new_params = model
  batcher = ContinuousBatcher(short_prefill_engine, eos_id=NEVER, max_response_len=MAX_RESPONSE)
  batcher.set_params(params, 0)
  batcher.submit(make_requests((6,)))
  for _ in range(SWAP_AT):
    batcher.step()
  # 6 + SWAP_AT tokens exceed the prefill limit of 8: a clear error, and nothing changed.
  with pytest.raises(ValueError, match="'reprefill' needs prompt \\+ partial response"):
    batcher.set_params(new_params, 1, partial_strategy="reprefill")
  assert batcher.version == 0 and batcher.num_active == 1
  [sample] = batcher.run_to_completion([])
  assert sample.interruptions == 0
  np.testing.assert_array_equal(sample.token_versions, [0] * MAX_RESPONSE)


# ---- evaluate ----------------------------------------------------------------------------------
class _ParityTask:
  """Reward 1 when the response has an even number of tokens (some are, some are not)."""

  def reward(self, prompt_tokens, response_tokens, meta):
    assert meta["digits"] == "x"
    return 1.0 if len(response_tokens) % 2 == 0 else 0.0


def test_evaluate_is_deterministic_and_matches_a_manual_run(model, engine):
  _, params, _ = model
  problems = [Problem(prompt_id=i, prompt_tokens=_prompt(3 + i % 7, i), meta={"digits": "x"})
              for i in range(10)]
  batcher = ContinuousBatcher(engine, eos_id=EOS, max_response_len=MAX_RESPONSE)
  batcher.set_params(params, 0)
  first = evaluate(batcher, _ParityTask(), problems, seed=3)
  second = evaluate(batcher, _ParityTask(), problems, seed=3)
  assert first == second
  manual = ContinuousBatcher(engine, eos_id=EOS, max_response_len=MAX_RESPONSE)
  manual.set_params(params, 0)
  requests = [GenerationRequest(Sample(prompt_id=p.prompt_id, group_id=i, group_size=1,
                                       prompt_tokens=p.prompt_tokens),
                                sample_key(3 + EVAL_SEED_OFFSET, i, 0))
              for i, p in enumerate(problems)]
  lengths = np.asarray([s.num_response_tokens for s in manual.run_to_completion(requests)])
  even = np.mean(lengths % 2 == 0)
  assert 0 < even < 1
  assert first["eval/accuracy"] == first["eval/reward_mean"] == pytest.approx(even)
  assert first["eval/response_len_mean"] == pytest.approx(lengths.mean())
  assert first["eval/response_len_p50"] == pytest.approx(np.percentile(lengths, 50))
  assert first["eval/num_problems"] == 10.0
