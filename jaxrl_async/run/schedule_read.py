"""Reads a run's recorded schedule (`schedule_record.py`) back into updates of `Sample`s.

`read_schedule(run_dir)` checks that the interval files chain from version 0 (each starts where
the previous one ended) and returns them in order; a gap, a file of another format or a file
that does not read is an error naming the file.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxrl_async.run.schedule_record import (
  FINISH_REASONS,
  FORMAT,
  SCHEDULE_DIR,
  interval_path,
  recorded_ends,
)
from jaxrl_async.types import RewardStatus, Sample


class ScheduleError(ValueError):
  """A run's recorded schedule is missing, incomplete or unreadable; the message says which."""


@dataclasses.dataclass(frozen=True)
class RecordedUpdate:
  """One optimizer step of the run: at learner `version`, index `local` in its window, on
  `groups` (lists of Samples, as trained). `keys[g][m]`: member m of group g's sampling key."""
  version: int
  local: int
  groups: list
  keys: list


@dataclasses.dataclass(frozen=True)
class Interval:
  """One file: the updates from checkpoint `start_version` to checkpoint `end_version`."""
  start_version: int
  end_version: int
  updates: list
  published: dict
  header: dict
  path: str
  bytes: int


def _offsets(lengths: np.ndarray) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])


def read_interval(path: str) -> Interval:
  try:
    with np.load(path, allow_pickle=False) as data:
      arrays = {name: data[name] for name in data.files}
  except (OSError, ValueError, KeyError) as error:
    raise ScheduleError(f"schedule file {path} does not read: {error}") from error
  header = json.loads(arrays["header"].tobytes().decode())
  if header.get("format") != FORMAT:
    raise ScheduleError(f"schedule file {path} has format {header.get('format')!r}; this "
                        f"version reads format {FORMAT}")
  group_size = int(header["group_size"])
  prompt_at = _offsets(arrays["prompt_length"])
  response_at = _offsets(arrays["response_length"])
  segment_at = _offsets(arrays["segment_count"])
  metas = arrays["meta"].tobytes().decode().splitlines()
  groups, keys = [], []
  for g, group_id in enumerate(arrays["group_id"].tolist()):
    prompt = arrays["prompt_tokens"][prompt_at[g]:prompt_at[g + 1]]
    meta = json.loads(metas[g])
    members = []
    for s in range(g * group_size, (g + 1) * group_size):
      span = slice(response_at[s], response_at[s + 1])
      seg = slice(segment_at[s], segment_at[s + 1])
      versions = np.repeat(arrays["segment_version"][seg], arrays["segment_length"][seg])
      members.append(Sample(
          prompt_id=int(arrays["prompt_id"][g]), group_id=group_id, group_size=group_size,
          prompt_tokens=prompt, response_tokens=arrays["response_tokens"][span],
          behaviour_logprobs=arrays["behaviour_logprobs"][span], token_versions=versions,
          finish_reason=FINISH_REASONS[int(arrays["finish"][s])],
          reward=float(arrays["reward"][s]), reward_status=RewardStatus.OK.value,
          interruptions=int(arrays["interruptions"][s]),
          meta={**meta, "index_in_group": int(arrays["member"][s])}))
    groups.append(members)
    keys.append(arrays["key"][g * group_size:(g + 1) * group_size])
  updates, first = [], 0
  for version, local, count in zip(arrays["update_version"].tolist(),
                                   arrays["update_local"].tolist(),
                                   arrays["update_num_groups"].tolist(), strict=True):
    updates.append(RecordedUpdate(version, local, groups[first:first + count],
                                  keys[first:first + count]))
    first += count
  if first != len(groups):
    raise ScheduleError(f"schedule file {path}: its updates name {first} groups, it holds "
                        f"{len(groups)}")
  published = dict(zip(arrays["published_version"].tolist(), arrays["published_at"].tolist(),
                       strict=True))
  return Interval(start_version=int(header["start_version"]),
                  end_version=int(header["end_version"]), updates=updates,
                  published=published, header=header, path=path,
                  bytes=os.path.getsize(path))


def read_schedule(run_dir, until: int | None = None) -> list[Interval]:
  """The run's intervals in order, from version 0 up to the first that reaches `until` (every
  one for None). Raises ScheduleError where there is none or they do not chain."""
  ends = recorded_ends(run_dir)
  if not ends:
    raise ScheduleError(f"no recorded schedule under {os.path.join(os.fspath(run_dir), SCHEDULE_DIR)}: "
                        "record it with RunConfig.record_schedule = True (the default for "
                        "async runs; the sync mode records none)")
  intervals, reached = [], 0
  for end in ends:
    interval = read_interval(interval_path(run_dir, end))
    if interval.start_version != reached:
      raise ScheduleError(f"schedule file {interval.path} starts at version "
                          f"{interval.start_version} but the files before it reach version "
                          f"{reached}: the schedule has a gap")
    intervals.append(interval)
    reached = interval.end_version
    if until is not None and reached >= until:
      break
  if until is not None and reached < until:
    raise ScheduleError(f"--until {until}: the recorded schedule reaches version {reached} only")
  return intervals
