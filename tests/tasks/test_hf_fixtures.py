"""HFTokenizer against what transformers recorded for the tiny Llama, Qwen2 and Qwen3 fixtures
(tests/fixtures/hf/<family>/reference.json, made by tools/make_hf_fixtures.py): chat template
renderings, their token ids, plain encodings and the special token ids."""

import json
import pathlib

import pytest

from jaxrl_async.tasks.hf_tokenizer import HFTokenizer

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf"
FAMILIES = ("llama", "qwen2", "qwen3")


def _load(family):
  directory = FIXTURES / family
  with open(directory / "reference.json", encoding="utf-8") as f:
    return HFTokenizer.from_dir(directory), json.load(f)


@pytest.mark.parametrize("family", FAMILIES)
def test_special_token_ids_match_transformers(family):
  tokenizer, reference = _load(family)
  ids = reference["special_token_ids"]
  assert tokenizer.bos_id == ids["bos"] and tokenizer.eos_id == ids["eos"]
  # transformers leaves pad unset when the model names none; padding with eos is our fallback.
  assert tokenizer.pad_id == (ids["pad"] if ids["pad"] is not None else ids["eos"])


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_renderings_match_transformers(family):
  tokenizer, reference = _load(family)
  assert len(reference["chat"]) >= 4
  for case in reference["chat"]:
    text = tokenizer.apply_chat_template(case["messages"],
                                         add_generation_prompt=case["add_generation_prompt"],
                                         **case["kwargs"])
    assert text == case["text"]
    assert tokenizer.encode(text).tolist() == case["token_ids"]


@pytest.mark.parametrize("family", FAMILIES)
def test_encodings_match_transformers(family):
  tokenizer, reference = _load(family)
  assert reference["encode"]
  for case in reference["encode"]:
    assert tokenizer.encode(case["text"]).tolist() == case["token_ids"]
    assert tokenizer.decode(case["token_ids"]) == case["text"]
