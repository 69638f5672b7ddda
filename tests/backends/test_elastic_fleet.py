"""An elastic 'processes' fleet: a run checkpointed with 2 rollout servers resumes with 3, then
with 1; a run adds a server and retires one through `<run_dir>/fleet_control`. Each ends with a
clean sample ledger, no group id and no prompt drawn twice."""

import contextlib
import json
import os
import threading
import time

import pytest

from jaxrl_async.backends.processes.fleet_control import CONTROL_FILE
from jaxrl_async.ledger import read_events
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from tests.backends.test_processes_backend import (
  GROUP_SIZE,
  RUN_TIMEOUT_S,
  no_orphans,  # noqa: F401 (the autouse fixture: no child process outlives a test)
  quiet,
  server_pids,
  small_config,
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


@pytest.mark.slow
def test_a_run_of_two_servers_resumes_with_three_then_with_one(tmp_path):
  lives = [(4, 2), (6, 3), (8, 1)]  # (versions, servers)
  drawn = []
  for life, (versions, servers) in enumerate(lives):
    config = small_config(versions, num_rollout_servers=servers, checkpoint_every_versions=2)
    logs = []
    summary = api.run(config, str(tmp_path), resume=life > 0, progress=False, log=logs.append)
    assert summary["policy_version"] == versions and summary["num_rollout_servers"] == servers
    if life:
      assert any(f"re-dealt to {servers}" in str(line) for line in logs), logs
    drawn = check_books(tmp_path, summary, config)
  sizes = fleet_sizes(tmp_path)
  assert sizes[:4] == [2] * 4 and sizes[4:6] == [3] * 2 and sizes[6:] == [1] * 2
  # the later lives' new groups are numbered above every id of the lives before them
  assert max(drawn) >= 4 * 2


@pytest.mark.slow
def test_a_server_added_and_one_retired_mid_run_leave_a_clean_ledger(tmp_path):
  # a tiny version takes tens of ms once the servers run, and a command is read at the next
  # heartbeat (1 s): enough versions that both commands land mid-run
  config = small_config(120, num_rollout_servers=2)
  outcome = {}

  def body():
    try:
      outcome["summary"] = api.run(config, str(tmp_path), progress=False, log=quiet)
    except BaseException as error:  # raised below
      outcome["error"] = error

  runner = threading.Thread(target=body, name="elastic-run", daemon=True)
  runner.start()
  deadline = time.monotonic() + RUN_TIMEOUT_S
  control = tmp_path / CONTROL_FILE

  def command(line: str, ready) -> None:
    while not ready():
      assert runner.is_alive(), f"the run ended before {line!r} could be sent: {outcome}"
      assert time.monotonic() < deadline, f"the run was not ready for {line!r}"
      time.sleep(0.05)
    (tmp_path / "control.tmp").write_text(line + "\n")
    os.replace(tmp_path / "control.tmp", control)
    while control.exists():  # read at the next heartbeat
      assert runner.is_alive() and time.monotonic() < deadline, outcome
      time.sleep(0.05)

  command("add", lambda: versions_done(tmp_path) >= 2)
  grown = []  # the version at which all three servers had been started

  def three_servers_ran() -> bool:
    if not grown and len(server_pids(tmp_path)) == 3:
      grown.append(versions_done(tmp_path))
    return bool(grown) and versions_done(tmp_path) >= grown[0] + 2

  command("retire 0", three_servers_ran)
  runner.join(RUN_TIMEOUT_S)
  assert not runner.is_alive(), "the run did not finish"
  if "error" in outcome:
    raise outcome["error"]
  summary = outcome["summary"]
  assert summary["fleet/adds"] == 1 and summary["fleet/retires"] == 1
  assert summary["num_rollout_servers"] == 2
  check_books(tmp_path, summary, config)
  # every version's record names the fleet's size: 2, then 3 after the add, then 2 after the
  # retire (the versions left after it may all have been trained on groups queued before it)
  sizes = fleet_sizes(tmp_path)
  assert sizes[0] == 2 and 3 in sizes and sizes[-1] == summary["fleet/size"] == 2, sizes
  assert sizes == [2] * sizes.index(3) + [3] * sizes.count(3) + [2] * (
      len(sizes) - sizes.index(3) - sizes.count(3)), sizes
  # the reward pools of the servers that left still count: every consumed sample was scored
  scored = sum(summary.get(f"reward/{outcome}", 0) for outcome in ("ok", "failed", "timeout"))
  assert scored >= summary["ledger/consumed"], (scored, summary["ledger/consumed"])
  # the re-issues are counted under their reasons (a paused server may hold no open group)
  assert {"runtime/reissued_groups/server_retired",
          "runtime/reissued_groups/fleet_resized"} <= set(summary)
