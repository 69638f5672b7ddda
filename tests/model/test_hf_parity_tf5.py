"""Our decoder against transformers 5 on tests/fixtures/hf/qwen2-tf5 (made by
tools/make_hf_fixtures.py --rope-fixture): a tiny random Qwen2 whose config.json transformers 5
wrote, RoPE theta 1e6 inside `rope_parameters` and no top-level rope_theta, with the logits
transformers computed for its own RoPE and for linear, llama3 and YaRN variants on the same
weights. No torch here: the references are recorded files."""

import functools
import json
import pathlib

import jax
import numpy as np
import pytest

from jaxrl_async.model import abstract_params, apply, weights
from jaxrl_async.model.hf_config import config_from_hf, read_hf_config

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "qwen2-tf5"
REFERENCE = json.loads((FIXTURE / "reference.json").read_text())
RECORDED = np.load(FIXTURE / "reference_logits.npz")
VARIANTS = ["default", *REFERENCE["variants"]]


@functools.cache
def _forward(rope_json: str | None):
  hf = read_hf_config(FIXTURE)
  if rope_json is not None:
    hf["rope_parameters"] = json.loads(rope_json)
  config = config_from_hf(hf, max_seq_len=max(len(p) for p in REFERENCE["prompts"]))
  graphdef, _, _ = abstract_params(config)
  params = weights.load_params(FIXTURE, config)
  return config, jax.jit(functools.partial(apply, graphdef)), params


def _logits(rope: dict | None, prompt) -> np.ndarray:
  _, forward, params = _forward(None if rope is None else json.dumps(rope, sort_keys=True))
  logits, _ = forward(params, np.asarray([prompt], np.int32))
  return np.asarray(logits[0])


def test_the_fixture_is_in_the_5x_layout_with_theta_1e6():
  hf = read_hf_config(FIXTURE)
  assert hf["transformers_version"].split(".")[0] == "5"
  assert "rope_theta" not in hf and "rope_scaling" not in hf
  assert hf["rope_parameters"] == {"rope_theta": 1_000_000.0, "rope_type": "default"}
  config, _, _ = _forward(None)
  assert config.rope_theta == 1_000_000.0 and config.rope_scaling is None
  assert config.qkv_bias and config.tie_embeddings


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers_5(variant):
  rope = None if variant == "default" else REFERENCE["variants"][variant]
  for i, prompt in enumerate(REFERENCE["prompts"]):
    expected = RECORDED[f"{variant}_{i}"]
    logits = _logits(rope, prompt)
    assert logits.shape == expected.shape == (len(prompt), 128)
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=1e-5, err_msg=f"prompt {i}")


def test_reading_theta_as_the_4x_default_would_be_far_off():
  """What a reader of top-level keys only gets: theta 10000 instead of 1e6."""
  prompt = REFERENCE["prompts"][1]
  wrong = _logits({"rope_type": "default", "rope_theta": 10_000.0}, prompt)
  assert np.abs(wrong - RECORDED["default_1"]).max() > 1.0
