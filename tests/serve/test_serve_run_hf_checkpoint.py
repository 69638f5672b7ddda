"""Serving a run whose RunConfig.checkpoint names a Hugging Face checkpoint (the tiny llama of
tests/fixtures/hf): the policy has the checkpoint's model, tokenizer and stop ids; before the
run saved a checkpoint it serves the HF weights (greedy tokens equal transformers'), after, the
saved learner params restored in the HF model's shapes."""

import dataclasses
import json
import pathlib

import grpc
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_async.config import RunConfig
from jaxrl_async.model import weights
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.serve import jetstream_pb2_grpc as pb_grpc
from jaxrl_async.serve.client import decode
from jaxrl_async.serve.policy import policy_from_checkpoint
from jaxrl_async.serve.server import PolicyServer
from jaxrl_async.tasks.hf_tokenizer import HFTokenizer

LLAMA = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "hf" / "llama"


@dataclasses.dataclass
class _Task:  # what serving reads of a task
  tokenizer: object
  max_prompt_len: int = 40
  max_response_len: int = 24

  @property
  def max_sequence_len(self) -> int:
    return self.max_prompt_len + self.max_response_len


def _config(task=None):
  checkpoint = weights.HFCheckpoint(path=str(LLAMA), dtype="float32", param_dtype="float32")
  return RunConfig(checkpoint=checkpoint, task=task)


def _run_dir(tmp_path):
  (tmp_path / "config.gin").write_text("")
  return tmp_path


def test_a_run_without_saved_checkpoints_serves_the_hf_model(tmp_path):
  task = _Task(HFTokenizer.from_dir(LLAMA))
  policy = policy_from_checkpoint(_config(task), _run_dir(tmp_path))
  hf_config = weights.load_config(LLAMA, max_seq_len=64, dtype="float32")
  assert policy.model_config.vocab_size == hf_config.vocab_size
  assert policy.model_config.n_layers == hf_config.n_layers and policy.version == 0
  assert policy.tokenizer is task.tokenizer and policy.stop_ids == task.tokenizer.stop_ids
  expected = weights.load_params(LLAMA, policy.model_config)
  for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(expected), strict=True):
    np.testing.assert_array_equal(a, b)

  reference = json.loads((LLAMA / "reference.json").read_text())
  with PolicyServer(policy, port=0, max_concurrent_decodes=2,
                    sampling=SamplingConfig(temperature=0.0)) as server, \
      grpc.insecure_channel(server.address) as channel:
    stub = pb_grpc.OrchestratorStub(channel)
    for prompt in reference["prompts"]:
      served = decode(stub, prompt["token_ids"], max_tokens=len(prompt["greedy"]),
                      timeout_s=120)[0]
      greedy = prompt["greedy"]
      stops = [i for i, t in enumerate(greedy) if t in policy.stop_ids]
      assert served == (greedy[:stops[0] + 1] if stops else greedy)


def test_without_a_task_the_checkpoints_tokenizer_is_served(tmp_path):
  policy = policy_from_checkpoint(_config(), _run_dir(tmp_path))
  assert isinstance(policy.tokenizer, HFTokenizer)
  assert policy.eos_id == policy.tokenizer.eos_id and policy.stop_ids == policy.tokenizer.stop_ids


def test_a_saved_run_checkpoint_is_restored_in_the_hf_models_shapes(tmp_path):
  config = _config(_Task(HFTokenizer.from_dir(LLAMA)))
  initial = policy_from_checkpoint(config, _run_dir(tmp_path))
  trained = jax.tree.map(lambda x: np.asarray(x) + 0.5, initial.params)
  tree = {"step": np.int32(3), "params": trained,
          "opt_state": config.learner.optimizer().init(trained)}
  manager = ocp.CheckpointManager(tmp_path / "checkpoints", item_names=("state", "prompts", "run"))
  manager.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(tree)))
  manager.wait_until_finished()
  manager.close()
  policy = policy_from_checkpoint(config, tmp_path)
  assert policy.version == 7 and policy.model_config == initial.model_config
  for a, b in zip(jax.tree.leaves(policy.params), jax.tree.leaves(trained), strict=True):
    np.testing.assert_array_equal(a, b)
  with pytest.raises(FileNotFoundError, match="checkpoint step 8"):
    policy_from_checkpoint(config, tmp_path, step=8)
