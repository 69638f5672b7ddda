"""The schedule of an async run, recorded beside its ledger so that the run can be replayed
(`run/replay.py`; docs/replay.md).

`<run_dir>/schedule/<end:08d>.npz`, one file per checkpoint interval, written just before the
checkpoint of policy version `end` (so a checkpoint never exists without its interval's file),
holds every update the learner made since the previous checkpoint, in order:

- per update: the learner version it ran at, its index in the version window (`local`) and how
  many groups it trained on (the groups follow in that order);
- per group: group id, prompt id, prompt tokens and the problem's `meta` (one JSON line);
- per sample (group-major, members in the order trained): its index in the group, its sampling
  key (`generation.sample_keys(seed, group, member)`, as the rollout side makes it), reward,
  finish reason, how many weight swaps interrupted it, and its response: tokens (uint16 where
  every id fits, else int32), behaviour logprobs (float32) and the per-token policy versions
  run-length encoded as (version, count) segments: a segment boundary is a partial-rollout
  interruption, and its version the one the sample resumed under;
- per version published in the interval: when its publish began (`time.time()`).

A resumed run deletes the files past its checkpoint before it writes anything (`open_recorder`),
as the ledger and the metrics are cut back, so the files always chain: each one starts at the
version the previous one ends at. Arrays only (`np.load(..., allow_pickle=False)` reads them).
"""

from __future__ import annotations

import json
import os

import numpy as np

from jaxrl_async.rollout.generation import sample_keys
from jaxrl_async.types import FinishReason

SCHEDULE_DIR = "schedule"
FORMAT = 1
FINISH_REASONS = tuple(reason.value for reason in FinishReason)


def interval_path(run_dir, end_version: int) -> str:
  return os.path.join(os.fspath(run_dir), SCHEDULE_DIR, f"{int(end_version):08d}.npz")


def recorded_ends(run_dir) -> list[int]:
  """The end versions of the interval files under run_dir/schedule, ascending."""
  directory = os.path.join(os.fspath(run_dir), SCHEDULE_DIR)
  if not os.path.isdir(directory):
    return []
  return sorted(int(name[:-4]) for name in os.listdir(directory)
                if name.endswith(".npz") and name[:-4].isdigit())


def cut_back(run_dir, version: int | None) -> list[int]:
  """Deletes the interval files that end after `version` (None: every file, a run that starts
  from scratch), and stray partial writes. Returns the ends deleted."""
  directory = os.path.join(os.fspath(run_dir), SCHEDULE_DIR)
  removed = [end for end in recorded_ends(run_dir) if version is None or end > version]
  for end in removed:
    os.remove(interval_path(run_dir, end))
  if os.path.isdir(directory):
    for name in os.listdir(directory):
      if name.endswith(".tmp.npz"):
        os.remove(os.path.join(directory, name))
  return removed


def encode_groups(groups) -> dict[str, list[np.ndarray]]:
  """The groups' columns (lists of arrays, one entry per group, concatenated at a flush)."""
  columns: dict[str, list] = {name: [] for name in GROUP_COLUMNS + SAMPLE_COLUMNS}
  for group in groups:
    first = group[0]
    meta = {k: v for k, v in first.meta.items() if k != "index_in_group"}
    columns["group_id"].append(np.asarray([first.group_id], np.int64))
    columns["prompt_id"].append(np.asarray([first.prompt_id], np.int64))
    columns["prompt_length"].append(np.asarray([len(first.prompt_tokens)], np.int32))
    columns["prompt_tokens"].append(first.prompt_tokens)
    columns["meta"].append(np.frombuffer((json.dumps(meta) + "\n").encode(), np.uint8))
    members = [int(s.meta.get("index_in_group", 0)) for s in group]
    columns["member"].append(np.asarray(members, np.int32))
    columns["reward"].append(np.asarray([s.reward for s in group], np.float64))
    columns["finish"].append(np.asarray([FINISH_REASONS.index(str(s.finish_reason))
                                         for s in group], np.uint8))
    columns["interruptions"].append(np.asarray([s.interruptions for s in group], np.int32))
    columns["response_length"].append(np.asarray([s.num_response_tokens for s in group],
                                                 np.int32))
    columns["response_tokens"].extend(s.response_tokens for s in group)
    columns["behaviour_logprobs"].extend(s.behaviour_logprobs for s in group)
    counts, versions, lengths = version_segments_many([s.token_versions for s in group])
    columns["segment_count"].append(counts)
    columns["segment_version"].append(versions)
    columns["segment_length"].append(lengths)
  return columns


def _keys(seed: int, group_ids: np.ndarray, members: np.ndarray, group_size: int) -> np.ndarray:
  """Every sample's sampling key (uint32 [N, 2]), as the rollout side made it."""
  keys = [sample_keys(seed, int(group_id), members[g * group_size:(g + 1) * group_size])
          for g, group_id in enumerate(group_ids)]
  return np.concatenate(keys).astype(np.uint32) if keys else np.zeros((0, 2), np.uint32)


def version_segments(token_versions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """Run-length encoding of per-token versions: (versions int32 [K], lengths int32 [K])."""
  return version_segments_many([token_versions])[1:]


def version_segments_many(token_versions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """`version_segments` of several arrays at once: (segments of each array int32 [N], their
  versions int32 [K] and lengths int32 [K], one array's after another's)."""
  sizes = np.fromiter(map(len, token_versions), np.int64, len(token_versions))
  if not sizes.sum():
    return np.zeros((len(sizes),), np.int32), np.zeros((0,), np.int32), np.zeros((0,), np.int32)
  joined = np.concatenate([np.asarray(v, np.int32).reshape(-1) for v in token_versions])
  begins = np.zeros(len(joined), bool)
  begins[(np.cumsum(sizes) - sizes)[sizes > 0]] = True  # every array starts a segment
  begins[1:] |= joined[1:] != joined[:-1]  # and so does every change of version
  starts = np.flatnonzero(begins)
  lengths = np.diff(np.append(starts, len(joined)))
  owners = np.repeat(np.arange(len(sizes)), sizes)[starts]
  return (np.bincount(owners, minlength=len(sizes)).astype(np.int32),
          joined[starts].astype(np.int32), lengths.astype(np.int32))


GROUP_COLUMNS = ("group_id", "prompt_id", "prompt_length", "prompt_tokens", "meta")
SAMPLE_COLUMNS = ("member", "key", "reward", "finish", "interruptions", "response_length",
                  "response_tokens", "behaviour_logprobs", "segment_count", "segment_version",
                  "segment_length")
DTYPES = {"group_id": np.int64, "prompt_id": np.int64, "prompt_length": np.int32,
          "prompt_tokens": np.int32, "meta": np.uint8, "member": np.int32, "key": np.uint32,
          "reward": np.float64, "finish": np.uint8, "interruptions": np.int32,
          "response_length": np.int32, "response_tokens": np.int32,
          "behaviour_logprobs": np.float32, "segment_count": np.int32,
          "segment_version": np.int32, "segment_length": np.int32}


class ScheduleRecorder:
  """Collects a checkpoint interval's updates (`on_version`, `on_cut_window`) and writes them at
  the checkpoint (`flush`). Called by the loop's learner thread and its checkpoint; the
  columns are encoded as each version ends, so what waits for a flush is compact."""

  def __init__(self, run_dir, *, seed: int, group_size: int, groups_per_update: int,
               start_version: int, header: dict | None = None):
    self.run_dir = os.fspath(run_dir)
    self.seed = seed
    self.group_size = group_size
    self.groups_per_update = groups_per_update
    self.header = dict(header or {})
    self.start_version = start_version  # the state the interval's first update starts from
    self.published: dict[int, float] = {}
    self._updates: list[tuple[int, int, int]] = []  # (learner version, local, groups)
    self._columns: dict[str, list] = {name: [] for name in GROUP_COLUMNS + SAMPLE_COLUMNS}
    self.bytes_written = 0
    self.samples_written = 0

  def on_version(self, version: int, groups, published_at: dict[int, float]) -> None:
    """Version `version` is published; `groups`: its window's updates' groups, in order."""
    self._add_updates(version - 1, groups)
    for published, when in list(published_at.items()):
      if published >= self.start_version and published not in self.published:
        self.published[published] = float(when)

  def on_cut_window(self, version: int, groups) -> None:
    """Updates of a window cut short by a stop (at learner version `version`): they are in the
    state the stop's checkpoint saves."""
    self._add_updates(version, groups)

  def _add_updates(self, learner_version: int, groups) -> None:
    groups = list(groups)
    if len(groups) % self.groups_per_update:
      raise ValueError(f"{len(groups)} groups are not whole updates of "
                       f"{self.groups_per_update} groups")
    for local in range(len(groups) // self.groups_per_update):
      self._updates.append((learner_version, local, self.groups_per_update))
    for name, values in encode_groups(groups).items():
      self._columns[name].extend(values)

  def flush(self, end_version: int) -> str:
    """Writes the interval (start_version, end_version] (atomically: a temporary file renamed)
    and starts the next one. Returns the file's path."""
    arrays = {name: (np.concatenate(values) if values else np.zeros((0,), DTYPES[name]))
              .astype(DTYPES[name], copy=False) for name, values in self._columns.items()}
    # The keys at the flush (the run is paused for its checkpoint), not per version on the
    # learner's path: one device call per group.
    arrays["key"] = _keys(self.seed, arrays["group_id"], arrays["member"], self.group_size)
    tokens = arrays["response_tokens"]
    if not len(tokens) or (tokens.min() >= 0 and tokens.max() < 2 ** 16):
      arrays["response_tokens"] = tokens.astype(np.uint16)
    updates = np.asarray(self._updates, np.int32).reshape(-1, 3)
    published = sorted(self.published.items())
    header = {**self.header, "format": FORMAT, "start_version": int(self.start_version),
              "end_version": int(end_version), "seed": self.seed,
              "group_size": self.group_size, "samples": len(arrays["member"]),
              "tokens": len(tokens)}
    arrays.update(
        header=np.frombuffer(json.dumps(header).encode(), np.uint8),
        update_version=updates[:, 0], update_local=updates[:, 1],
        update_num_groups=updates[:, 2],
        published_version=np.asarray([v for v, _ in published], np.int32),
        published_at=np.asarray([t for _, t in published], np.float64))
    path = interval_path(self.run_dir, end_version)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = path[:-4] + ".tmp.npz"
    np.savez_compressed(partial, **arrays)
    os.replace(partial, path)
    self.bytes_written += os.path.getsize(path)
    self.samples_written += header["samples"]
    self.start_version = end_version
    self.published = {}
    self._updates = []
    self._columns = {name: [] for name in GROUP_COLUMNS + SAMPLE_COLUMNS}
    return path

  def summary(self) -> dict[str, float]:
    """`schedule/bytes`, `schedule/samples` written by this life, and bytes per sample."""
    return {"schedule/bytes": self.bytes_written, "schedule/samples": self.samples_written,
            "schedule/bytes_per_sample": (self.bytes_written / self.samples_written
                                          if self.samples_written else float("nan"))}


def open_recorder(run_dir, config, run_state: dict | None, *, backend: str
                  ) -> ScheduleRecorder | None:
  """The run's recorder, after the files past the checkpoint it resumes from (all of them for
  a run from scratch) are deleted; None where `config.record_schedule` is off."""
  start = 0 if run_state is None else int(run_state["policy_version"])
  cut_back(run_dir, None if run_state is None else start)
  if not config.record_schedule:
    return None
  return ScheduleRecorder(
      run_dir, seed=config.seed, group_size=config.group_size,
      groups_per_update=config.groups_per_update, start_version=start,
      header={"mode": config.mode, "backend": backend,
              "partial_strategy": config.partial_strategy,
              "partial_rollout": config.partial_rollout,
              "trigger_parameter_sync_step": config.trigger_parameter_sync_step,
              "groups_per_update": config.groups_per_update})
