"""Train a `RunConfig`: `run(config, run_dir)` builds the parts and runs them; `train(parts,
run_dir)` runs parts already built and returns the final learner state beside the summary.

The sync baseline runs `sync_loop.run_sync`; every async mode runs the one async loop
(`loop.run_async`) on the backend `RunConfig.backend` names (`backends.get_backend`).
Both write metrics.jsonl, ledger.jsonl, checkpoints/ and summary.json in run_dir.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxrl_async.backends import get_backend
from jaxrl_async.checkpoint import check_run_dir
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.step import TrainState
from jaxrl_async.run.build import Parts, build
from jaxrl_async.run.loop import run_async
from jaxrl_async.run.services import task_services
from jaxrl_async.run.sync_loop import run_sync


@dataclasses.dataclass(frozen=True)
class RunResult:
  summary: dict
  state: TrainState  # the learner's state at the end of the run


def run(config: RunConfig, run_dir: str | os.PathLike, *, resume: bool = False,
        progress: bool = True, log=print) -> dict:
  """Train in `config.mode` -> the summary (also written to run_dir/summary.json)."""
  check_backend(config)  # before the minutes `build` takes
  with task_services(config, log=log) as config:
    return train(build(config, log=log), run_dir, resume=resume, progress=progress,
                 log=log).summary


def check_backend(config: RunConfig) -> None:
  """The backend's own refusals of `config` (an async run's), named before anything is built."""
  if config.is_async:
    get_backend(config.backend).check_config(config)


def train(parts: Parts, run_dir: str | os.PathLike, *, resume: bool = False,
          progress: bool = True, log=print) -> RunResult:
  config = parts.config
  check_run_dir(run_dir, resume)
  os.makedirs(run_dir, exist_ok=True)
  try:
    if config.is_async:
      backend = get_backend(config.backend)
      backend.check_config(config)
      summary, state = run_async(parts, backend, run_dir, resume=resume, progress=progress,
                                 log=log)
    else:
      summary, state = run_sync(parts, run_dir, resume=resume, progress=progress, log=log)
  finally:
    parts.rollout.rewards.close()
  # Updates on an executable compiled before the run, and updates that compiled a shape of
  # their own (a row count outside the precompiled ones, or precompile_updates off).
  summary.update({f"learner/updates_{path}": count
                  for path, count in parts.learner.update.calls.items()})
  data_metrics = getattr(parts.task, "data_metrics", None)
  if data_metrics is not None:  # a task over dataset files: its rows, and bad rows by reason
    summary.update(data_metrics())
  with open(os.path.join(run_dir, "summary.json"), "w", encoding="utf-8") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
  return RunResult(summary=summary, state=state)
