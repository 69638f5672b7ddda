"""Our decoder against transformers, on the tiny random checkpoints of tests/fixtures/hf (made by
tools/make_hf_fixtures.py): logits, greedy decoding through the Engine, learner logprobs, and
the tokenizer's chat-template rendering. No torch here: the references are recorded files."""

import functools
import json
import pathlib

import jax
import numpy as np
import pytest

from jaxrl_async.learner import step as step_lib
from jaxrl_async.model import abstract_params, apply, weights
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_key
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.types import Sample

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf"
FAMILIES = ("llama", "qwen2", "qwen3")
CACHE_LENGTH = 64


@functools.cache
def _model(family):
  config = weights.load_config(FIXTURES / family, max_seq_len=CACHE_LENGTH)
  graphdef, _, _ = abstract_params(config)
  return config, graphdef, weights.load_params(FIXTURES / family, config)


def _reference(family):
  return json.loads((FIXTURES / family / "reference.json").read_text())


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family):
  _, graphdef, params = _model(family)
  recorded = np.load(FIXTURES / family / "reference_logits.npz")
  forward = jax.jit(functools.partial(apply, graphdef))
  for i, prompt in enumerate(_reference(family)["prompts"]):
    logits, _ = forward(params, np.asarray([prompt["token_ids"]], np.int32))
    expected = recorded[f"logits_{i}"]
    assert logits.shape[1:] == expected.shape
    np.testing.assert_allclose(np.asarray(logits[0]), expected, atol=1e-4, rtol=1e-5)


@functools.cache
def _greedy_through_the_engine(family):
  """Every prompt through a 2-slot engine at once: the third waits for a free slot (continuous
  batching), all decode on the KV cache. No end token: exactly 20 tokens each."""
  config, graphdef, params = _model(family)
  prompts = _reference(family)["prompts"]
  engine = Engine(graphdef, config, max_concurrent_decodes=2, max_prefill_length=40,
                  sampling=SamplingConfig(temperature=0.0), cache_length=CACHE_LENGTH)
  batcher = ContinuousBatcher(engine, eos_id=-1, max_response_len=len(prompts[0]["greedy"]))
  batcher.set_params(params, 0)
  requests = [GenerationRequest(Sample(prompt_id=i, group_id=i, group_size=1,
                                       prompt_tokens=p["token_ids"]), sample_key(0, i, 0))
              for i, p in enumerate(prompts)]
  samples = sorted(batcher.run_to_completion(requests), key=lambda s: s.prompt_id)
  return params, graphdef, prompts, samples


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_tokens_match_transformers(family):
  _, _, prompts, samples = _greedy_through_the_engine(family)
  assert len(samples) == len(prompts) == 3
  for prompt, sample in zip(prompts, samples):
    assert len(prompt["greedy"]) == 20 and prompt["greedy_min_margin"] > 0.01
    assert sample.response_tokens.tolist() == prompt["greedy"]


@pytest.mark.parametrize("family", FAMILIES)
def test_learner_logprobs_equal_the_engine_behaviour_logprobs(family):
  params, graphdef, _, samples = _greedy_through_the_engine(family)
  logprobs = step_lib.make_logprob_fn(graphdef, temperature=1.0)
  sequences = [np.concatenate([s.prompt_tokens, s.response_tokens]) for s in samples]
  for sample, sequence in zip(samples, sequences):  # one row per sample
    row = logprobs(params, sequence[None].astype(np.int32))[0]
    np.testing.assert_allclose(np.asarray(row[len(sample.prompt_tokens):]),
                               sample.behaviour_logprobs, atol=1e-4)
  # All three packed into one row (positions restart, segment ids keep samples apart).
  tokens = np.concatenate(sequences).astype(np.int32)[None]
  positions = np.concatenate([np.arange(len(s)) for s in sequences]).astype(np.int32)[None]
  segments = np.concatenate([np.full(len(s), i + 1) for i, s in enumerate(sequences)])
  packed = np.asarray(logprobs(params, tokens, positions, segments[None].astype(np.int32))[0])
  start = 0
  for sample, sequence in zip(samples, sequences):
    response = slice(start + len(sample.prompt_tokens), start + len(sequence))
    np.testing.assert_allclose(packed[response], sample.behaviour_logprobs, atol=1e-4)
    start += len(sequence)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_rendering_matches_transformers(family):
  pytest.importorskip("tokenizers")
  pytest.importorskip("jinja2")
  from jaxrl_async.tasks.hf_tokenizer import HFTokenizer

  tokenizer = HFTokenizer.from_dir(FIXTURES / family)
  reference = _reference(family)
  assert tokenizer.eos_id == reference["special_token_ids"]["eos"]
  for chat in reference["chat"]:
    text = tokenizer.apply_chat_template(chat["messages"],
                                         add_generation_prompt=chat["add_generation_prompt"],
                                         **chat["kwargs"])
    assert text == chat["text"]
    assert tokenizer.encode(text).tolist() == chat["token_ids"]
  for case in reference["encode"]:
    assert tokenizer.encode(case["text"]).tolist() == case["token_ids"]
