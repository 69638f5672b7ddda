"""What every benchmark shares: one JSON line on stdout, optionally also written to a file."""

import json
import os


def emit_json_line(record: dict, out: str | None = None) -> str:
  line = json.dumps(record)
  print(line)
  if out:
    with open(out, "w", encoding="utf-8") as f:
      f.write(line + "\n")
  return line


def emit_result(record: dict, out_stem: str | None = None) -> int:
  """Prints `record` as one JSON line and, with `out_stem`, writes it (indented) to
  <out_stem>.json; numpy scalars become floats. Returns 0, a benchmark's exit code."""
  if out_stem:
    os.makedirs(os.path.dirname(out_stem) or ".", exist_ok=True)
    with open(out_stem + ".json", "w", encoding="utf-8") as f:
      json.dump(record, f, indent=1, default=float)
  print(json.dumps(record, default=float))
  return 0
