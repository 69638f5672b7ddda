"""The sweep vocabulary of XManager launch scripts: trials as lists of {binding: value} dicts.

    from launch import hyper
    trials = hyper.product([
        hyper.sweep("RunConfig.staleness_threshold", [0.5, 1.0]),
        hyper.zipit([hyper.sweep("RunConfig.mini_batch_size", [8, 4]),
                     hyper.sweep("RunConfig.trigger_parameter_sync_step", [1, 2])]),
    ])
    # [{'RunConfig.staleness_threshold': 0.5, 'RunConfig.mini_batch_size': 8, ...}, ... 4 trials]

`sweep` varies one name; `product` takes every combination (the last sweep varies fastest, as in
itertools.product); `zipit` pairs sweeps of equal length element by element; `chainit` runs one
sweep after another; `fixed` is a sweep of one value. Every function returns a plain list of
dicts, so the result can be indexed, printed and combined again.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping


def sweep(name: str, values: Iterable) -> list[dict]:
  if not isinstance(name, str) or not name:
    raise ValueError(f"sweep name must be a non-empty string, got {name!r}")
  if isinstance(values, str | bytes | Mapping):
    raise ValueError(f"sweep({name!r}, values): values must be a list of values, got {values!r}")
  return [{name: value} for value in values]


def fixed(name: str, value) -> list[dict]:
  return sweep(name, [value])


def _merge(parts: Iterable[Mapping]) -> dict:
  merged: dict = {}
  for part in parts:
    clash = sorted(set(merged) & set(part))
    if clash:
      raise ValueError(f"the same name is swept twice in one trial: {clash}")
    merged.update(part)
  return merged


def _as_lists(sweeps) -> list[list[dict]]:
  out = []
  for index, one in enumerate(sweeps):
    one = list(one)
    if not all(isinstance(trial, Mapping) for trial in one):
      raise ValueError(f"argument {index} is not a sweep (a list of dicts): {one!r}")
    out.append(one)
  return out


def product(sweeps: Iterable[Iterable[Mapping]]) -> list[dict]:
  """Every combination of one trial from each sweep."""
  return [_merge(combination) for combination in itertools.product(*_as_lists(sweeps))]


def zipit(sweeps: Iterable[Iterable[Mapping]]) -> list[dict]:
  """The i-th trials of every sweep together; the sweeps must have the same length."""
  lists = _as_lists(sweeps)
  lengths = [len(one) for one in lists]
  if len(set(lengths)) > 1:
    raise ValueError(f"zipit needs sweeps of one length, got lengths {lengths}")
  return [_merge(parts) for parts in zip(*lists)]


def chainit(sweeps: Iterable[Iterable[Mapping]]) -> list[dict]:
  """The trials of each sweep, one sweep after another."""
  return [dict(trial) for one in _as_lists(sweeps) for trial in one]
