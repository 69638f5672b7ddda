"""ContinuousBatcher stop ids: a sample finishes at the first of eos_id and stop_ids it draws
(finish reason 'eos', the token kept), the rest run to max_response_len ('length'), and the
tokens drawn before the stop are those of a run without stop ids."""

import numpy as np
import pytest

from jaxrl_async.model import get_config, init_model, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_key
from jaxrl_async.types import FinishReason, Sample

CONFIG = get_config("tiny", max_seq_len=32)
MAX_RESPONSE = 12
NEVER = -1


@pytest.fixture(scope="module")
def model():
  return split_model(init_model(CONFIG, seed=0))


@pytest.fixture(scope="module", params=[1, 3], ids=["1_step", "3_steps"])
def engine(model, request):
  return Engine(model[0], CONFIG, max_concurrent_decodes=3, max_prefill_length=16,
                steps_per_call=request.param)


def _requests(n=6):
  requests = []
  for g in range(n):
    prompt = np.asarray([1, 5 + g, 6, 7 + g % 3, 4], np.int32)
    sample = Sample(prompt_id=g, group_id=g, group_size=1, prompt_tokens=prompt,
                    meta={"index_in_group": 0})
    requests.append(GenerationRequest(sample, sample_key(3, g, 0)))
  return requests


def _run(engine, params, **kwargs):
  batcher = ContinuousBatcher(engine, max_response_len=MAX_RESPONSE, **kwargs)
  batcher.set_params(params, 0)
  return {s.group_id: s for s in batcher.run_to_completion(_requests())}


def test_a_sample_finishes_at_the_first_stop_id(engine, model):
  free = _run(engine, model[1], eos_id=NEVER)
  assert all(s.finish_reason == FinishReason.LENGTH.value for s in free.values())
  # Stop ids drawn mid-response by some samples (not by all: some must still hit the length).
  counts = {}
  for s in free.values():
    for t in set(s.response_tokens[1:-1].tolist()):
      counts[t] = counts.get(t, 0) + 1
  eos, extra = sorted(counts, key=lambda t: (-counts[t], t))[:2]
  stops = {eos, extra}
  stopped = _run(engine, model[1], eos_id=eos, stop_ids=(extra,))
  assert set(stopped) == set(free)
  reasons = set()
  for g, s in stopped.items():
    full = free[g].response_tokens.tolist()
    first = next((i for i, t in enumerate(full) if t in stops), None)
    n = MAX_RESPONSE if first is None else first + 1
    assert s.response_tokens.tolist() == full[:n]
    np.testing.assert_allclose(s.behaviour_logprobs, free[g].behaviour_logprobs[:n], atol=1e-6)
    assert len(s.token_versions) == n == s.num_response_tokens
    expected = FinishReason.LENGTH if first is None else FinishReason.EOS
    assert s.finish_reason == expected.value
    reasons.add(s.finish_reason)
  assert FinishReason.EOS.value in reasons


def test_stop_ids_alone_without_an_eos_id(engine, model):
  free = _run(engine, model[1], eos_id=NEVER)
  stop = int(free[0].response_tokens[2])
  stopped = _run(engine, model[1], eos_id=NEVER, stop_ids=[stop])
  first = free[0].response_tokens.tolist().index(stop)
  assert stopped[0].response_tokens.tolist() == free[0].response_tokens[:first + 1].tolist()
  assert stopped[0].finish_reason == FinishReason.EOS.value


def test_a_stop_id_as_the_last_allowed_token_counts_as_eos(engine, model):
  free = _run(engine, model[1], eos_id=NEVER)
  for g, s in free.items():
    last = int(s.response_tokens[-1])
    if last not in s.response_tokens[:-1].tolist():
      stopped = _run(engine, model[1], eos_id=NEVER, stop_ids=(last,))
      assert stopped[g].num_response_tokens == MAX_RESPONSE
      assert stopped[g].finish_reason == FinishReason.EOS.value
      return
  pytest.fail("no sample drew a fresh token last")


@pytest.mark.parametrize("kwargs", [{"eos_id": -2}, {"eos_id": 2, "stop_ids": (1.5,)},
                                    {"eos_id": 2, "stop_ids": (True,)},
                                    {"eos_id": 2, "stop_ids": (-1,)}])
def test_bad_stop_ids_are_rejected(model, kwargs):
  engine = Engine(model[0], CONFIG, max_concurrent_decodes=1, max_prefill_length=8)
  with pytest.raises(ValueError, match="stop ids must be ints >= 0"):
    ContinuousBatcher(engine, max_response_len=4, **kwargs)


def test_a_task_batcher_stops_at_its_tokenizers_stop_ids(engine):
  from types import SimpleNamespace

  from jaxrl_async.rollout.generation import task_batcher
  hf_like = SimpleNamespace(eos_id=2, stop_ids=(2, 9, 11))
  batcher = task_batcher(engine, SimpleNamespace(tokenizer=hf_like, max_response_len=7))
  assert batcher.stop_ids == frozenset({2, 9, 11})
  builtin = SimpleNamespace(eos_id=3)  # the built-in tokenizer names no extra stop ids
  assert task_batcher(engine, SimpleNamespace(tokenizer=builtin, max_response_len=7)
                      ).stop_ids == frozenset({3})
