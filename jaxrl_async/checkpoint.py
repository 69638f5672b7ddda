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
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jaxrl_async.learner.step import TrainState


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


class RunCheckpointer:

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int = 3):
    self.directory = os.path.abspath(os.fspath(directory))
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "prompts", "run"),
    )

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state: TrainState, prompt_iterator, run_state: dict[str, Any],
           *, wait: bool = True) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_state_tree(state)),
        prompts=grain.checkpoint.CheckpointSave(prompt_iterator),
        run=ocp.args.JsonSave(run_state),
    ), force=True)
    if wait:
      self._manager.wait_until_finished()

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
    tree = restored["state"]
    new_state = TrainState(step=tree["step"], params=tree["params"],
                           opt_state=tree["opt_state"], tx=state.tx)
    return new_state, dict(restored["run"]), step

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
