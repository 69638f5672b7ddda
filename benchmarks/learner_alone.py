"""The learner role on recorded samples, never waiting: updates on the samples' whole groups as
the run's learner makes them, timed (`measure_learner`), in a child on one core
(`measure_learner_on_one_core`: its work in core-seconds), or for a wall-clock window beside the
other roles (`benchmarks/workload_together.py`, through `learner_updates`).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import time

from benchmarks import common


def learner_updates(config, scored):
  """(update(i) -> samples consumed, warm-up count): update i on the recorded samples' whole
  groups, `groups_per_update` to a batch, cycling through the batches; a window of
  `trigger_parameter_sync_step` updates takes its anchors as the run's learner does
  (`build.learner_update`). Calling update(i) for i < the warm-up count compiles every batch's
  shape with both anchors. ValueError when the samples make fewer whole groups than one
  update takes."""
  import jax

  from jaxrl_async import sharding
  from jaxrl_async.run import build as build_lib
  spec = build_lib.model_spec(config)
  mesh = sharding.place_roles(config.learner_mesh).learner
  learner = build_lib.build_learner_side(config, spec, mesh, log=lambda *a: None)
  groups = build_lib.assemble_groups(config, scored)
  per = config.groups_per_update
  batches = [groups[i:i + per] for i in range(0, len(groups) - per + 1, per)]
  if not batches:
    raise ValueError(f"{len(scored)} samples make {len(groups)} whole groups, fewer than one "
                     f"update's {per}: measure more samples")
  trigger = config.trigger_parameter_sync_step
  state = [learner.initial_state]
  window = [None]

  def update(i: int) -> int:
    local = i % trigger
    if local == 0:
      window[0] = build_lib.copy_params(state[0].params) if trigger > 1 else None
    batch = batches[i % len(batches)]
    state[0], metrics = build_lib.learner_update(learner, state[0], batch, window[0], 0, local)
    jax.device_get(metrics)
    return sum(len(group) for group in batch)

  update.batches = len(batches)
  return update, max(len(batches), trigger) * min(trigger, 2)


def measure_learner(config, scored, updates: int, repeats: int = 3) -> dict:
  """`updates` learner updates (`learner_updates`), every shape compiled first; the fastest of
  `repeats` passes is kept."""
  update, warm = learner_updates(config, scored)
  for i in range(warm):
    update(i)
  passes = []
  for _ in range(repeats):
    began = time.perf_counter()
    consumed = sum(update(i) for i in range(updates))
    passes.append(time.perf_counter() - began)
  learner_s = min(passes)
  return {"updates": updates, "samples": consumed, "s": learner_s, "batches": update.batches,
          "s_per_sample": learner_s / consumed, "passes_s": passes}


def learner_child(config, scored, updates: int, repeats: int, result_path: str) -> None:
  """In a spawned child pinned to one core with one XLA thread: `measure_learner`, its result
  pickled to `result_path` (the learner's core-seconds per sample: its work)."""
  from jaxrl_async import compilation_cache
  compilation_cache.enable()
  result = measure_learner(config, scored, updates, repeats)
  with open(result_path, "wb") as f:
    pickle.dump(result, f)


def measure_learner_on_one_core(config, scored, updates: int, repeats: int) -> dict:
  """`measure_learner` in a child on one core (`learner_child`)."""
  from jaxrl_async.backends.processes import child
  core = [sorted(os.sched_getaffinity(0))[0]]
  with tempfile.TemporaryDirectory() as root:
    path = os.path.join(root, "learner.pkl")
    process = child.spawn("benchmarks.learner_alone:learner_child",
                          (config, scored, updates, repeats, path), name="bound-learner-1core",
                          cores=core, env=child.child_env(core))
    return common.collect_children([process], [path], 1800,
                                   "the one-core learner measurement's child")[0]
