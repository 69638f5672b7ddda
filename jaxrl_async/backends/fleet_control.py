"""The command file that adds and retires rollout servers of a running run ('processes' and
'ray' backends).

`<run_dir>/fleet_control` holds one command a line: `add` (one more server) or `retire K`
(server K of the current fleet leaves). The fleet reads the file at its heartbeat (not while
paused for a checkpoint or an evaluation), removes it and applies its lines together as one
change of the fleet's shape (`backends.elastic.Elastic.reshape`). A
line it cannot apply is named in the run's log and ignored; nothing else changes for it.
Write the file whole (write another name, then rename it onto `fleet_control`) so that a
heartbeat never reads half a line.
"""

from __future__ import annotations

import os

CONTROL_FILE = "fleet_control"


def parse(text: str, num_servers: int) -> tuple[int, list[int], list[str]]:
  """(servers to add, servers to retire, problems) of a control file's `text` for a fleet of
  `num_servers`; a line with a problem is left out and named."""
  adds, retires, problems = 0, [], []
  for raw in text.splitlines():
    words = raw.split()
    if not words or words[0].startswith("#"):
      continue
    if words == ["add"]:
      adds += 1
    elif len(words) == 2 and words[0] == "retire" and words[1].isdigit():
      index = int(words[1])
      if index >= num_servers:
        problems.append(f"{raw.strip()!r}: the fleet has servers 0 .. {num_servers - 1}")
      elif index in retires:
        problems.append(f"{raw.strip()!r}: server {index} is already retired by this file")
      else:
        retires.append(index)
    else:
      problems.append(f"{raw.strip()!r}: not 'add' or 'retire <server index>'")
  if retires and num_servers - len(retires) + adds < 1:
    problems.append(f"retiring {retires} would leave no rollout server: not applied")
    retires = []
  return adds, retires, problems


def take(path: str) -> str | None:
  """The control file's text, the file removed; None when there is none. The file is renamed
  before it is read, so a command renamed onto `path` meanwhile waits for the next heartbeat
  instead of being removed unread."""
  taken = path + ".taken"
  try:
    os.replace(path, taken)
  except FileNotFoundError:
    return None
  with open(taken, encoding="utf-8") as f:
    text = f.read()
  os.remove(taken)
  return text


def read(path: str | None, num_servers: int, log=print) -> tuple[int, list[int]]:
  """(servers to add, servers to retire) of the control file at `path` for a fleet of
  `num_servers`, the file taken (`take`) and each line that cannot be applied logged; (0, [])
  when there is no file."""
  text = None if path is None else take(path)
  if text is None:
    return 0, []
  adds, retires, problems = parse(text, num_servers)
  for problem in problems:
    log(f"{CONTROL_FILE}: ignored {problem}")
  return adds, retires
