"""Runs `python -m launch.train` as a subprocess, life after life, and checks a finished run's
books: the sample ledger, the metrics' versions and the summary. Shared by the chaos and hang
tests."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

from jaxrl_async import ledger as ledger_lib
from jaxrl_async.backends import base as fleet
from jaxrl_async.metrics import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small and fast: the same shape of run as the default, on a short task and warm start.
TINY_BINDINGS = (
    "DigitReverseTask.max_len = 8",
    "WarmStartConfig.steps = 20",
    "WarmStartConfig.batch_size = 16",
    "RunConfig.group_size = 4",
    "RunConfig.mini_batch_size = 2",
    "RunConfig.max_concurrent_decodes = 8",
    "RunConfig.eval_size = 16",
)


def command(run_dir, gin_file, bindings, *, resume=False):
  argv = [sys.executable, "-m", "launch.train", "--gin_file", gin_file, "--run_dir",
          str(run_dir), "--no_progress"]
  for binding in bindings:
    argv += ["--gin_bindings", binding]
  return argv + (["--resume"] if resume else [])


# A tiny run's programs are compiled without XLA's optimisation passes: most of a tiny
# program's compile time, and no slower to run at these shapes (100 versions: the same time).
# JAXRL_ASYNC_TEST_XLA_OPT=1 keeps them on (tests/conftest.py).
TINY_ENV = ({} if os.environ.get("JAXRL_ASYNC_TEST_XLA_OPT")
            else {"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"})


def environment(faults_plan: str | None = None, *, tiny: bool = False) -> dict:
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
  env.pop("JAXRL_ASYNC_FAULTS", None)
  if faults_plan:
    env["JAXRL_ASYNC_FAULTS"] = faults_plan
  return {**env, **(TINY_ENV if tiny else {})}


def start(run_dir, gin_file, bindings, *, resume=False, faults_plan=None, env=None):
  """`env`: more environment variables for the life (e.g. RAY_ADDRESS). A run with every
  TINY_BINDINGS is a tiny run (`environment`'s `tiny`)."""
  tiny = set(TINY_BINDINGS) <= set(bindings)
  return subprocess.Popen(command(run_dir, gin_file, bindings, resume=resume), cwd=ROOT,
                          env={**environment(faults_plan, tiny=tiny), **(env or {})},
                          stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def reap(procs, timeout_s: float) -> list:
  """Waits for every (process, log file) pair, each at most `timeout_s`; kills the ones still
  running and closes the logs. Returns the exit codes of those that ended in time."""
  codes = []
  try:
    for proc, _ in procs:
      codes.append(proc.wait(timeout=timeout_s))
  finally:
    for proc, log in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
      log.close()
  return codes


def finish(process, timeout_s: float):
  """(returncode, stdout, stderr, seconds waited); a process past the timeout is killed."""
  began = time.monotonic()
  try:
    out, err = process.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    process.kill()
    out, err = process.communicate()
    return None, out, err, time.monotonic() - began
  return process.returncode, out, err, time.monotonic() - began


# Where a kill lands, per point: hit counts that land some tens of versions into a life.
KILL_HITS = {
    "checkpoint.before_write": (1, 3),
    "checkpoint.after_write": (1, 3),
    "buffer.get_groups": (5, 80),
    "learner.take_publish": (5, 60),
    "sync.publish": (5, 60),
    "rollout.decode_step": (100, 1500),
    "reward.call": (300, 4000),
}
# The same points on a tiny run (8 or 16 samples a version, short answers): every kill lands
# within a few tens of versions of a life's start, so 3 kills fit in a run of 150 versions.
TINY_KILL_HITS = {**KILL_HITS, "buffer.get_groups": (5, 40), "learner.take_publish": (5, 30),
                  "sync.publish": (5, 30), "rollout.decode_step": (20, 200),
                  "reward.call": (20, 200)}
SYNC_POINTS = ("checkpoint.before_write", "checkpoint.after_write", "buffer.get_groups",
               "sync.publish", "rollout.decode_step", "reward.call")


def chaos(run_dir, gin_file, bindings, *, kills: int, seed: int, points, kill_hits=None,
          life_timeout_s=900, first_life_timeout_s=2400, max_lives: int | None = None,
          log=print) -> dict:
  """Kills the run with SIGKILL (a fault plan per life) until `kills` kills have happened,
  resuming after each, then lets it finish. `kill_hits`: point -> (lo, hi) hit counts where
  a kill lands (default KILL_HITS). Returns what happened."""
  kill_hits = kill_hits or KILL_HITS
  rng = random.Random(seed)
  history, killed = [], 0
  max_lives = max_lives or 4 * kills + 4
  for life in range(max_lives):
    plan = None
    if killed < kills:
      point = rng.choice(points)
      plan = f"{point}=kill@{rng.randint(*kill_hits[point])}"
    process = start(run_dir, gin_file, bindings, resume=life > 0, faults_plan=plan)
    # The first life also makes the base policy (the warm start) unless it is cached.
    code, out, err, seconds = finish(process, first_life_timeout_s if life == 0
                                     else life_timeout_s)
    history.append({"life": life, "plan": plan, "returncode": code, "seconds": round(seconds)})
    log(f"chaos seed {seed} life {life}: plan {plan} -> returncode {code} in {seconds:.0f} s")
    if code == -9 and plan is not None:
      killed += 1
      continue
    if code != 0:
      raise AssertionError(f"chaos seed {seed} life {life} ({plan}) ended with {code}:\n"
                           f"{out[-3000:]}\n{err[-6000:]}")
    if killed >= kills:
      return {"seed": seed, "kills": killed, "lives": history}
    # It finished before the planned kills (a kill point set past the run's end): too short
    raise AssertionError(f"chaos seed {seed}: the run finished after {killed} of {kills} kills")
  raise AssertionError(f"chaos seed {seed}: no finish within {max_lives} lives: {history}")


def books(run_dir) -> dict:
  """A finished run's accounting, from its files: ledger audit, versions, summary."""
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  events = ledger_lib.read_events(os.path.join(run_dir, ledger_lib.LEDGER_FILE))
  if "rollout/next_group_ids" in summary:  # rollout servers, each numbering its own groups
    groups = fleet.produced_groups(summary["rollout/next_group_ids"])
  else:
    groups = range(int(summary["rollout/next_group_id"]))
  group_size = int(summary["ledger/produced"]) // max(len(groups), 1)
  audit = ledger_lib.audit(events, groups=groups, group_size=group_size)
  records = read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
  version_records = [r["policy_version"] for r in records if "result/reward_mean" in r]
  eval_records = [r["policy_version"] for r in records
                  if "eval/accuracy" in r and "result/reward_mean" not in r]
  consumed_groups = [g for e in events if e["event"] == "consumed" for g in e["groups"]]
  return {"summary": summary, "audit": audit, "events": events,
          "version_records": version_records,
          "eval_records": eval_records, "consumed_groups": consumed_groups,
          "figures": {"produced": audit["produced"], "consumed": audit["consumed"],
                      "dropped": audit["dropped"], "missing": len(audit["missing"]),
                      "duplicates": len(audit["duplicates"]),
                      "accuracy": summary.get("eval/accuracy")}}


def missing_context(report: dict) -> str:
  """Where the lost samples' groups were seen: the ledger events that name them, and the
  summary's rollout and queue figures (to say, the next time a sample is lost, where)."""
  groups = {int(g) for g, _ in report["audit"]["missing"][:20]}
  events = [e for e in report["events"]
            if set(e.get("groups", [])) & groups
            or any(int(g) in groups for g, _ in e.get("samples", []))]
  figures = {k: v for k, v in report["summary"].items()
             if k.startswith(("rollout/", "queue/", "runtime/", "ledger/"))}
  return f"events naming those groups: {events}\nsummary: {figures}"


def check_books(report: dict, num_versions: int) -> None:
  audit = report["audit"]
  assert audit["missing"] == [], (f"lost samples: {audit['missing'][:20]}\n"
                                  f"{missing_context(report)}")
  assert audit["duplicates"] == [], f"samples counted twice: {audit['duplicates'][:20]}"
  assert audit["unknown"] == [], audit["unknown"][:20]
  assert len(report["consumed_groups"]) == len(set(report["consumed_groups"]))
  assert report["version_records"] == list(range(1, num_versions + 1))
  assert len(report["eval_records"]) == len(set(report["eval_records"]))
  summary = report["summary"]
  assert summary["ledger/missing"] == 0 and summary["ledger/duplicates"] == 0
  assert audit["consumed"] == summary["consumed_samples"]
