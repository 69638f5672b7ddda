import itertools
import json
import logging

import numpy as np
import pytest

from jaxrl_async.tasks import base
from jaxrl_async.tasks import prompts as prompts_lib
from jaxrl_async.tasks.datasets import Fields
from jaxrl_async.tasks.hf_tokenizer import HFTokenizer
from jaxrl_async.tasks.text_task import TextTask

from .data_files import gsm8k_rows, write_jsonl
from .hf_files import write_llama3_like, write_qwen_like

SYSTEM = "Solve the problem. End with '#### <answer>'."


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  root = tmp_path_factory.mktemp("text_task")
  return {"qwen": write_qwen_like(root / "qwen"), "llama": write_llama3_like(root / "llama"),
          "train": write_jsonl(root / "train.jsonl", gsm8k_rows(40, seed=0)),
          "test": write_jsonl(root / "test.jsonl", gsm8k_rows(8, seed=1))}


@pytest.fixture(scope="module")
def task(files):
  return TextTask(files["train"], files["qwen"], fields=Fields(system_prompt=SYSTEM),
                  max_prompt_len=200, max_response_len=64)


def test_implements_the_task_protocol(task):
  assert isinstance(task, base.Task)
  assert task.max_sequence_len == 264 and task.tokenizer.vocab_size == 512


def test_prompt_is_the_chat_template_rendering(task, files):
  problem = task.problem(3)
  row = gsm8k_rows(40)[problem.meta["row"]]
  expected = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{row['question']}"
              f"<|im_end|>\n<|im_start|>assistant\n")
  assert task.tokenizer.decode(problem.prompt_tokens) == expected
  assert problem.meta == {"answer": row["answer"], "row": problem.meta["row"], "split": "train"}
  assert base.Problem.from_dict(json.loads(json.dumps(problem.to_dict()))) == problem
  again = TextTask(files["train"], files["qwen"], fields=Fields(system_prompt=SYSTEM),
                   max_prompt_len=200, max_response_len=64)
  assert all(again.problem(i) == task.problem(i) for i in range(5))


def test_plain_text_prompt_starts_with_bos(files):
  task = TextTask(files["train"], files["llama"], use_chat_template=False,
                  fields=Fields(system_prompt="Sys.", template="Q: {prompt}\nA:"))
  problem = task.problem(0)
  question = gsm8k_rows(40)[problem.meta["row"]]["question"]
  assert problem.prompt_tokens[0] == task.tokenizer.bos_id
  assert task.tokenizer.decode(problem.prompt_tokens, skip_special=True) == (
      f"Sys.\n\nQ: {question}\nA:")


def test_holdout_split_is_disjoint_and_fixed(task, files):
  assert task.num_problems("eval") == 2 and task.num_problems("train") == 38
  train_rows = {task.problem(i).meta["row"] for i in range(38)}
  eval_rows = {p.meta["row"] for p in task.eval_set()}
  assert train_rows.isdisjoint(eval_rows) and len(train_rows | eval_rows) == 40
  assert [p.meta["split"] for p in task.eval_set(1)] == ["eval"]
  other_seed = TextTask(files["train"], files["qwen"], seed=1)
  assert {p.meta["row"] for p in other_seed.eval_set()} != eval_rows


def test_eval_file(files):
  task = TextTask(files["train"], files["qwen"], eval_path=files["test"])
  assert task.num_problems("train") == 40 and len(task.eval_set(256)) == 8
  assert task.eval_set()[0].meta["answer"] == gsm8k_rows(8, seed=1)[0]["answer"]


def test_prompt_dataset_through_the_run_entry_point(task):
  iterator = iter(prompts_lib.prompt_dataset(task, seed=2))
  first = [p.prompt_id for p in itertools.islice(iterator, 76)]
  assert sorted(first[:38]) == sorted(first[38:]) == list(range(38))
  state = iterator.get_state()
  expected = [p.to_dict() for p in itertools.islice(iterator, 10)]
  fresh = iter(prompts_lib.prompt_dataset(task, seed=2))
  fresh.set_state(state)
  assert [p.to_dict() for p in itertools.islice(fresh, 10)] == expected
  with pytest.raises(ValueError, match="epoch_size"):
    prompts_lib.prompt_dataset(task, seed=2, epoch_size=10)


def test_rollout_servers_take_disjoint_shards(files):
  shards = [TextTask(files["train"], files["qwen"], shard_index=i, shard_count=3)
            for i in range(3)]
  seen = [[p.prompt_id for p in itertools.islice(iter(t.prompt_dataset(seed=0, num_epochs=1)),
                                                 100)] for t in shards]
  assert sorted(itertools.chain(*seen)) == list(range(38))


def _response(task, text, *tail):
  return np.concatenate([task.tokenizer.encode(text), np.asarray(tail, np.int32)])


def test_reward_decodes_to_the_first_stop_id(task):
  problem = task.problem(0)
  answer = problem.meta["answer"]
  final = answer.rsplit("#### ", 1)[1]
  eos, other_stop = task.tokenizer.stop_ids
  prompt = problem.prompt_tokens
  assert task.reward(prompt, _response(task, answer, eos), problem.meta) == 1.0
  assert task.reward(prompt, _response(task, f"so \\boxed{{{final}}}", other_stop),
                     problem.meta) == 1.0
  assert task.reward(prompt, _response(task, f"#### {final}", eos, *task.tokenizer.encode(
      "#### 999999")), problem.meta) == 1.0  # after eos: ignored
  assert task.reward(prompt, _response(task, f"#### {int(final) + 1}", eos), problem.meta) == 0.0
  assert task.reward(prompt, _response(task, "I do not know"), problem.meta) == 0.0
  assert task.reward(prompt, np.zeros(0, np.int32), problem.meta) == 0.0
  with pytest.raises(ValueError, match="reference answer"):
    task.reward(prompt, _response(task, "x"), {"answer": None})


def test_sft_example_earns_the_reward(task):
  tokens, mask = task.sft_example(5)
  problem = task.problem(5)
  prompt_len = len(problem.prompt_tokens)
  assert tokens.dtype == np.int32 and mask.dtype == np.float32
  assert (mask[:prompt_len] == 0).all() and (mask[prompt_len:] == 1).all()
  assert tokens[-1] == task.tokenizer.eos_id
  assert task.reward(problem.prompt_tokens, tokens[mask == 1], problem.meta) == 1.0
  seq_len = 201
  batch, batch_mask = task.sft_batch(np.random.default_rng(0), 4, seq_len)
  assert batch.shape == batch_mask.shape == (4, seq_len)
  indices = np.random.default_rng(0).integers(0, task.num_problems(), size=4).tolist()
  for row, index in enumerate(indices):
    example, example_mask = task.sft_example(index)
    length = min(len(example), seq_len)  # longer examples are cut
    np.testing.assert_array_equal(batch[row, :length], example[:length])
    np.testing.assert_array_equal(batch_mask[row, :length], example_mask[:length])
    assert (batch[row, length:] == task.tokenizer.pad_id).all()
    assert (batch_mask[row, length:] == 0).all()
  with pytest.raises(ValueError, match="seq_len"):
    task.sft_batch(np.random.default_rng(0), 4, 100)


def test_bad_rows_reach_metrics_and_the_log(files, tmp_path, caplog):
  rows = gsm8k_rows(5) + [{"question": "q" * 400, "answer": "#### 1"}, {"answer": "#### 2"},
                          '{"question": "lone surrogate \\ud800", "answer": "#### 3"}']
  path = write_jsonl(tmp_path / "bad.jsonl", rows)
  with caplog.at_level(logging.WARNING, logger="jaxrl_async.tasks.text_task"):
    task = TextTask(path, files["qwen"], eval_path=files["test"], max_prompt_len=100)
  metrics = task.data_metrics()
  assert metrics["data/bad_rows/too_long"] == 1 and metrics["data/bad_rows/missing_field"] == 1
  assert metrics["data/bad_rows/render_failed"] == 1  # the tokenizer refuses the surrogate
  assert metrics["data/rows"] == 5 and metrics["data_eval/bad_rows"] == 0
  assert "5 of 8 rows used, 3 bad" in caplog.text


def test_configuration_errors(files, tmp_path):
  tokenizer = HFTokenizer.from_dir(files["qwen"])
  no_template = HFTokenizer(tokenizer._tokenizer, special_tokens=tokenizer.special_tokens)
  with pytest.raises(ValueError, match="use_chat_template"):
    TextTask(files["train"], no_template)
  one_row = write_jsonl(tmp_path / "one.jsonl", gsm8k_rows(1))
  with pytest.raises(ValueError, match="eval_path"):
    TextTask(one_row, tokenizer)
  with pytest.raises(ValueError, match="holdout_fraction"):
    TextTask(files["train"], tokenizer, holdout_fraction=0.9)
  with pytest.raises(ValueError, match="shard_index"):
    TextTask(files["train"], tokenizer, shard_index=3, shard_count=3)
  task = TextTask(files["train"], tokenizer)
  with pytest.raises(ValueError, match=r"index must be an int in \[0, 38\)"):
    task.problem(38)


def _load_gsm8k_gin(files, *bindings):
  import gin
  from jaxrl_async import config as config_lib
  from launch import train

  train.load_config(["gin/modes/sync.gin", "gin/tasks/gsm8k.gin"], [
      f"GSM8K_TRAIN = '{files['train']}'", f"GSM8K_TEST = '{files['test']}'",
      f"TOKENIZER_DIR = '{files['qwen']}'", *bindings])
  return gin.get_configurable(config_lib.RunConfig)()


def test_gsm8k_gin_makes_the_task(files):
  short_names = _load_gsm8k_gin(files, "Fields.template = 'Q: {prompt}'", "TextTask.seed = 3",
                                "MathReward.format = 'boxed'").task
  assert short_names.fields.template == "Q: {prompt}" and short_names.seed == 3
  assert short_names.reward_fn.format == "boxed"
  config = _load_gsm8k_gin(files)
  task = config.task
  assert isinstance(task, TextTask) and task.eval_path == str(files["test"])
  assert task.fields.system_prompt.endswith("within \\boxed{}.")
  assert task.max_prompt_len == 256 and task.max_response_len == 512
  assert task.num_problems("train") == 40 and len(task.eval_set()) == 8
  question = gsm8k_rows(40)[task.problem(0).meta["row"]]["question"]
  assert task.tokenizer.decode(task.problem(0).prompt_tokens).endswith(
      f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_a_gsm8k_file_trains_with_the_gin_config(files, tmp_path):
  from jaxrl_async.run import api

  config = _load_gsm8k_gin(
      files, "TextTask.max_prompt_len = 160", "TextTask.max_response_len = 16",
      "WarmStartConfig.steps = 2", "WarmStartConfig.batch_size = 4", "RunConfig.group_size = 2",
      "RunConfig.mini_batch_size = 2", "RunConfig.total_samples = 8",
      "RunConfig.max_concurrent_decodes = 4", "RunConfig.eval_size = 4",
      "RunConfig.eval_every_versions = 1", "RunConfig.checkpoint_every_versions = 2")
  config_task = config.task
  summary = api.run(config, tmp_path / "run", progress=False, log=lambda *a: None)
  assert config_task.max_response_len == 16
  assert summary["policy_version"] == 2 and summary["consumed_samples"] == 8
  assert summary["reward/ok"] == 8 and summary["reward/failed"] == 0
  assert summary["eval/num_problems"] == 4.0  # from the held-out file
  assert summary["data/rows"] == 40.0 and summary["data/bad_rows"] == 0.0
  assert summary["data_eval/rows"] == 8.0 and summary["data/bad_rows/too_long"] == 0.0
