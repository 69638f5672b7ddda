"""Serving a Hugging Face checkpoint that has no tokenizer.json: prompts sent as token ids get the
tokens the same checkpoint with its tokenizer gets (same stop ids, seed and greedy decoding), and
a text prompt gets INVALID_ARGUMENT saying the checkpoint has no tokenizer.json. Also through
`jaxrl-async serve --hf_model` itself, on a checkpoint with neither tokenizer nor end token."""

import json
import pathlib
import queue
import shutil
import signal
import subprocess
import sys
import threading

import grpc
import pytest

from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.serve import jetstream_pb2 as pb
from jaxrl_async.serve import jetstream_pb2_grpc as pb_grpc
from jaxrl_async.serve.client import decode
from jaxrl_async.serve.policy import checkpoint_stop_ids, policy_from_hf
from jaxrl_async.serve.server import PolicyServer

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf"
REPO = FIXTURES.parent.parent.parent
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _without_tokenizer(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
  """The checkpoint's config, generation config and weights, without its tokenizer files."""
  target.mkdir()
  for path in source.iterdir():
    if path.name.endswith((".safetensors", ".safetensors.index.json")) or path.name in (
        "config.json", "generation_config.json"):
      shutil.copy(path, target / path.name)
  assert not any((target / name).exists() for name in TOKENIZER_FILES)
  return target


def _text_request(text: str, max_tokens: int = 4) -> pb.DecodeRequest:
  return pb.DecodeRequest(text_content=pb.DecodeRequest.TextContent(text=text),
                          max_tokens=max_tokens)


def test_token_requests_are_served_as_with_the_tokenizer_and_text_is_refused(tmp_path):
  bare_dir = _without_tokenizer(FIXTURES / "llama", tmp_path / "llama")
  bare = policy_from_hf(bare_dir, max_seq_len=64, max_prompt_len=40)
  full = policy_from_hf(FIXTURES / "llama", max_seq_len=64, max_prompt_len=40)
  assert bare.tokenizer is None and full.tokenizer is not None
  # The stop ids come from generation_config.json, as the tokenizer's do.
  assert (bare.eos_id, bare.stop_ids) == (full.eos_id, full.stop_ids) == (385, (385,))
  assert "no tokenizer.json" in bare.description
  prompts = json.loads((FIXTURES / "llama" / "reference.json").read_text())["prompts"]

  def serve(policy):
    with PolicyServer(policy, port=0, max_concurrent_decodes=2, seed=3,
                      sampling=SamplingConfig(temperature=0.0)) as server, \
        grpc.insecure_channel(server.address) as channel:
      assert server.address.startswith("127.0.0.1:")
      stub = pb_grpc.OrchestratorStub(channel)
      served = [decode(stub, p["token_ids"], max_tokens=len(p["greedy"]), timeout_s=120)[0]
                for p in prompts]
      if policy.tokenizer is not None:
        return served
      with pytest.raises(grpc.RpcError) as refused:
        list(stub.Decode(_text_request(prompts[0]["text"]), timeout=60))
      assert stub.HealthCheck(pb.HealthCheckRequest(), timeout=60).is_live
      # The server still serves token ids after refusing text.
      again = decode(stub, prompts[0]["token_ids"], max_tokens=len(prompts[0]["greedy"]),
                     timeout_s=120)[0]
      assert again == served[0]
      return served, refused.value

  served, refused = serve(bare)
  assert served == serve(full)
  for prompt, tokens in zip(prompts, served):  # and both are transformers' greedy tokens
    greedy = prompt["greedy"]
    assert tokens == (greedy[:greedy.index(385) + 1] if 385 in greedy else greedy)
  assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
  message = refused.details()
  assert f"the checkpoint at {bare_dir} has no tokenizer.json" in message, message
  assert "token ids" in message and "token_content" in message, message


def test_checkpoint_stop_ids(tmp_path):
  def stop_ids(config=None, generation=None):
    for name, content in (("config.json", config), ("generation_config.json", generation)):
      path = tmp_path / name
      path.unlink(missing_ok=True)
      if content is not None:
        path.write_text(json.dumps(content))
    return checkpoint_stop_ids(tmp_path, vocab_size=100)

  assert stop_ids({"eos_token_id": 7}, {"eos_token_id": [9, 8, 9]}) == (9, 8)
  assert stop_ids({"eos_token_id": 7}, {"bos_token_id": 1}) == (7,)  # config.json's
  assert stop_ids({"eos_token_id": 7}, {"eos_token_id": None}) == ()  # null: none
  assert stop_ids({"vocab_size": 100}) == ()
  with pytest.raises(ValueError, match=r"eos_token_id in .*generation_config.json must be an "
                                       r"int in \[0, vocab_size=100\).*got 100"):
    stop_ids({}, {"eos_token_id": 100})
  with pytest.raises(ValueError, match=r"config.json must be an int .* got \[3, 'x'\]"):
    stop_ids({"eos_token_id": [3, "x"]})


def _read_lines(stream, lines: queue.Queue):
  for line in stream:
    lines.put(line)


def test_the_serve_command_serves_a_checkpoint_without_tokenizer(tmp_path):
  """qwen3-tf5 has no tokenizer and no end token: responses run to max_tokens, and equal the
  greedy tokens transformers recorded."""
  checkpoint = _without_tokenizer(FIXTURES / "qwen3-tf5", tmp_path / "qwen3")
  assert json.loads((checkpoint / "config.json").read_text())["eos_token_id"] is None
  prompt = json.loads((FIXTURES / "qwen3-tf5" / "reference.json").read_text())["prompts"][0]
  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxrl_async.cli", "serve", "--hf_model", str(checkpoint),
       "--port", "0", "--temperature", "0", "--max_seq_len", "64", "--max_prompt_len", "40",
       "--max_concurrent_decodes", "1"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines: queue.Queue = queue.Queue()
  reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), name="serve-log",
                            daemon=True)
  reader.start()
  try:
    address, seen = None, []
    while address is None:
      line = lines.get(timeout=300)
      seen.append(line)
      if line.startswith("serving "):
        address = line.strip().rsplit(" on ", 1)[1]
    assert address.startswith("127.0.0.1:"), seen
    assert "no tokenizer.json" in seen[-1], seen
    with grpc.insecure_channel(address) as channel:
      stub = pb_grpc.OrchestratorStub(channel)
      assert decode(stub, prompt["token_ids"], max_tokens=20, timeout_s=120)[0] == prompt[
          "greedy"]
      # No end token: a response runs to the server's limit, 64 - 40 tokens.
      longest = decode(stub, prompt["token_ids"], timeout_s=120)[0]
      assert len(longest) == 24 and longest[:20] == prompt["greedy"]
      with pytest.raises(grpc.RpcError) as refused:
        list(stub.Decode(_text_request("How many clips?"), timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"the checkpoint at {checkpoint} has no tokenizer.json" in refused.value.details()
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(timeout=30)
      raise
    reader.join(timeout=30)
  assert code == 0
