"""A jitted learner function compiled ahead of time for each batch shape a run can meet.

A packed batch's row count changes from update to update (`batching.packed_rows`): 8 to 32
rows over 400 versions of the default run. Under plain `jax.jit` each new count is traced and
compiled by the update that first meets it, on the learner's critical path in the middle of
the run: a fraction of a second when XLA's persistent cache holds the executable (the trace
is redone in every process), several seconds when it does not. `AheadOfTime` compiles the
shapes a run can meet before the run's clock starts and calls those executables; a shape
outside them takes the jit path, as before.

Calls are keyed by the shapes and dtypes of every argument but the first (the train state or
the params, whose structure is fixed for a run) and by which arguments are None.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxrl_async.learner import step as step_lib
from jaxrl_async.learner.batching import blank_batch, row_counts


def shape_key(args) -> tuple:
  """What picks an executable: the tree structure of `args` (None leaves included) and each
  array leaf's shape and dtype."""
  leaves, treedef = jax.tree.flatten(args)
  return treedef, tuple((tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves)


class AheadOfTime:
  """`jitted` with executables compiled ahead of time by `compile(*args)`."""

  def __init__(self, jitted):
    self.jitted = jitted
    self.executables: dict[tuple, Any] = {}
    self.calls = {"ahead_of_time": 0, "jit": 0}

  def compile(self, first, *rest) -> Any:
    """Compiles for these arguments' shapes (arrays or `jax.ShapeDtypeStruct`s, with their
    shardings); nothing runs. Returns the executable."""
    key = shape_key(rest)
    if key not in self.executables:
      self.executables[key] = self.jitted.lower(first, *rest).compile()
    return self.executables[key]

  def __call__(self, first, *rest):
    executable = self.executables.get(shape_key(rest))
    if executable is None:
      self.calls["jit"] += 1
      return self.jitted(first, *rest)
    self.calls["ahead_of_time"] += 1
    return executable(first, *rest)


def precompile_update(update: AheadOfTime, logprobs: AheadOfTime, state, *, mesh,
                      row_length: int, num_samples: int, shortest_sample: int, anchored: bool,
                      with_reference: bool) -> list[int]:
  """Compiles `update` (`step.make_update_fn`'s, wrapped) for every row count a packed batch of
  `num_samples` samples can have (`batching.row_counts`), with the anchor's logprobs where
  `anchored` ('recompute' with several updates a window: the anchored update too) and the
  reference policy's where `with_reference`. Returns the row counts."""
  counts = row_counts(num_samples, row_length, min(shortest_sample, row_length), mesh.size)
  version = np.float32(0)
  for rows in counts:
    batch = step_lib.shard_batch(blank_batch(rows, row_length, num_samples), mesh)
    logp = None
    if anchored or with_reference:
      logp = logprobs.compile(state.params, batch.tokens, batch.positions,
                              batch.segment_ids).out_info
    ref = logp if with_reference else None
    update.compile(state, batch, None, version, version, ref)
    if anchored:
      update.compile(state, batch, logp, version, version, ref)
  return counts
