"""Sweep: run a sweep file's trials locally, N at a time, each in its own run directory.

    jaxrl-async sweep launch/sweeps/staleness_x_trigger.py --parallel 2
    jaxrl-async sweep launch/sweeps/staleness_x_trigger.py --rerun_failed   # after a crash

A sweep file is Python that defines (see launch/sweeps/staleness_x_trigger.py):
  TRIALS      a list of {gin binding: value} dicts, built with launch.hyper (sweep, product,
              zipit, chainit, fixed), or a function `trials()` returning one;
  GIN_FILES   the gin files of every trial (default: the default of `jaxrl-async train`);
  BINDINGS    bindings of every trial (optional), applied before the trial's own;
  NAME        the sweep's name (default: the file's name), the folder under --root.
Each trial runs `python -m launch.train` in <root>/<NAME>/<trial>/ with its output in train.log
and its state in trial.json. Run again, the sweep skips finished trials (summary.json written),
reports crashed ones and re-runs them with --rerun_failed (from their latest checkpoint when they
have one). At the end it prints the summary table and writes summary.md and summary.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
POLL_S = 0.5
STOP_TIMEOUT_S = 60.0
COLUMNS = (("trial", "trial"), ("status", "status"), ("eval/accuracy", "final accuracy"),
           ("system/samples_per_s", "samples/s"), ("stale_ratio", "stale ratio"),
           ("system/wall_s", "train wall-clock s"), ("process_s", "process s"))


@dataclasses.dataclass
class Sweep:
  name: str
  gin_files: list[str]
  bindings: list[str]
  trials: list[dict]


def gin_value(value) -> str:
  """A Python value as a gin literal (gin parses Python literals; strings keep their quotes)."""
  if isinstance(value, str) and value.startswith("@"):
    return value  # a configurable reference
  return repr(value)


def trial_bindings(trial: dict) -> list[str]:
  return [f"{name} = {gin_value(value)}" for name, value in trial.items()]


def trial_name(index: int, trial: dict) -> str:
  """e.g. '001-staleness_threshold=0.5,trigger_parameter_sync_step=2'."""
  parts = [f"{name.rsplit('.', 1)[-1]}={value}" for name, value in trial.items()]
  return re.sub(r"[^A-Za-z0-9_.,=+-]", "_", f"{index:03d}-" + ",".join(parts))[:200]


def load_sweep(path: str) -> Sweep:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"sweep file {path!r} not found")
  spec = importlib.util.spec_from_file_location("jaxrl_async_sweep_file", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  trials = getattr(module, "TRIALS", None)
  if trials is None and callable(getattr(module, "trials", None)):
    trials = module.trials()
  if trials is None:
    raise ValueError(f"{path} defines neither TRIALS nor trials()")
  trials = [dict(trial) for trial in trials]
  if not trials:
    raise ValueError(f"{path}: the sweep has no trials")
  for trial in trials:
    if not trial or not all(isinstance(name, str) for name in trial):
      raise ValueError(f"{path}: each trial must be a non-empty dict of gin binding names, "
                       f"got {trial!r}")
  from launch.train import DEFAULT_GIN
  return Sweep(name=getattr(module, "NAME", pathlib.Path(path).stem),
               gin_files=list(getattr(module, "GIN_FILES", [DEFAULT_GIN])),
               bindings=list(getattr(module, "BINDINGS", [])), trials=trials)


# ---- one trial's state on disk ----------------------------------------------------------------
def read_state(run_dir: str) -> dict:
  path = os.path.join(run_dir, "trial.json")
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_state(run_dir: str, state: dict) -> None:
  with open(os.path.join(run_dir, "trial.json.tmp"), "w", encoding="utf-8") as f:
    json.dump(state, f, indent=1, sort_keys=True)
  os.replace(os.path.join(run_dir, "trial.json.tmp"), os.path.join(run_dir, "trial.json"))


def status_of(run_dir: str) -> str:
  """'done' | 'failed' (exited non-zero, or stopped while running) | 'new'."""
  state = read_state(run_dir)
  if os.path.isfile(os.path.join(run_dir, "summary.json")) and state.get("status") == "done":
    return "done"
  return "failed" if state else "new"


def has_checkpoint(run_dir: str) -> bool:
  directory = os.path.join(run_dir, "checkpoints")
  return os.path.isdir(directory) and any(name.isdigit() for name in os.listdir(directory))


def set_aside(run_dir: str) -> str:
  """A failed attempt without a checkpoint moves to <run_dir>.failed-<n>; a fresh run follows."""
  n = 1
  while os.path.exists(f"{run_dir}.failed-{n}"):
    n += 1
  shutil.move(run_dir, f"{run_dir}.failed-{n}")
  return f"{run_dir}.failed-{n}"


class Trial:
  """One subprocess `python -m launch.train` and its run directory."""

  def __init__(self, sweep: Sweep, index: int, trial: dict, root: str, extra: list[str]):
    self.name = trial_name(index, trial)
    self.run_dir = os.path.join(root, self.name)
    self.trial = trial
    self.bindings = [*sweep.bindings, *trial_bindings(trial), *extra]
    self.gin_files = sweep.gin_files
    self.process = None
    self.began = 0.0

  def command(self, resume: bool) -> list[str]:
    command = [sys.executable, "-m", "launch.train", "--run_dir", self.run_dir, "--no_progress"]
    for gin_file in self.gin_files:
      command += ["--gin_file", gin_file]
    for binding in self.bindings:
      command += ["--gin_bindings", binding]
    return command + (["--resume"] if resume else [])

  def start(self, log) -> None:
    resume = False
    if os.path.isdir(self.run_dir):
      if has_checkpoint(self.run_dir):
        resume = True
      else:
        log(f"{self.name}: no checkpoint; earlier attempt moved to {set_aside(self.run_dir)}")
    os.makedirs(self.run_dir, exist_ok=True)
    previous = read_state(self.run_dir)
    command = self.command(resume)
    write_state(self.run_dir, {"trial": self.trial, "bindings": self.bindings,
                               "gin_files": self.gin_files, "command": command,
                               "status": "running", "attempts": previous.get("attempts", 0) + 1,
                               "process_s": previous.get("process_s", 0.0)})
    self.began = time.monotonic()
    with open(os.path.join(self.run_dir, "train.log"), "a", encoding="utf-8") as out:
      self.process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL)
    log(f"{self.name}: started{' (resuming)' if resume else ''}")

  def finish(self, returncode: int, log) -> None:
    state = read_state(self.run_dir)
    state["returncode"] = returncode
    state["process_s"] = state.get("process_s", 0.0) + time.monotonic() - self.began
    done = returncode == 0 and os.path.isfile(os.path.join(self.run_dir, "summary.json"))
    state["status"] = "done" if done else "failed"
    write_state(self.run_dir, state)
    log(f"{self.name}: {state['status']} (exit {returncode}, {state['process_s']:.0f} s)"
        + ("" if done else f"; see {os.path.join(self.run_dir, 'train.log')}"))


def run_trials(pending: list[Trial], parallel: int, log) -> None:
  """Runs the trials, at most `parallel` at once; Ctrl-C stops them (they checkpoint)."""
  queue, running = list(pending), []
  try:
    while queue or running:
      while queue and len(running) < parallel:
        trial = queue.pop(0)
        trial.start(log)
        running.append(trial)
      time.sleep(POLL_S)
      for trial in list(running):
        if trial.process.poll() is not None:
          trial.finish(trial.process.returncode, log)
          running.remove(trial)
  except KeyboardInterrupt:
    log("interrupted: stopping the running trials")
    for trial in running:
      trial.process.send_signal(2)  # SIGINT: the trial saves a checkpoint and exits
    for trial in running:
      try:
        trial.process.wait(STOP_TIMEOUT_S)
      except subprocess.TimeoutExpired:
        trial.process.kill()
        trial.process.wait(STOP_TIMEOUT_S)
      trial.finish(trial.process.returncode, log)
    raise


# ---- the summary table --------------------------------------------------------------------------
def summary_rows(trials: list[Trial]) -> list[dict]:
  from jaxrl_async import report
  rows = []
  for trial in trials:
    row = {"trial": trial.name, "status": status_of(trial.run_dir), "run_dir": trial.run_dir,
           "bindings": trial.trial, "process_s": read_state(trial.run_dir).get("process_s")}
    if os.path.isfile(os.path.join(trial.run_dir, "metrics.jsonl")):
      row.update(report.load_run(trial.run_dir).table_row())
    rows.append(row)
  return rows


def format_table(rows: list[dict]) -> str:
  def cell(value):
    if isinstance(value, float):
      return f"{value:.4g}"
    return "-" if value is None else str(value)
  header = [label for _, label in COLUMNS]
  body = [[cell(row.get(key)) for key, _ in COLUMNS] for row in rows]
  widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
  lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
  lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |" for line in body]
  return "\n".join(lines)


def run_sweep(path: str, *, root: str | None = None, parallel: int = 1,
              rerun_failed: bool = False, extra_bindings=(), log=print) -> list[dict]:
  if parallel < 1:
    raise ValueError(f"--parallel must be >= 1, got {parallel}")
  sweep = load_sweep(path)
  # Trials run from the repository root: paths given here are made absolute first.
  root = os.path.abspath(root or os.path.join("runs", "sweeps", sweep.name))
  sweep.gin_files = [os.path.abspath(f) if os.path.isfile(f) else f for f in sweep.gin_files]
  os.makedirs(root, exist_ok=True)
  trials = [Trial(sweep, i, trial, root, list(extra_bindings))
            for i, trial in enumerate(sweep.trials)]
  pending = []
  for trial in trials:
    status = status_of(trial.run_dir)
    if status == "done":
      log(f"{trial.name}: done, skipped")
    elif status == "failed" and not rerun_failed:
      log(f"{trial.name}: failed earlier, not re-run (pass --rerun_failed); "
          f"see {os.path.join(trial.run_dir, 'train.log')}")
    else:
      pending.append(trial)
  log(f"sweep {sweep.name}: {len(trials)} trials, {len(pending)} to run, {parallel} at a time, "
      f"in {os.path.abspath(root)}")
  try:
    run_trials(pending, parallel, log)
  finally:
    rows = summary_rows(trials)
    table = format_table(rows)
    with open(os.path.join(root, "summary.md"), "w", encoding="utf-8") as f:
      f.write(f"# sweep {sweep.name}\n\n{table}\n")
    with open(os.path.join(root, "summary.json"), "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1, sort_keys=True)
    log(table)
    log(f"summary: {os.path.abspath(os.path.join(root, 'summary.md'))}")
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="jaxrl-async sweep", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sweep_file")
  parser.add_argument("--parallel", type=int, default=1, help="trials run at once")
  parser.add_argument("--root", default=None, help="where the trials' run directories go "
                      "(default: runs/sweeps/<NAME>)")
  parser.add_argument("--rerun_failed", action="store_true",
                      help="re-run failed trials (from their latest checkpoint if any)")
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="extra bindings for every trial, after the sweep's own")
  args = parser.parse_args(argv)
  try:
    rows = run_sweep(args.sweep_file, root=args.root, parallel=args.parallel,
                     rerun_failed=args.rerun_failed, extra_bindings=args.gin_bindings)
  except (FileNotFoundError, ValueError) as error:
    print(f"jaxrl-async sweep: {error}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    return 130
  return 0 if all(row["status"] == "done" for row in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
