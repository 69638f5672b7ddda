"""Helpers of the elastic-fleet tests (processes and Ray): a run in a background thread driven
through `<run_dir>/fleet_control`, and the checks of its books and its fleet sizes."""

import contextlib
import json
import os
import threading
import time

from jaxrl_async.backends.fleet_control import CONTROL_FILE
from jaxrl_async.ledger import read_events
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from tests.backends.test_processes_backend import (
  GROUP_SIZE,
  RUN_TIMEOUT_S,
  quiet,
  server_pids,
  versions_done,
)


def check_books(run_dir, summary, config):
  """A clean audit; every group and every prompt consumed at most once over all lives."""
  assert summary["ledger/missing"] == 0 and summary["ledger/duplicates"] == 0
  assert summary["ledger/unknown"] == 0
  assert summary["ledger/consumed"] == summary["consumed_samples"] == config.total_samples
  events = read_events(os.path.join(run_dir, "ledger.jsonl"))
  groups = [g for e in events if e["event"] == "consumed" for g in e["groups"]]
  prompts = [p for e in events if e["event"] == "consumed" for p in e["prompts"]]
  assert len(groups) * GROUP_SIZE == config.total_samples
  assert len(set(groups)) == len(groups), "a group was consumed twice"
  assert len(set(prompts)) == len(prompts), "a prompt was drawn twice"
  with open(os.path.join(run_dir, "prompt_ledger.json"), encoding="utf-8") as f:
    started = json.load(f)["started"]
  assert len(set(started.values())) == len(started), "two groups of a life drew one prompt"
  return groups


def fleet_sizes(run_dir) -> list[int]:
  """`fleet/size` of every version record so far (a line being written is left for later)."""
  path = os.path.join(run_dir, "metrics.jsonl")
  with contextlib.suppress(ValueError):
    return [r["fleet/size"] for r in read_jsonl(path) if "fleet/size" in r]
  return []


class BackgroundRun:
  """`api.run(config, run_dir)` in a thread, sent fleet control commands while it runs."""

  def __init__(self, config, run_dir):
    self.run_dir = run_dir
    self.outcome = {}
    self.deadline = time.monotonic() + RUN_TIMEOUT_S
    self.runner = threading.Thread(target=self._body, args=(config,), name="elastic-run",
                                   daemon=True)
    self.runner.start()

  def _body(self, config) -> None:
    try:
      self.outcome["summary"] = api.run(config, str(self.run_dir), progress=False, log=quiet)
    except BaseException as error:  # raised by `finish`
      self.outcome["error"] = error

  def command(self, line: str, ready) -> None:
    """Writes `line` to the control file (whole, by a rename) once `ready()`, and waits for the
    fleet's heartbeat to take it."""
    while not ready():
      assert self.runner.is_alive(), f"the run ended before {line!r} could be sent: {self.outcome}"
      assert time.monotonic() < self.deadline, f"the run was not ready for {line!r}"
      time.sleep(0.05)
    control = os.path.join(self.run_dir, CONTROL_FILE)
    with open(control + ".tmp", "w", encoding="utf-8") as f:
      f.write(line + "\n")
    os.replace(control + ".tmp", control)
    while os.path.exists(control):  # read at the next heartbeat
      assert self.runner.is_alive(), f"the run ended with {line!r} unread: {self.outcome}"
      assert time.monotonic() < self.deadline, f"{line!r} was not read"
      time.sleep(0.05)

  def finish(self) -> dict:
    """The run's summary once it has ended (its error raised)."""
    self.runner.join(max(0.0, self.deadline - time.monotonic()))
    assert not self.runner.is_alive(), "the run did not finish"
    if "error" in self.outcome:
      raise self.outcome["error"]
    return self.outcome["summary"]


def grow_then_retire(run: BackgroundRun) -> None:
  """2 -> 3 servers (`add`, once 2 versions are done), then 3 -> 2 (`retire 0`, 2 versions
  after all three servers answered: rollout_servers.json names three)."""
  run.command("add", lambda: versions_done(run.run_dir) >= 2)
  grown = []  # the version at which all three servers had been started

  def three_servers_ran() -> bool:
    if not grown and len(server_pids(run.run_dir)) == 3:
      grown.append(versions_done(run.run_dir))
    return bool(grown) and versions_done(run.run_dir) >= grown[0] + 2

  run.command("retire 0", three_servers_ran)


def check_grown_and_shrunk(run_dir, summary, config) -> None:
  """The books of a `grow_then_retire` run: a clean ledger, sizes 2, 3, 2 in the records, the
  retired servers' reward pools counted, the re-issues counted under their reasons."""
  assert summary["fleet/adds"] == 1 and summary["fleet/retires"] == 1
  assert summary["num_rollout_servers"] == 2
  check_books(run_dir, summary, config)
  # every version's record names the fleet's size: 2, then 3 after the add, then 2 after the
  # retire (the versions left after it may all have been trained on groups queued before it)
  sizes = fleet_sizes(run_dir)
  assert sizes[0] == 2 and 3 in sizes and sizes[-1] == summary["fleet/size"] == 2, sizes
  assert sizes == [2] * sizes.index(3) + [3] * sizes.count(3) + [2] * (
      len(sizes) - sizes.index(3) - sizes.count(3)), sizes
  # the reward pools of the servers that left still count: every consumed sample was scored
  scored = sum(summary.get(f"reward/{outcome}", 0) for outcome in ("ok", "failed", "timeout"))
  assert scored >= summary["ledger/consumed"], (scored, summary["ledger/consumed"])
  # the re-issues are counted under their reasons (a paused server may hold no open group)
  assert {"runtime/reissued_groups/server_retired", "runtime/reissued_groups/fleet_resized",
          "runtime/reissued_samples/server_retired",
          "runtime/reissued_samples/fleet_resized"} <= set(summary)
