"""The processes backend's learner (main) process is SIGKILLed right after its second checkpoint
(`checkpoint.after_write=kill@2`): its rollout-server children must end with it, and
`--resume` must finish the run with every group consumed once and every version logged once."""

from __future__ import annotations

import json
import os
import time

import pytest

from jaxrl_async import ledger as ledger_lib
from jaxrl_async.metrics import read_jsonl
from tests import run_lives

NUM_VERSIONS = 8
GROUP_SIZE = 4
BINDINGS = run_lives.TINY_BINDINGS + (
    "RunConfig.backend = 'processes'",
    "RunConfig.num_rollout_servers = 2",
    "RunConfig.heartbeat_timeout_s = 10.0",
    f"RunConfig.total_samples = {NUM_VERSIONS * 2 * GROUP_SIZE}",
    "RunConfig.checkpoint_every_versions = 2",
    "RunConfig.eval_every_versions = 100",
)
ORPHAN_TIMEOUT_S = 15.0


def _running(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except (FileNotFoundError, ProcessLookupError):
    return False


def _server_pids(run_dir) -> list[int]:
  with open(os.path.join(run_dir, "rollout_servers.json"), encoding="utf-8") as f:
    return [s["pid"] for s in json.load(f)["servers"]]


def kill_learner_then_resume(run_dir, bindings, env=None) -> None:
  """The learner process is SIGKILLed right after its second checkpoint; its rollout servers
  must end with it, and `--resume` must finish the run with every group and prompt consumed
  once, none both consumed and dropped, and every version logged once. `env`: more
  environment variables for both lives."""
  first = run_lives.start(run_dir, "gin/modes/async_partial.gin", bindings,
                          faults_plan="checkpoint.after_write=kill@2", env=env)
  code, out, err, _ = run_lives.finish(first, 600)
  assert code == -9, f"the first life was not killed ({code}):\n{out[-2000:]}\n{err[-4000:]}"
  pids = _server_pids(run_dir)
  assert len(pids) == 2
  deadline = time.monotonic() + ORPHAN_TIMEOUT_S
  while any(_running(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(_running(p) for p in pids), (
      f"rollout servers {[p for p in pids if _running(p)]} outlived the killed learner")

  second = run_lives.start(run_dir, "gin/modes/async_partial.gin", bindings, resume=True,
                           env=env)
  code, out, err, _ = run_lives.finish(second, 600)
  assert code == 0, f"the resumed life failed ({code}):\n{out[-2000:]}\n{err[-4000:]}"
  assert "at policy_version 4" in out + err
  with open(run_dir / "summary.json", encoding="utf-8") as f:
    summary = json.load(f)
  assert summary["policy_version"] == NUM_VERSIONS
  assert summary["consumed_samples"] == NUM_VERSIONS * 2 * GROUP_SIZE
  events = ledger_lib.read_events(run_dir / ledger_lib.LEDGER_FILE)
  consumed = [e for e in events if e["event"] == "consumed"]
  groups = [g for e in consumed for g in e["groups"]]
  prompts = [p for e in consumed for p in e["prompts"]]
  assert len(groups) * GROUP_SIZE == summary["consumed_samples"]
  assert len(set(groups)) == len(groups), "a group was consumed twice across the two lives"
  assert len(set(prompts)) == len(prompts), "a prompt was consumed twice across the two lives"
  dropped = {tuple(s) for e in events if e["event"] == "dropped" for s in e["samples"]}
  assert not {g for g, _ in dropped} & set(groups), "a sample was both consumed and dropped"
  versions = [r["policy_version"] for r in read_jsonl(run_dir / "metrics.jsonl")
              if "algo/version_gap_max" in r]
  assert versions == list(range(1, NUM_VERSIONS + 1))
  # The whole run's books, both lives: every sample of every group a server drew is consumed
  # once or dropped once under its reason (the resumed life's audit, and the ledger read here).
  run_lives.check_books(run_lives.books(run_dir), NUM_VERSIONS)


@pytest.mark.slow
@pytest.mark.timeout(1500)  # above both lives' own bounds (600 s each): a slow life reports itself
def test_a_sigkilled_learner_process_leaves_no_server_and_resumes(tmp_path):
  kill_learner_then_resume(tmp_path / "run", BINDINGS)
