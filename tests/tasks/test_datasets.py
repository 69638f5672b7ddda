import itertools
import json

import grain
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_async.tasks import datasets
from jaxrl_async.tasks.datasets import Fields, load_prompt_set, row_pipeline

from .data_files import gsm8k_rows, write_jsonl, write_parquet


def _render(text):
  """One token per character: prompt length = message length (easy to reason about)."""
  if "refused" in text:
    raise ValueError("the renderer refuses this text")
  return np.frombuffer(text.encode("utf-32-le"), np.int32)


def _bad_and_good_rows():
  good = gsm8k_rows(6)
  return [
      good[0],
      "{not json",                                           # unreadable
      json.dumps([1, 2]),                                     # not_an_object
      {"question": "What is 2+2?"},                           # missing_field (answer)
      {"prompt": "wrong field name", "answer": "#### 1"},     # missing_field (question)
      {"question": None, "answer": "#### 1"},                 # missing_field (null)
      {"question": ["a", "list"], "answer": "#### 1"},        # not_text
      {"question": "   ", "answer": "#### 1"},                # empty
      {"question": "Fine?", "answer": ""},                    # empty answer
      {"question": "x" * 500, "answer": "#### 1"},            # too_long
      {"question": "refused by the renderer", "answer": "1"}, # render_failed
      good[1],
      {"question": "Numeric answer?", "answer": 7},           # good: a number is text
      good[2],
  ]


def test_bad_rows_are_counted_by_reason_and_reported(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", _bad_and_good_rows())
  prompt_set = load_prompt_set(path, Fields(), _render, max_prompt_len=200)
  assert len(prompt_set) == 4 and prompt_set.num_read == 14
  assert prompt_set.bad_rows == {"unreadable": 1, "not_an_object": 1, "missing_field": 3,
                                 "not_text": 1, "empty": 2, "render_failed": 1, "too_long": 1}
  assert [r.row for r in prompt_set.rows] == [0, 11, 12, 13]
  assert prompt_set[2].answer == "7"
  metrics = prompt_set.metrics()
  assert metrics["data/rows"] == 4 and metrics["data/bad_rows"] == 10
  assert metrics["data/bad_rows/missing_field"] == 3
  report = prompt_set.report()
  assert "4 of 14 rows used, 10 bad" in report
  assert "render_failed: 1 (e.g. row 10: ValueError: the renderer refuses this text)" in report
  assert "too_long: 1 (e.g. row 9: 500 tokens > max_prompt_len=200)" in report
  assert "row 4: no 'question'" in report


def test_template_and_no_answer_field(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", [{"q": "2+2?"}, {"q": "{x}"}])
  fields = Fields(prompt="q", answer=None, template="Example: \\boxed{4}\nQ: {prompt}\nA:")
  prompt_set = load_prompt_set(path, fields, _render, max_prompt_len=100)
  assert [r.prompt for r in prompt_set.rows] == ["2+2?", "{x}"]
  text = prompt_set[1].prompt_tokens.tobytes().decode("utf-32-le")
  assert text == "Example: \\boxed{4}\nQ: {x}\nA:" and prompt_set[1].answer is None


def test_parquet_matches_jsonl(tmp_path):
  rows = gsm8k_rows(10) + [{"question": "", "answer": "#### 3"}]
  from_jsonl = load_prompt_set(write_jsonl(tmp_path / "d.jsonl", rows), Fields(), _render, 300)
  from_parquet = load_prompt_set(write_parquet(tmp_path / "d.parquet", rows), Fields(), _render,
                                 300)
  assert len(from_parquet) == len(from_jsonl) == 10
  assert from_parquet.bad_rows == from_jsonl.bad_rows and from_parquet.bad_rows["empty"] == 1
  for a, b in zip(from_parquet.rows, from_jsonl.rows):
    assert a.row == b.row and a.answer == b.answer
    np.testing.assert_array_equal(a.prompt_tokens, b.prompt_tokens)


def test_no_usable_row_is_a_configuration_error(tmp_path):
  path = write_jsonl(tmp_path / "d.jsonl", gsm8k_rows(3))
  with pytest.raises(ValueError, match=r"(?s)no usable row.*missing_field: 3"):
    load_prompt_set(path, Fields(prompt="problem"), _render, 300)


@pytest.mark.parametrize("name, error", [("d.csv", ValueError), ("missing.jsonl",
                                                                  FileNotFoundError)])
def test_bad_paths(tmp_path, name, error):
  if name.endswith(".csv"):
    (tmp_path / name).write_text("a,b\n")
  with pytest.raises(error, match=name):
    load_prompt_set(tmp_path / name, Fields(), _render, 300)


@pytest.mark.parametrize("kwargs, knob", [
    ({"prompt": ""}, "Fields.prompt"), ({"answer": ""}, "Fields.answer"),
    ({"template": "no placeholder"}, "Fields.template")])
def test_bad_fields(kwargs, knob):
  with pytest.raises(ValueError, match=knob):
    Fields(**kwargs)


class _Identity:
  def __call__(self, index):
    return int(index)


def _take(iterator, n):
  return list(itertools.islice(iterator, n))


def test_pipeline_shuffles_per_epoch_and_seed():
  epochs = _take(iter(row_pipeline(10, _Identity(), seed=3, num_epochs=2)), 100)
  assert len(epochs) == 20
  assert sorted(epochs[:10]) == sorted(epochs[10:]) == list(range(10))
  assert epochs[:10] != epochs[10:]
  assert epochs[:10] == _take(iter(row_pipeline(10, _Identity(), seed=3)), 10)
  assert epochs[:10] != _take(iter(row_pipeline(10, _Identity(), seed=4)), 10)
  assert _take(iter(row_pipeline(10, _Identity(), seed=3, shuffle=False)), 4) == [0, 1, 2, 3]


def test_shards_partition_the_rows():
  shards = [_take(iter(row_pipeline(11, _Identity(), seed=0, shard_index=i, shard_count=3,
                                    num_epochs=1)), 100) for i in range(3)]
  assert sorted(itertools.chain(*shards)) == list(range(11))
  assert sorted(shards[1]) == [1, 4, 7, 10]


def test_state_is_plain_ints_and_resumes_exactly(tmp_path):
  iterator = iter(row_pipeline(7, _Identity(), seed=5, shard_index=1, shard_count=2))
  _take(iterator, 9)  # into the third epoch of this shard's 3 rows
  state = iterator.get_state()
  assert json.loads(json.dumps(state)) == state
  expected = _take(iterator, 12)
  fresh = iter(row_pipeline(7, _Identity(), seed=5, shard_index=1, shard_count=2))
  fresh.set_state(state)
  assert _take(fresh, 12) == expected
  # Through an orbax checkpoint, as a run saves it.
  iterator = iter(row_pipeline(7, _Identity(), seed=5))
  _take(iterator, 4)
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  checkpointer.save(tmp_path / "ckpt",
                    args=ocp.args.Composite(prompts=grain.checkpoint.CheckpointSave(iterator)))
  expected = _take(iterator, 10)
  fresh = iter(row_pipeline(7, _Identity(), seed=5))
  checkpointer.restore(tmp_path / "ckpt",
                       args=ocp.args.Composite(prompts=grain.checkpoint.CheckpointRestore(fresh)))
  assert _take(fresh, 10) == expected


@pytest.mark.parametrize("kwargs, knob", [
    ({"shard_count": 0}, "shard_count"), ({"shard_index": 2, "shard_count": 2}, "shard_index"),
    ({"shard_index": 5, "shard_count": 8}, "shard_index=5 has no rows"),
    ({"seed": -1}, "seed"), ({"num_epochs": 0}, "num_epochs")])
def test_bad_pipeline_arguments(kwargs, knob):
  with pytest.raises(ValueError, match=knob):
    row_pipeline(4, _Identity(), **{"seed": 0, **kwargs})


def test_reasons_are_the_documented_ones():
  assert datasets.BAD_ROW_REASONS == ("unreadable", "not_an_object", "missing_field", "not_text",
                                      "empty", "render_failed", "too_long")
