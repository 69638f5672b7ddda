"""What every benchmark shares: one JSON line on stdout, optionally also written to a file."""

import json


def emit_json_line(record: dict, out: str | None = None) -> str:
  line = json.dumps(record)
  print(line)
  if out:
    with open(out, "w", encoding="utf-8") as f:
      f.write(line + "\n")
  return line
