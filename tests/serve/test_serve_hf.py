"""Serving an imported Hugging Face model (the tiny checkpoints of tests/fixtures/hf): greedy
tokens streamed by the server equal transformers' own greedy decoding (recorded in the fixture's
reference.json), for prompts sent as token ids and as text."""

import concurrent.futures
import json
import pathlib

import grpc
import pytest

from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.serve import jetstream_pb2 as pb
from jaxrl_async.serve import jetstream_pb2_grpc as pb_grpc
from jaxrl_async.serve.client import decode
from jaxrl_async.serve.policy import policy_from_hf
from jaxrl_async.serve.server import PolicyServer
from launch import serve

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf"


# One family: the server adds nothing family-specific (tests/model/test_hf_parity.py checks the
# engine's greedy tokens on every family).
@pytest.mark.parametrize("family", ["llama"])
def test_served_greedy_tokens_equal_transformers(family):
  reference = json.loads((FIXTURES / family / "reference.json").read_text())
  prompts = reference["prompts"]
  policy = policy_from_hf(FIXTURES / family, max_seq_len=64, max_prompt_len=40)
  assert policy.max_response_len == 24
  eos = policy.eos_id
  with PolicyServer(policy, port=0, max_concurrent_decodes=2,
                    sampling=SamplingConfig(temperature=0.0)) as server, \
      grpc.insecure_channel(server.address) as channel:
    stub = pb_grpc.OrchestratorStub(channel)

    def by_tokens(prompt):
      return decode(stub, prompt["token_ids"], max_tokens=len(prompt["greedy"]), timeout_s=120)[0]

    def by_text(prompt):
      request = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=prompt["text"]),
                                 max_tokens=len(prompt["greedy"]))
      return [t for r in stub.Decode(request, timeout=120) for t in r.stream_content.samples[0].token_ids]

    with concurrent.futures.ThreadPoolExecutor(2 * len(prompts)) as pool:  # more than 2 slots
      token_results = list(pool.map(by_tokens, prompts, timeout=300))
      text_results = list(pool.map(by_text, prompts, timeout=300))
  for prompt, served, served_text in zip(prompts, token_results, text_results):
    greedy = prompt["greedy"]
    # The server stops at the end token; transformers' recording ran on past it.
    expected = greedy[:greedy.index(eos) + 1] if eos in greedy else greedy
    assert served == expected
    assert served_text == expected  # the text was tokenized as transformers did (bos first)


def test_hf_model_path_must_exist(tmp_path, capsys):
  assert serve.main(["--hf_model", str(tmp_path / "none"), "--port", "0"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("jaxrl-async serve: ") and "none" in err, err
