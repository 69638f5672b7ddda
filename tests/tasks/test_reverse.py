import json

import numpy as np
import pytest

from jaxrl_async.tasks import base
from jaxrl_async.tasks.reverse import DigitReverseTask, in_eval_split


@pytest.fixture(scope="module")
def task():
  return DigitReverseTask(seed=0)


@pytest.fixture(scope="module")
def train_problems(task):
  return [task.problem(i, "train") for i in range(10_000)]


@pytest.fixture(scope="module")
def eval_problems(task):
  return [task.problem(i, "eval") for i in range(3_000)]


def test_implements_task_protocol(task):
  assert isinstance(task, base.Task)
  assert task.max_prompt_len == 26 and task.max_response_len == 25
  assert task.max_sequence_len == 51


def test_problem_layout(task):
  problem = task.problem(7)
  tok = task.tokenizer
  digits = problem.meta["digits"]
  assert problem.prompt_id == 7
  assert problem.prompt_tokens.dtype == np.int32
  assert tok.decode(problem.prompt_tokens) == f"<bos>{digits}="
  assert tok.decode(task.reference_response(problem)) == digits[::-1] + "<eos>"
  assert json.loads(json.dumps(problem.meta)) == problem.meta
  assert base.Problem.from_dict(json.loads(json.dumps(problem.to_dict()))) == problem
  with pytest.raises(ValueError):
    problem.prompt_tokens[0] = 3  # frozen


def test_length_distribution_is_long_tailed(task, train_problems):
  response_lengths = np.array([len(p.meta["digits"]) + 1 for p in train_problems])
  assert response_lengths.min() >= task.min_len + 1
  assert response_lengths.max() <= task.max_len + 1
  p50 = np.percentile(response_lengths, 50, method="inverted_cdf")
  p99 = np.percentile(response_lengths, 99, method="inverted_cdf")
  assert p99 >= 4 * p50, (p50, p99)
  # The exact quantiles of the distribution (before the split) are the documented ones.
  assert (task.response_length_quantile(0.5), task.response_length_quantile(0.99)) == (4, 17)
  assert abs(p50 - 4) <= 1 and abs(p99 - 17) <= 1


def test_length_frequencies_match_the_distribution(task, train_problems):
  lengths, probs = task.length_distribution()
  counts = np.bincount([len(p.meta["digits"]) for p in train_problems],
                       minlength=task.max_len + 1)[lengths]
  freqs = counts / counts.sum()
  # Standard error is < 0.005 per length here; the split shifts short lengths a little.
  np.testing.assert_allclose(freqs, probs, atol=0.03)


def test_length_parameters_shape_the_distribution():
  task = DigitReverseTask(min_len=5, max_len=8, decay=1.0)
  lengths = {len(task.problem(i).meta["digits"]) for i in range(400)}
  assert lengths == {5, 6, 7, 8}
  assert task.max_response_len == 9


def test_train_and_eval_are_disjoint(task, train_problems, eval_problems):
  short = task.holdout_min_len
  train = {p.meta["digits"] for p in train_problems if len(p.meta["digits"]) >= short}
  held_out = {p.meta["digits"] for p in eval_problems if len(p.meta["digits"]) >= short}
  assert train.isdisjoint(held_out)
  # Strings shorter than holdout_min_len are in both splits, so short eval problems vary.
  short_eval = {p.meta["digits"] for p in eval_problems if len(p.meta["digits"]) < short}
  assert len(short_eval) > 20
  assert all(not in_eval_split(d, task.eval_fraction) for d in train)
  assert all(in_eval_split(d, task.eval_fraction) for d in held_out)
  assert len(held_out) > 1000  # not a handful of repeated strings


def test_split_bucket_is_about_eval_fraction():
  strings = [f"{i:05d}" for i in range(20_000)]
  share = np.mean([in_eval_split(s, 0.1) for s in strings])
  assert 0.09 < share < 0.11


def test_problems_are_deterministic(task):
  again = DigitReverseTask(seed=0)
  for split in ("train", "eval"):
    for index in (0, 1, 12345, 2**40):
      assert task.problem(index, split) == again.problem(index, split)
  other_seed = DigitReverseTask(seed=1)
  differ = sum(task.problem(i) != other_seed.problem(i) for i in range(100))
  assert differ > 80  # a few short strings may coincide
  assert task.problem(3, "train") != task.problem(3, "eval")


def test_eval_set(task):
  eval_set = task.eval_set()
  assert len(eval_set) == 256
  assert eval_set == task.eval_set(256)
  assert [p.prompt_id for p in eval_set] == list(range(256))
  assert all(p.meta["split"] == "eval" for p in eval_set)


def test_reward(task):
  problem = task.problem(11)
  correct = task.reference_response(problem)
  assert task.reward(problem.prompt_tokens, correct, problem.meta) == 1.0
  assert task.reward(problem.prompt_tokens, correct, {}) == 1.0  # target read from the prompt
  assert task.reward(problem.prompt_tokens, correct[:-1], problem.meta) == 0.0  # no <eos>
  wrong = correct.copy()
  wrong[0] = task.tokenizer.digit_ids[(wrong[0] - 5 + 1) % 10]
  assert task.reward(problem.prompt_tokens, wrong, problem.meta) == 0.0
  assert task.reward(problem.prompt_tokens, np.zeros(0, np.int32), problem.meta) == 0.0


def test_sft_example():
  task = DigitReverseTask(0, distractor_prob=0.0)
  for index in range(50):
    tokens, mask = task.sft_example(index)
    problem = task.problem(index)
    prompt_len, answer_len = len(problem.prompt_tokens), len(problem.meta["digits"]) + 1
    assert tokens.dtype == np.int32 and mask.dtype == np.float32
    assert tokens.shape == mask.shape == (prompt_len + answer_len,)
    assert mask.tolist() == [0.0] * prompt_len + [1.0] * answer_len
    assert task.tokenizer.decode(tokens) == (
        f"<bos>{problem.meta['digits']}={problem.meta['digits'][::-1]}<eos>")
    # The masked tokens, read as a response, earn the reward.
    assert task.reward(problem.prompt_tokens, tokens[mask == 1], problem.meta) == 1.0


def test_sft_distractor_copies_in_order_at_its_rate():
  task = DigitReverseTask(0, distractor_prob=0.6)
  copied = 0
  for index in range(2000):
    tokens, _ = task.sft_example(index)
    digits = task.problem(index).meta["digits"]
    text = task.tokenizer.decode(tokens)
    assert text in (f"<bos>{digits}={digits[::-1]}<eos>", f"<bos>{digits}={digits}<eos>")
    copied += text == f"<bos>{digits}={digits}<eos>" and digits != digits[::-1]
    assert task.sft_example(index)[0].tolist() == tokens.tolist()  # deterministic by index
  palindromes = sum(task.problem(i).meta["digits"] == task.problem(i).meta["digits"][::-1]
                    for i in range(2000))
  assert 0.55 < copied / (2000 - palindromes) < 0.65


def test_distractor_prob_is_validated():
  with pytest.raises(ValueError, match="distractor_prob"):
    DigitReverseTask(0, distractor_prob=1.0)


def test_sft_batch(task):
  tokens, mask = task.sft_batch(np.random.default_rng(0), batch_size=16, seq_len=60)
  assert tokens.shape == mask.shape == (16, 60)
  assert tokens.dtype == np.int32 and mask.dtype == np.float32
  eos = task.tokenizer.eos_id
  for row_tokens, row_mask in zip(tokens, mask):
    end = int(np.argmax(row_tokens == eos)) + 1  # one past <eos>
    assert (row_tokens[end:] == task.tokenizer.pad_id).all() and (row_mask[end:] == 0).all()
    assert (row_tokens[:end] != task.tokenizer.pad_id).all()
    equals = int(np.argmax(row_tokens == task.tokenizer.equals_id))
    assert (row_mask[:equals + 1] == 0).all() and (row_mask[equals + 1:end] == 1).all()
  again, _ = task.sft_batch(np.random.default_rng(0), batch_size=16, seq_len=60)
  np.testing.assert_array_equal(tokens, again)
  with pytest.raises(ValueError, match="seq_len"):
    task.sft_batch(np.random.default_rng(0), batch_size=2, seq_len=50)


@pytest.mark.parametrize("kwargs, knob", [
    ({"min_len": 0}, "min_len"),
    ({"min_len": 5, "max_len": 4}, "max_len"),
    ({"max_len": 1000}, "max_len"),
    ({"decay": 0.0}, "decay"),
    ({"decay": 1.5}, "decay"),
    ({"eval_fraction": 0.0}, "eval_fraction"),
    ({"eval_fraction": 0.9}, "eval_fraction"),
    ({"seed": -1}, "seed"),
])
def test_bad_configuration_names_the_knob(kwargs, knob):
  with pytest.raises(ValueError, match=knob):
    DigitReverseTask(**kwargs)


def test_bad_split_and_index(task):
  with pytest.raises(ValueError, match="split"):
    task.problem(0, "test")
  with pytest.raises(ValueError, match="index"):
    task.problem(-1)
