"""Run checkpoints (orbax CheckpointManager): learner state, prompt iterator, run state.

One checkpoint per saved policy version holds, as an orbax Composite:
- 'state': the learner's params, optimizer state and step (restored with the learner mesh's
  shardings, so a run can resume on another mesh);
- 'prompts': the grain prompt iterator (grain.checkpoint.CheckpointSave);
- 'run': JSON with counters, the policy version, the next group id, the buffer's queued samples
  and the prompts that were in flight (so they are re-issued exactly once on resume).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jaxrl_async import faults
from jaxrl_async.learner.step import TrainState

WRITE_TIMEOUT_S = 600.0


def check_run_dir(run_dir: str | os.PathLike, resume: bool) -> None:
  """A fresh run (resume=False) must not start over a run_dir that already has checkpoints:
  it would mix two runs' metrics and fail when it reaches a saved version."""
  directory = os.path.join(os.fspath(run_dir), "checkpoints")
  if resume or not os.path.isdir(directory):
    return
  steps = sorted(int(name) for name in os.listdir(directory) if name.isdigit())
  if steps:
    raise ValueError(
        f"run_dir {os.fspath(run_dir)!r} already holds checkpoints (policy versions {steps}); "
        "continue it with --resume (resume=True) or choose a new run_dir")


def _state_tree(state: TrainState) -> dict:
  return {"step": state.step, "params": state.params, "opt_state": state.opt_state}


def _async_options() -> ocp.AsyncOptions | None:
  """Orbax's defaults for one process. Several processes: each checkpoint's directories exist
  before any item is written. (Orbax creates them on process 0 only, and with its asynchronous
  creation another process's grain prompt file can be written before they exist:
  FileNotFoundError, seen with two processes on a loaded machine.)"""
  if jax.process_count() == 1:
    return None
  return ocp.AsyncOptions(create_directories_asynchronously=False)


class CheckpointError(RuntimeError):
  """A checkpoint could not be written or none could be read; the message says which and why."""


class RunCheckpointer:

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3,
               write_timeout_s: float = WRITE_TIMEOUT_S, log=print):
    self.directory = os.path.abspath(os.fspath(directory))
    self.write_timeout_s = write_timeout_s
    self.log = log
    check_writable(self.directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                             async_options=_async_options()),
        item_names=("state", "prompts", "run"),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def steps(self) -> list[int]:
    """The versions of the checkpoints on disk, ascending."""
    return sorted(self._manager.all_steps())

  def save(self, step: int, state: TrainState, prompt_iterator, run_state: dict[str, Any],
           *, wait: bool = True) -> None:
    """Writes checkpoint `step`; orbax finalizes it (an atomic rename) only once complete, so
    a crash mid-write leaves no checkpoint that looks whole. A full or read-only disk raises
    CheckpointError, and the previous checkpoints stay as they were."""
    try:
      faults.point("checkpoint.before_write")  # inside: an injected OSError is a disk error
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_state_tree(state)),
          prompts=grain.checkpoint.CheckpointSave(prompt_iterator),
          run=ocp.args.JsonSave(run_state),
      ), force=True)
      if wait:
        self.wait_until_finished()
    except OSError as error:
      raise CheckpointError(
          f"could not write checkpoint {step} under {self.directory}: {error} (disk full or "
          "read-only?); the newest complete checkpoint is "
          f"{self._manager.latest_step()}") from error
    faults.point("checkpoint.after_write")

  def wait_until_finished(self) -> None:
    """Orbax's wait, bounded: a write that takes longer than `write_timeout_s` is an error."""
    errors: list[BaseException] = []

    def wait():
      try:
        self._manager.wait_until_finished()
      except BaseException as error:  # handed to the caller below
        errors.append(error)

    waiter = threading.Thread(target=wait, name="checkpoint-wait", daemon=True)
    waiter.start()
    waiter.join(self.write_timeout_s)
    if waiter.is_alive():
      raise CheckpointError(f"checkpoint write under {self.directory} did not finish within "
                            f"{self.write_timeout_s:.0f} s")
    if errors:
      raise errors[0]

  def restore(self, state: TrainState, prompt_iterator, step: int | None = None):
    """Restore into `state`'s structure and shardings and into `prompt_iterator` (in place).

    Returns (state, run_state dict, step).
    """
    step = self._manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          _state_tree(state))
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target),
        prompts=grain.checkpoint.CheckpointRestore(prompt_iterator),
        run=ocp.args.JsonRestore(),
    ))
    run_state = restored["run"]
    if not isinstance(run_state, dict) or run_state.get("policy_version") != step:
      raise ValueError(f"checkpoint {step}: its run state does not name policy_version {step}")
    tree = restored["state"]
    new_state = TrainState(step=tree["step"], params=tree["params"],
                           opt_state=tree["opt_state"], tx=state.tx)
    return new_state, dict(run_state), step

  def restore_latest(self, state: TrainState, prompt_iterator):
    """The newest checkpoint that reads back whole, or None when there is none at all.

    A checkpoint that fails to read (truncated or corrupted files) is reported and the next
    older one is tried. The prompt iterator is restored in place, so it is saved first and put
    back after a failed attempt: nothing half-read is ever trained from. If checkpoints exist
    but none reads, CheckpointError names each one and its error.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    if not steps:
      return None
    prompts_before = prompt_iterator.get_state()
    failures = []
    for step in steps:
      try:
        restored = self.restore(state, prompt_iterator, step)
      except Exception as error:  # any read or decode error: this checkpoint is not usable
        prompt_iterator.set_state(prompts_before)
        failures.append(f"{step}: {type(error).__name__}: {str(error)[:300]}")
        self.log(f"checkpoint {step} under {self.directory} is unreadable "
                 f"({type(error).__name__}); trying an older one")
        continue
      if failures:
        self.log(f"resuming from checkpoint {step}, the newest that reads back whole")
        self._set_aside([s for s in steps if s > step])
      return restored
    raise CheckpointError(f"no checkpoint under {self.directory} reads back whole: "
                          + "; ".join(failures))

  def _set_aside(self, steps: list[int]) -> None:
    """Moves unreadable checkpoints out of the manager's directory (to `<directory>.unreadable/`,
    kept for inspection), so the resumed run can save those versions again."""
    aside = self.directory + ".unreadable"
    os.makedirs(aside, exist_ok=True)
    for step in steps:
      target = os.path.join(aside, f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
      os.replace(os.path.join(self.directory, str(step)), target)
      self.log(f"checkpoint {step} moved aside to {target}")
    self._manager.reload()

  def close(self) -> None:
    self.wait_until_finished()
    self._manager.close()


def check_writable(directory: str) -> None:
  """Fails at start, not at the first save hours later, when checkpoints cannot be written:
  creates the directory and a probe file in it."""
  try:
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-probe-{os.getpid()}")
    with open(probe, "w", encoding="utf-8") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as error:
    raise CheckpointError(f"checkpoint directory {directory} is not writable: {error}") from error
