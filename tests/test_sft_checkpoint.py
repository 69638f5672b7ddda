"""tools/sft_checkpoint.py: a Hugging Face checkpoint fine-tuned on a task's reference answers
comes back as a checkpoint of the same model that fits those answers better."""

import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import gin
from jaxrl_async import config as config_lib
from jaxrl_async.learner import sft
from jaxrl_async.model import apply, weights
from jaxrl_async.run import build
from jaxrl_async.tasks.datasets import Fields
from jaxrl_async.tasks.math_rewards import MathReward
from jaxrl_async.tasks.text_task import TextTask
from tools import sft_checkpoint

from .tasks.data_files import gsm8k_rows, write_jsonl

QWEN2 = "tests/fixtures/hf/qwen2"


def _sft_loss(directory, task, spec) -> float:
  checkpoint = weights.HFCheckpoint(directory, dtype="float32", remat=False)
  params = checkpoint.load(spec.model_config)
  tokens, mask = task.sft_batch(np.random.default_rng(7), 16, spec.seq_len)
  logits, _ = apply(spec.graphdef, params, tokens[:, :-1])
  return float(sft.cross_entropy(logits, tokens[:, 1:], mask[:, 1:]))


def test_a_checkpoint_fine_tuned_on_the_answers_fits_them_better(tmp_path):
  train = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(64, seed=0))
  out = tmp_path / "sft"
  assert sft_checkpoint.main([
      "--checkpoint", QWEN2, "--out", str(out), "--gin_file", "gin/tasks/gsm8k.gin",
      "--gin_bindings", f"GSM8K_TRAIN = '{train}'", "--gin_bindings", "GSM8K_TEST = None",
      "--gin_bindings", f"TOKENIZER_DIR = '{QWEN2}'",
      "--gin_bindings", "TextTask.max_prompt_len = 128",
      "--gin_bindings", "TextTask.max_response_len = 32",
      "--steps", "12", "--batch_size", "8"]) == 0
  assert (out / "tokenizer.json").exists()
  before = weights.load_config(QWEN2, max_seq_len=160)
  after = weights.load_config(out, max_seq_len=160)
  assert after == before  # the same model
  gin.clear_config()
  task = TextTask(data_path=str(train), tokenizer=QWEN2, fields=Fields(), max_prompt_len=128,
                  max_response_len=32, reward_fn=MathReward(use_math_verify=False),
                  use_chat_template=True, seed=0)
  spec = build.model_spec(config_lib.RunConfig(task=task, checkpoint=weights.HFCheckpoint(
      QWEN2, dtype="float32", remat=False)))
  assert _sft_loss(out, task, spec) < _sft_loss(QWEN2, task, spec) - 0.1


def test_the_tool_refuses_to_overwrite_its_input():
  with pytest.raises(SystemExit, match="--out must differ"):
    sft_checkpoint.main(["--checkpoint", QWEN2, "--out", QWEN2, "--gin_file", "x.gin"])


def test_warm_start_refuses_params_of_another_model():
  with pytest.raises(ValueError, match="structure"):
    sft.warm_start(None, weights.load_config(QWEN2), sft.WarmStartConfig(steps=1), None,
                   initial_params={"embed": np.zeros(3)})
