"""Our decoder against transformers 5 on tests/fixtures/hf/{llama,qwen2,qwen3}-tf5 (made by
tools/make_hf_fixtures.py --tf5-fixtures): tiny random models whose config.json transformers 5
wrote (RoPE inside `rope_parameters`, no top-level rope_theta; llama with llama3 scaling and an
untied head, qwen2 with q/k/v biases, qwen3 with q/k norms and head_dim 32), with the logits and
20-token greedy continuations transformers computed for two prompts of token ids, and for qwen2
the logits of linear, llama3 and YaRN variants of its RoPE on the same weights. No torch here:
the references are recorded files."""

import functools
import json
import pathlib

import jax
import numpy as np
import pytest

from jaxrl_async.model import abstract_params, apply, weights
from jaxrl_async.model.config import RopeScaling
from jaxrl_async.model.hf_config import config_from_hf, read_hf_config
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_key
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.types import Sample

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf"
NAMES = ("llama-tf5", "qwen2-tf5", "qwen3-tf5")
VARIANT_FIXTURE = "qwen2-tf5"  # the one with RoPE variants recorded
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500_000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}
ATOL = 1e-4
# transformers computes the llama3-scaled frequencies in float32, we in float64: they differ by
# up to one float32 ulp, which this model's 128-token prompt turns into 2.1e-4 (with the float64
# frequencies in transformers, the two agree within 6e-5).
VARIANT_ATOL = {"llama3": 3e-4}


@functools.cache
def _reference(name):
  return json.loads((FIXTURES / name / "reference.json").read_text())


@functools.cache
def _recorded(name):
  return dict(np.load(FIXTURES / name / "reference_logits.npz"))


def _cache_length(name) -> int:
  return max(len(p["token_ids"]) + len(p["greedy"]) for p in _reference(name)["prompts"])


@functools.cache
def _forward(name, rope_json: str | None = None):
  hf = read_hf_config(FIXTURES / name)
  if rope_json is not None:
    hf["rope_parameters"] = json.loads(rope_json)
  config = config_from_hf(hf, max_seq_len=_cache_length(name))
  graphdef, _, _ = abstract_params(config)
  params = weights.load_params(FIXTURES / name, config)
  return config, graphdef, jax.jit(functools.partial(apply, graphdef)), params


def _logits(name, prompt, rope: dict | None = None) -> np.ndarray:
  _, _, forward, params = _forward(name, None if rope is None else json.dumps(rope,
                                                                                sort_keys=True))
  logits, _ = forward(params, np.asarray([prompt], np.int32))
  return np.asarray(logits[0])


def test_the_fixtures_are_in_the_5x_layout():
  expected_rope = {"llama-tf5": LLAMA3_ROPE, "qwen2-tf5": DEFAULT_ROPE,
                   "qwen3-tf5": DEFAULT_ROPE}
  for name in NAMES:
    hf = read_hf_config(FIXTURES / name)
    assert hf["transformers_version"].split(".")[0] == "5", name
    assert "rope_theta" not in hf and "rope_scaling" not in hf, name
    assert hf["rope_parameters"] == expected_rope[name], name
    assert not (FIXTURES / name / "tokenizer.json").exists()
  llama, _, _, _ = _forward("llama-tf5")
  assert llama.rope_theta == 500_000.0 and not llama.tie_embeddings
  assert llama.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0,
                                           original_max_position_embeddings=64)
  qwen2, _, _, _ = _forward("qwen2-tf5")
  assert qwen2.rope_theta == 1_000_000.0 and qwen2.rope_scaling is None
  assert qwen2.qkv_bias and qwen2.tie_embeddings
  qwen3, _, _, _ = _forward("qwen3-tf5")
  assert qwen3.rope_theta == 1_000_000.0 and qwen3.rope_scaling is None
  assert qwen3.qk_norm and qwen3.tie_embeddings and not qwen3.qkv_bias
  assert qwen3.resolved_head_dim == 32 != qwen3.d_model // qwen3.n_heads


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers_5(name):
  vocab_size = read_hf_config(FIXTURES / name)["vocab_size"]
  for i, prompt in enumerate(_reference(name)["prompts"]):
    expected = _recorded(name)[f"default_{i}"]
    logits = _logits(name, prompt["token_ids"])
    assert logits.shape == expected.shape == (len(prompt["token_ids"]), vocab_size)
    np.testing.assert_allclose(logits, expected, atol=ATOL, rtol=1e-5, err_msg=f"prompt {i}")


@pytest.mark.parametrize("variant", sorted(_reference(VARIANT_FIXTURE)["variants"]))
def test_rope_variant_logits_match_transformers_5(variant):
  rope = _reference(VARIANT_FIXTURE)["variants"][variant]
  for i, prompt in enumerate(_reference(VARIANT_FIXTURE)["prompts"]):
    expected = _recorded(VARIANT_FIXTURE)[f"{variant}_{i}"]
    logits = _logits(VARIANT_FIXTURE, prompt["token_ids"], rope)
    np.testing.assert_allclose(logits, expected, atol=VARIANT_ATOL.get(variant, ATOL), rtol=1e-5,
                               err_msg=f"prompt {i}")


def test_reading_theta_as_the_4x_default_would_be_far_off():
  """What a reader of top-level keys only gets: theta 10000 instead of 1e6."""
  prompt = _reference(VARIANT_FIXTURE)["prompts"][1]["token_ids"]
  wrong = _logits(VARIANT_FIXTURE, prompt, {"rope_type": "default", "rope_theta": 10_000.0})
  assert np.abs(wrong - _recorded(VARIANT_FIXTURE)["default_1"]).max() > 1.0


@pytest.mark.parametrize("name", NAMES)
def test_engine_greedy_tokens_match_transformers_5(name):
  """Both prompts through a 1-slot engine (the second waits for the slot), decoding on the KV
  cache. No end token: exactly 20 tokens each, as transformers' recording."""
  config, graphdef, _, params = _forward(name)
  prompts = _reference(name)["prompts"]
  engine = Engine(graphdef, config, max_concurrent_decodes=1,
                  max_prefill_length=max(len(p["token_ids"]) for p in prompts),
                  sampling=SamplingConfig(temperature=0.0), cache_length=_cache_length(name))
  batcher = ContinuousBatcher(engine, eos_id=-1, max_response_len=len(prompts[0]["greedy"]))
  batcher.set_params(params, 0)
  requests = [GenerationRequest(Sample(prompt_id=i, group_id=i, group_size=1,
                                       prompt_tokens=p["token_ids"]), sample_key(0, i, 0))
              for i, p in enumerate(prompts)]
  samples = sorted(batcher.run_to_completion(requests), key=lambda s: s.prompt_id)
  assert len(samples) == len(prompts) == 2
  for prompt, sample in zip(prompts, samples):
    assert len(prompt["greedy"]) == 20 and prompt["greedy_min_margin"] > 0.05
    assert sample.response_tokens.tolist() == prompt["greedy"]
