"""Prompts from dataset files (JSONL or Parquet) through a grain pipeline.

A file is read and checked once, when a task is made: each row's prompt (and answer) is taken
from the fields named in `Fields`, written into the prompt template, rendered (with the chat
template, by the task) and tokenized. A row that cannot be used is counted under a reason of
BAD_ROW_REASONS, with its row number among the first few examples, and reported
(`PromptSet.report()`, `PromptSet.metrics()`): never a crash, never a silent gap. The counts are
a pure function of the file and the settings, so a resumed run reports the same ones.

The pipeline is a range over the good rows, so its state is one position:

  MapDataset.range(n)[shard_index::shard_count] -> shuffle(seed) -> map(row -> Problem)
      -> repeat(num_epochs) -> to_iter_dataset

`iterator.get_state()` is grain's dict of plain ints; `set_state` on a fresh iterator of the same
pipeline continues with the exact next problem. Each rollout server takes its own shard (rows
shard_index, shard_index + shard_count, ...), so servers never issue the same row in an epoch.
Parquet needs pyarrow (the `data` extra).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

BAD_ROW_REASONS = ("unreadable", "not_an_object", "missing_field", "not_text", "empty",
                   "render_failed", "too_long")
SUFFIXES = {".jsonl": "jsonl", ".parquet": "parquet"}
_EXAMPLES_PER_REASON = 3


@dataclasses.dataclass(frozen=True)
class Fields:
  """Which fields of a row make a prompt, and how it is written.

  prompt: the field with the question text.
  answer: the field the reward checks against (None: the task has no reference answer).
  system_prompt: a system message (None: none).
  template: the user message; '{prompt}' is replaced by the prompt field (other braces are
    left as they are, so few-shot examples with `\\boxed{...}` can be written in it).
  """

  prompt: str = "question"
  answer: str | None = "answer"
  system_prompt: str | None = None
  template: str = "{prompt}"

  def __post_init__(self):
    if not isinstance(self.prompt, str) or not self.prompt:
      raise ValueError(f"Fields.prompt must be a non-empty field name, got {self.prompt!r}")
    if self.answer is not None and (not isinstance(self.answer, str) or not self.answer):
      raise ValueError(f"Fields.answer must be a field name or None, got {self.answer!r}")
    if not isinstance(self.template, str) or "{prompt}" not in self.template:
      raise ValueError(f"Fields.template must contain '{{prompt}}', got {self.template!r}")

  def user_message(self, prompt: str) -> str:
    return self.template.replace("{prompt}", prompt)


@dataclasses.dataclass(frozen=True)
class PromptRow:
  """A good row: `row` is its 0-based position in the file (line number - 1 for JSONL)."""

  row: int
  prompt: str
  prompt_tokens: np.ndarray
  answer: str | None


def file_format(path: str | os.PathLike) -> str:
  suffix = pathlib.Path(path).suffix.lower()
  if suffix not in SUFFIXES:
    raise ValueError(f"dataset file {str(path)!r} must end in one of {sorted(SUFFIXES)} "
                     f"(JSON lines or Parquet), got {suffix!r}")
  return SUFFIXES[suffix]


def read_rows(path: str | os.PathLike) -> list[Any]:
  """The file's rows in order. A JSONL line that is not JSON is kept as a `ValueError` (so it
  is counted, not lost); a blank line is not a row."""
  if not pathlib.Path(path).exists():
    raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
  if file_format(path) == "parquet":
    try:
      import pyarrow.parquet as pq
    except ImportError as error:
      raise ImportError("Parquet files need pyarrow: pip install 'jaxrl_async[data]'") from error
    return pq.read_table(path).to_pylist()
  rows: list[Any] = []
  with open(path, encoding="utf-8", errors="replace") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        rows.append(json.loads(line))
      except ValueError as error:
        rows.append(ValueError(f"line {number}: {error}"))
  return rows


def _text(value: Any) -> str | None:
  """A field's value as text: strings as they are, numbers written out (a Parquet answer column
  is often an int); anything else is not text."""
  if isinstance(value, str):
    return value
  if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    return str(value)
  return None


class PromptSet:
  """The good rows of a file and the counts of the bad ones."""

  def __init__(self, path: str | os.PathLike, rows: Sequence[PromptRow],
               bad_rows: dict[str, int], examples: dict[str, list[str]], num_read: int):
    self.path = str(path)
    self.rows = list(rows)
    self.bad_rows = {reason: int(bad_rows.get(reason, 0)) for reason in BAD_ROW_REASONS}
    self.examples = {reason: list(v) for reason, v in examples.items()}
    self.num_read = int(num_read)

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> PromptRow:
    return self.rows[index]

  @property
  def num_bad(self) -> int:
    return sum(self.bad_rows.values())

  def metrics(self, prefix: str = "data") -> dict[str, float]:
    """`<prefix>/rows`, `<prefix>/bad_rows` and `<prefix>/bad_rows/<reason>` for each reason."""
    out = {f"{prefix}/rows": float(len(self.rows)), f"{prefix}/bad_rows": float(self.num_bad)}
    out.update({f"{prefix}/bad_rows/{r}": float(n) for r, n in self.bad_rows.items()})
    return out

  def report(self) -> str:
    """One line per reason with a count, with the first row numbers and what was wrong."""
    lines = [f"{self.path}: {len(self.rows)} of {self.num_read} rows used, {self.num_bad} bad"]
    for reason, count in self.bad_rows.items():
      if count:
        lines.append(f"  {reason}: {count} (e.g. {'; '.join(self.examples.get(reason, []))})")
    return "\n".join(lines)


def load_prompt_set(path: str | os.PathLike, fields: Fields,
                    render: Callable[[str], np.ndarray], max_prompt_len: int) -> PromptSet:
  """Reads and checks every row; `render(user_message) -> token ids` makes the prompt.

  Raises ValueError only when no row at all is usable (a wrong field name, say), with the counts
  and examples, since nothing could be trained.
  """
  if not isinstance(max_prompt_len, int) or max_prompt_len < 1:
    raise ValueError(f"max_prompt_len must be an int >= 1, got {max_prompt_len!r}")
  bad: collections.Counter = collections.Counter()
  examples: dict[str, list[str]] = collections.defaultdict(list)

  def count(reason: str, row: int, detail: str) -> None:
    bad[reason] += 1
    if len(examples[reason]) < _EXAMPLES_PER_REASON:
      examples[reason].append(f"row {row}: {detail}")

  raw_rows = read_rows(path)
  good = []
  for row, record in enumerate(raw_rows):
    if isinstance(record, ValueError):
      count("unreadable", row, str(record)[:120])
      continue
    if not isinstance(record, dict):
      count("not_an_object", row, f"a JSON {type(record).__name__}")
      continue
    wanted = [fields.prompt] + ([fields.answer] if fields.answer is not None else [])
    missing = [name for name in wanted if record.get(name) is None]
    if missing:
      count("missing_field", row, f"no {missing[0]!r} (has {sorted(record)[:8]})")
      continue
    prompt, answer = _text(record[fields.prompt]), None
    if fields.answer is not None:
      answer = _text(record[fields.answer])
    if prompt is None or (fields.answer is not None and answer is None):
      name = fields.prompt if prompt is None else fields.answer
      count("not_text", row, f"{name!r} is a {type(record[name]).__name__}")
      continue
    if not prompt.strip() or (answer is not None and not answer.strip()):
      count("empty", row, f"{fields.prompt if not prompt.strip() else fields.answer!r} is empty")
      continue
    try:  # e.g. a lone surrogate the tokenizer refuses, or a template that rejects the text
      tokens = np.asarray(render(fields.user_message(prompt)), np.int32).reshape(-1)
    except (ValueError, TypeError) as error:
      count("render_failed", row, f"{type(error).__name__}: {error}"[:120])
      continue
    if tokens.size > max_prompt_len:
      count("too_long", row, f"{tokens.size} tokens > max_prompt_len={max_prompt_len}")
      continue
    good.append(PromptRow(row=row, prompt=prompt, prompt_tokens=tokens, answer=answer))
  prompt_set = PromptSet(path, good, dict(bad), dict(examples), len(raw_rows))
  if not good:
    raise ValueError(f"no usable row in {str(path)!r} with {fields}:\n{prompt_set.report()}")
  return prompt_set


def check_shard(shard_index: int, shard_count: int) -> None:
  if not isinstance(shard_count, int) or shard_count < 1:
    raise ValueError(f"shard_count must be an int >= 1, got {shard_count!r}")
  if not isinstance(shard_index, int) or not 0 <= shard_index < shard_count:
    raise ValueError(f"shard_index must be an int in [0, shard_count={shard_count}), got "
                     f"{shard_index!r}")


def row_pipeline(num_rows: int, problem_at: Callable[[int], Any], *, seed: int,
                 shuffle: bool = True, shard_index: int = 0, shard_count: int = 1,
                 num_epochs: int | None = None,
                 read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
  """An IterDataset of `problem_at(i)` over this shard's rows (see the module docstring).

  problem_at must pickle (a class instance, not a lambda) for grain's worker processes.
  """
  check_shard(shard_index, shard_count)
  if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**32:
    raise ValueError(f"seed must be an int in [0, 2**32 - 1], got {seed!r}")
  if num_epochs is not None and (not isinstance(num_epochs, int) or num_epochs < 1):
    raise ValueError(f"num_epochs must be None or an int >= 1, got {num_epochs!r}")
  if num_rows <= shard_index:
    raise ValueError(f"shard_index={shard_index} has no rows: the split has only {num_rows} "
                     f"rows for shard_count={shard_count} shards")
  indices = grain.MapDataset.range(int(num_rows))[shard_index::shard_count]
  if shuffle:
    indices = indices.shuffle(seed=int(seed))
  problems = indices.map(problem_at).repeat(num_epochs)
  return problems.to_iter_dataset(
      read_options or grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
