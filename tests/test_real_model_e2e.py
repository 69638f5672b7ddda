"""End to end with the real-model configs: gin/models/qwen2.5-0.5b.gin and gin/tasks/gsm8k.gin on
the tiny random Qwen2 checkpoint of tests/fixtures/hf/qwen2 and a generated 32-row GSM8K-format
file, in an async mode for a few policy versions; every part is checked to have run."""

import json
import pathlib

import jax
import numpy as np
import pytest

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

import gin
from jaxrl_async import config as config_lib
from jaxrl_async.model import weights
from jaxrl_async.run import api
from jaxrl_async.run import build as build_lib
from launch import train

from .tasks.data_files import gsm8k_rows, write_jsonl

CHECKPOINT = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "qwen2"


def _config(train_file, *bindings):
  train.load_config(
      ["gin/modes/async_stale.gin", "gin/models/qwen2.5-0.5b.gin", "gin/tasks/gsm8k.gin"],
      [f"CHECKPOINT_DIR = '{CHECKPOINT}'", f"TOKENIZER_DIR = '{CHECKPOINT}'",
       f"GSM8K_TRAIN = '{train_file}'", "GSM8K_TEST = None", *bindings])
  return gin.get_configurable(config_lib.RunConfig)()


def test_model_gin_files_name_a_checkpoint_and_its_settings():
  for name in ("qwen2.5-0.5b", "qwen3-0.6b", "llama3.2-1b"):
    train.load_config(["gin/modes/sync.gin", f"gin/models/{name}.gin"],
                      [f"CHECKPOINT_DIR = '{CHECKPOINT}'"])
    config = gin.get_configurable(config_lib.RunConfig)()
    assert config.checkpoint == weights.HFCheckpoint(path=str(CHECKPOINT), dtype="bfloat16",
                                                     param_dtype="float32", remat=True)
  train.load_config(["gin/modes/sync.gin", "gin/models/qwen3-0.6b.gin"],
                    [f"CHECKPOINT_DIR = '{CHECKPOINT}'", "HFCheckpoint.dtype = 'float32'"])
  assert gin.get_configurable(config_lib.RunConfig)().checkpoint.dtype == "float32"


def test_a_checkpoint_with_too_small_a_vocabulary_for_the_tokenizer_is_refused(tmp_path):
  small = tmp_path / "small"
  small.mkdir()
  hf = json.loads((CHECKPOINT / "config.json").read_text())
  (small / "config.json").write_text(json.dumps({**hf, "vocab_size": 100}))
  config = _config(write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(32)),
                   f"CHECKPOINT_DIR = '{small}'", "TextTask.max_prompt_len = 220",
                   "TextTask.max_response_len = 16")
  with pytest.raises(ValueError, match=r"embeds only vocab_size=100"):
    build_lib.build(config, log=lambda *a: None)


@pytest.mark.slow
def test_async_run_on_a_tiny_qwen2_checkpoint_and_a_gsm8k_file(tmp_path):
  train_file = write_jsonl(tmp_path / "train.jsonl", gsm8k_rows(32, seed=0))
  config = _config(
      train_file, "TextTask.max_prompt_len = 220", "TextTask.max_response_len = 16",
      "RunConfig.group_size = 2", "RunConfig.mini_batch_size = 2", "RunConfig.total_samples = 12",
      "RunConfig.max_concurrent_decodes = 4", "RunConfig.eval_size = 2",
      "RunConfig.eval_every_versions = 1", "RunConfig.checkpoint_every_versions = 1",
      # A random model earns no reward (zero advantages, zero gradients): weight decay makes the
      # learner's updates visible in the weights all the same.
      "LearnerConfig.weight_decay = 0.1")
  assert config.mode == "async_stale" and config.num_versions == 3
  logged = []
  parts = build_lib.build(config, log=logged.append)

  # The checkpoint was loaded (no warm start), with the gin file's dtypes and remat.
  assert any(str(CHECKPOINT) in str(line) for line in logged)
  assert not any("warm start" in str(line) for line in logged)
  model_config = parts.learner.spec.model_config
  assert model_config.qkv_bias and model_config.tie_embeddings and model_config.remat
  assert (model_config.dtype, model_config.param_dtype) == ("bfloat16", "float32")
  expected = weights.load_params(CHECKPOINT, model_config)
  for ours, theirs in zip(jax.tree.leaves(parts.learner.initial_state.params), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs))
  initial = jax.tree.map(np.asarray, parts.learner.initial_state.params)

  # The tokenizer is the checkpoint's: prompts are its chat template's rendering.
  tokenizer = parts.task.tokenizer
  assert type(tokenizer).__name__ == "HFTokenizer" and tokenizer.vocab_size == 400
  problem = parts.task.problem(0)
  text = tokenizer.decode(problem.prompt_tokens)
  assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
  assert parts.task.tokenizer.eos_id == tokenizer.token_to_id("<|im_end|>")

  run_dir = tmp_path / "run"
  result = api.train(parts, run_dir, progress=False, log=logged.append)
  summary = result.summary
  assert summary["mode"] == "async_stale"
  assert summary["policy_version"] == 3 and summary["learner_step"] == 3
  assert summary["consumed_samples"] == 12
  assert summary["reward/ok"] >= 12 and summary["reward/failed"] == 0
  assert summary["data/rows"] == 32.0 and summary["data/bad_rows"] == 0.0

  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  trained = [r for r in records if "result/reward_mean" in r]
  assert sorted({r["policy_version"] for r in trained}) == [1, 2, 3]
  assert all(0.0 <= r["result/reward_mean"] <= 1.0 for r in trained)
  assert all("algo/kl" in r and "sync/latency_s" in r for r in trained)
  assert any("eval/accuracy" in r for r in records)
  assert (run_dir / "summary.json").exists() and any((run_dir / "checkpoints").iterdir())

  # The weights changed, and export writes a checkpoint that reads back as the same model.
  final = result.state.params
  assert any(not np.array_equal(a, np.asarray(b))
             for a, b in zip(jax.tree.leaves(initial), jax.tree.leaves(final)))
  out = tmp_path / "exported"
  weights.save_params(final, model_config, out, base=CHECKPOINT)
  again = weights.load_params(out, weights.load_config(out, max_seq_len=model_config.max_seq_len))
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(final)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
