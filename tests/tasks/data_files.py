"""Small GSM8K-format dataset files for tests."""

from __future__ import annotations

import json
import pathlib

import numpy as np


def gsm8k_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
  """Rows shaped like GSM8K's: a word problem and a worked answer ending in '#### <number>'."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    a, b = (int(x) for x in rng.integers(2, 60, size=2))
    rows.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he "
                             f"have now?",
                 "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"})
  return rows


def write_jsonl(path: pathlib.Path, rows: list) -> pathlib.Path:
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write((row if isinstance(row, str) else json.dumps(row, ensure_ascii=False)) + "\n")
  return path


def write_parquet(path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
  import pyarrow as pa
  import pyarrow.parquet as pq

  pq.write_table(pa.Table.from_pylist(rows), path)
  return path
