"""The JetStream-protocol server, driven by a stock gRPC client built from the proto: concurrent
streamed requests get the engine's own tokens for the same keys; bad requests get
INVALID_ARGUMENT naming the field; held-out evaluation through the server equals local
evaluation under greedy decoding."""

import concurrent.futures
import time

import grpc
import numpy as np
import pytest

from jaxrl_async import faults
from jaxrl_async.model import get_config, init_model, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.evaluate import evaluate
from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_keys
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.serve import jetstream_pb2 as pb
from jaxrl_async.serve import jetstream_pb2_grpc as pb_grpc
from jaxrl_async.serve.client import decode, evaluate_through_server
from jaxrl_async.serve.driver import prompt_key
from jaxrl_async.serve.server import Policy, PolicyServer
from jaxrl_async.tasks.reverse import DigitReverseTask
from jaxrl_async.types import Sample

TASK = DigitReverseTask(0, max_len=8)
SLOTS = 8
SEED = 7


def make_policy(seed=0):
  model_config = get_config("tiny", vocab_size=TASK.tokenizer.vocab_size,
                            max_seq_len=TASK.max_sequence_len)
  graphdef, params = split_model(init_model(model_config, seed=seed))
  return Policy(graphdef=graphdef, params=params, model_config=model_config,
                tokenizer=TASK.tokenizer, eos_id=TASK.tokenizer.eos_id,
                max_prefill_length=TASK.max_prompt_len, max_response_len=TASK.max_response_len,
                description="tiny test policy")


def engine_output(policy, sampling, prompts_and_samples):
  """The engine alone (no server): [(prompt, [tokens of each member])] for the same keys."""
  engine = Engine(policy.graphdef, policy.model_config, max_concurrent_decodes=SLOTS,
                  max_prefill_length=policy.max_prefill_length, sampling=sampling)
  batcher = ContinuousBatcher(engine, eos_id=policy.eos_id,
                              max_response_len=policy.max_response_len)
  batcher.set_params(policy.params, 0)
  requests = []
  for index, (prompt, num_samples) in enumerate(prompts_and_samples):
    prompt = np.asarray(prompt, np.int32)
    keys = sample_keys(SEED, prompt_key(prompt), list(range(num_samples)))
    for member, key in enumerate(keys):
      sample = Sample(prompt_id=index, group_id=index, group_size=num_samples,
                      prompt_tokens=prompt, meta={"index_in_group": member})
      requests.append(GenerationRequest(sample, key))
  outputs = [[None] * n for _, n in prompts_and_samples]
  for sample in batcher.run_to_completion(requests):
    outputs[sample.prompt_id][sample.meta["index_in_group"]] = sample.response_tokens.tolist()
  return outputs


@pytest.fixture(scope="module")
def policy():
  return make_policy()


@pytest.fixture(scope="module")
def sampled_server(policy):
  # One message per engine step (no merging), so the stream's shape is known exactly.
  with PolicyServer(policy, port=0, max_concurrent_decodes=SLOTS, seed=SEED,
                    sampling=SamplingConfig(temperature=1.0), merge_chunks=False) as server:
    yield server


@pytest.fixture(scope="module")
def greedy_server(policy):
  with PolicyServer(policy, port=0, max_concurrent_decodes=SLOTS, seed=SEED,
                    sampling=SamplingConfig(temperature=0.0)) as server:
    yield server


@pytest.fixture()
def stub(sampled_server):
  with grpc.insecure_channel(sampled_server.address) as channel:
    yield pb_grpc.OrchestratorStub(channel)


def test_binds_to_loopback(sampled_server, stub):
  assert sampled_server.address.startswith("127.0.0.1:")
  assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).is_live


def test_concurrent_streams_equal_the_engine(policy, stub):
  """More requests than slots (they queue), 1 to 3 samples each, some prompts repeated."""
  problems = [TASK.problem(i) for i in range(14)]
  jobs = [(p.prompt_tokens, 1 + i % 3) for i, p in enumerate(problems)]
  jobs += [(problems[0].prompt_tokens, 1), (problems[1].prompt_tokens, 2)]
  expected = engine_output(policy, SamplingConfig(temperature=1.0), jobs)

  def call(job):
    prompt, num_samples = job
    request = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(
        token_ids=prompt.tolist()), num_samples=num_samples)
    samples = [[] for _ in range(num_samples)]
    chunks = 0
    for response in stub.Decode(request, timeout=120):
      assert len(response.stream_content.samples) == num_samples
      chunks += 1
      for member, sample in enumerate(response.stream_content.samples):
        samples[member].extend(sample.token_ids)
        assert sample.text == TASK.tokenizer.decode(list(sample.token_ids), skip_special=True)
    # One message per engine step in which some sample drew a token: tokens arrive as drawn
    # (the members of a group may start in different steps when slots free up one by one).
    lengths = [len(tokens) for tokens in samples]
    assert max(lengths) <= chunks <= sum(lengths)
    if num_samples == 1:
      assert chunks == lengths[0]
    return samples

  with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
    got = list(pool.map(call, jobs, timeout=300))
  assert got == expected
  assert got[0] == got[-2] and got[1][:2] == got[-1]  # same prompt, same keys, same tokens
  assert max(len(tokens) for sample in got for tokens in sample) > 1


def test_max_tokens_is_a_prefix_of_the_full_response(policy, stub):
  prompt = TASK.problem(3).prompt_tokens
  full = decode(stub, prompt)[0]
  assert len(full) > 3
  assert decode(stub, prompt, max_tokens=3)[0] == full[:3]


def test_text_prompt_is_tokenized_with_bos(stub):
  problem = TASK.problem(5)
  by_tokens = decode(stub, problem.prompt_tokens)[0]
  request = pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(
      text=problem.meta["digits"] + "="))
  by_text = [t for r in stub.Decode(request, timeout=60) for t in r.stream_content.samples[0].token_ids]
  assert by_text == by_tokens


def _status(call):
  with pytest.raises(grpc.RpcError) as error:
    list(call())
  return error.value.code(), error.value.details()


@pytest.mark.parametrize("request_fields, named", [
    ({}, "text_content or token_content"),
    ({"token_content": pb.DecodeRequest.TokenContent(token_ids=[])}, "token_ids is empty"),
    ({"text_content": pb.DecodeRequest.TextContent(text="")}, "text is empty"),
    ({"text_content": pb.DecodeRequest.TextContent(text="12a=")}, "not in the vocabulary"),
    ({"token_content": pb.DecodeRequest.TokenContent(token_ids=[1] * 40)}, "max_prefill_length"),
    ({"token_content": pb.DecodeRequest.TokenContent(token_ids=[1, 99])}, "outside [0, 16)"),
    ({"token_content": pb.DecodeRequest.TokenContent(token_ids=[1, 5]), "max_tokens": -1},
     "max_tokens"),
    ({"token_content": pb.DecodeRequest.TokenContent(token_ids=[1, 5]), "max_tokens": 1000},
     "max_tokens"),
    ({"token_content": pb.DecodeRequest.TokenContent(token_ids=[1, 5]), "num_samples": 99},
     "num_samples"),
], ids=["no_prompt", "empty_tokens", "empty_text", "bad_text", "too_long", "bad_id",
        "negative_max_tokens", "huge_max_tokens", "too_many_samples"])
def test_bad_request_is_invalid_argument(stub, request_fields, named):
  code, details = _status(lambda: stub.Decode(pb.DecodeRequest(**request_fields), timeout=30))
  assert code == grpc.StatusCode.INVALID_ARGUMENT
  assert named in details, details


@pytest.mark.parametrize("extra", [b"\x48\x05", b"\x08\x01", b"\x32\x02\x10\x07"],
                         ids=["field_9", "reserved_field_1", "nested_unknown"])
def test_unknown_fields_are_invalid_argument(sampled_server, extra):
  valid = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(token_ids=[1, 5, 4]))
  with grpc.insecure_channel(sampled_server.address) as channel:
    raw = channel.unary_stream("/jetstream_proto.Orchestrator/Decode",
                               request_serializer=lambda payload: payload,
                               response_deserializer=pb.DecodeResponse.FromString)
    code, details = _status(lambda: raw(valid.SerializeToString() + extra, timeout=30))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "fields this server does not define" in details
    # The same bytes without the extra field are served.
    assert list(raw(valid.SerializeToString(), timeout=60))


def test_a_cancelled_stream_leaves_the_server_serving(stub):
  prompt = TASK.problem(9).prompt_tokens
  call = stub.Decode(pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(
      token_ids=prompt.tolist())), timeout=60)
  next(call)
  call.cancel()
  assert decode(stub, prompt)[0]
  assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).is_live


def test_a_cancelled_stream_frees_its_handler_at_once(policy):
  """A client that cancels mid-stream: the handler thread ends then, not at its stream timeout.
  (It used to wait the whole stream_timeout_s on a queue nothing would fill once the request's
  slots had run to their end, so stopping the server took that long.) The second engine step is
  held for 2 s, so the cancel lands while the request is still decoding."""
  faults.configure("rollout.decode_step=delay:2@2")
  server = PolicyServer(policy, port=0, max_concurrent_decodes=SLOTS, seed=SEED,
                        stream_timeout_s=300.0, merge_chunks=False).start()
  try:
    with grpc.insecure_channel(server.address) as channel:
      stub = pb_grpc.OrchestratorStub(channel)
      call = stub.Decode(pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(
          token_ids=TASK.problem(9).prompt_tokens.tolist())), timeout=60)
      next(call)
      call.cancel()
      # The cancelled request's slots run on to their end; once they have, nothing of the
      # driver's refers to the stream any more (stopping the driver would not wake it).
      deadline = time.monotonic() + 60.0
      time.sleep(2.5)
      while not server.driver.batcher.idle and time.monotonic() < deadline:
        time.sleep(0.05)
      assert server.driver.batcher.idle
  finally:
    faults.configure(None)
    began = time.monotonic()
    server.stop()  # waits for every handler thread to end
    stop_s = time.monotonic() - began
  assert stop_s < 60.0, f"stopping the server took {stop_s:.0f} s"


def test_evaluation_through_the_server_equals_local_evaluation(policy, greedy_server):
  """The greedy server merges queued chunks (the default): the joined tokens are the same."""
  problems = TASK.eval_set(24)
  engine = Engine(policy.graphdef, policy.model_config, max_concurrent_decodes=SLOTS,
                  max_prefill_length=policy.max_prefill_length,
                  sampling=SamplingConfig(temperature=0.0))
  batcher = ContinuousBatcher(engine, eos_id=policy.eos_id,
                              max_response_len=policy.max_response_len)
  batcher.set_params(policy.params, 0)
  local = evaluate(batcher, TASK, problems)
  with grpc.insecure_channel(greedy_server.address) as channel:
    served = evaluate_through_server(channel, TASK, problems, concurrency=12)
  for name in ("eval/accuracy", "eval/reward_mean", "eval/response_len_mean",
               "eval/num_problems"):
    assert served[name] == local[name], name


def test_a_failed_engine_step_ends_streams_with_unavailable(policy):
  """The engine fails at its first step: the stream in flight ends with UNAVAILABLE (not a hang),
  the health check says not live, and new requests are refused with UNAVAILABLE."""
  faults.configure("rollout.decode_step=raise@1")
  try:
    with PolicyServer(policy, port=0, max_concurrent_decodes=SLOTS, seed=SEED) as server, \
        grpc.insecure_channel(server.address) as channel:
      stub = pb_grpc.OrchestratorStub(channel)
      request = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(
          token_ids=TASK.problem(0).prompt_tokens.tolist()))
      code, details = _status(lambda: stub.Decode(request, timeout=60))
      assert code == grpc.StatusCode.UNAVAILABLE
      assert "FaultInjected" in details
      assert not stub.HealthCheck(pb.HealthCheckRequest(), timeout=30).is_live
      assert _status(lambda: stub.Decode(request, timeout=60))[0] == grpc.StatusCode.UNAVAILABLE
      assert isinstance(server.driver.error, faults.FaultInjected)
  finally:
    faults.configure(None)
