"""`jaxrl-async COMMAND ...`: train (more commands come with their launch scripts)."""

from __future__ import annotations

import sys

COMMANDS = ("train", "serve", "report", "sweep", "simulate", "replay")


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
    print(f"usage: jaxrl-async {{{','.join(COMMANDS)}}} [options]  (jaxrl-async train --help)",
          file=sys.stderr)
    return 0 if argv and argv[0] in ("-h", "--help") else 2
  if argv[0] == "train":
    from launch import train
    return train.main(argv[1:])
  if argv[0] == "serve":
    from launch import serve
    return serve.main(argv[1:])
  if argv[0] == "report":
    from jaxrl_async import report
    return report.main(argv[1:])
  if argv[0] == "sweep":
    from launch import sweep
    return sweep.main(argv[1:])
  if argv[0] == "replay":
    from launch import replay
    return replay.main(argv[1:])
  if argv[0] == "simulate":
    from launch import simulate
    return simulate.main(argv[1:])
  return 2


if __name__ == "__main__":
  sys.exit(main())
