"""Where a run's metric records go: metrics.jsonl always, TensorBoard and W&B beside it.

`make_writer(run_dir, timer, sinks)` returns one writer (`write(record)`, `close()`) that fans
each record out to:
  - `metrics.jsonl` (always; the report reads it);
  - TensorBoard event files under `<run_dir>/tensorboard/`, when 'tensorboard' is in `sinks` and
    tensorboardX is installed (`pip install -e '.[tb]'`; no TensorFlow needed). One event
    directory per step axis, so TensorBoard shows each as a run: `policy_version/` (step =
    policy version), `learner_step/` (step = optimizer updates) and `wall_clock_ms/` (step =
    milliseconds of the run's wall-clock, evaluation and checkpoints excluded);
  - Weights & Biases in offline mode (`<run_dir>/wandb/`, sync later with `wandb sync`), when
    'wandb' is in `sinks` (needs `pip install wandb`);
  - `<run_dir>/spans.jsonl`: the role timer's latest busy spans, rewritten every `spans_every_s`
    seconds and at close (the report's stage timeline).
Only numeric values become scalars; strings and lists stay in metrics.jsonl.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Mapping, Sequence

from jaxrl_async.metrics import MAX_SPANS, JsonlWriter, RoleTimer

SINKS = ("tensorboard", "wandb")
# Step axes: record field -> TensorBoard directory, and how a record's value becomes the step.
STEP_AXES = {"policy_version": ("policy_version", int),
             "learner_step": ("learner_step", int),
             "time_s": ("wall_clock_ms", lambda seconds: round(seconds * 1000))}
AXIS_FIELDS = ("policy_version", "learner_step", "time_s")
SPANS_FILE = "spans.jsonl"


def scalars(record: Mapping) -> dict[str, float]:
  """The record's numeric values (bools and ints as floats), axis fields left out."""
  out = {}
  for name, value in record.items():
    if name in AXIS_FIELDS or isinstance(value, str | list | tuple | dict) or value is None:
      continue
    try:
      out[name] = float(value)
    except (TypeError, ValueError):
      continue
  return out


class TensorBoardWriter:
  """Scalars on each step axis, one event directory per axis under `logdir`.

  A record becomes one event per axis holding all its scalars (one `Summary` with many values),
  not one event per scalar: tensorboardX pickles each event through a queue, and per-scalar
  events cost the training loop milliseconds per version.
  """

  def __init__(self, logdir: str | os.PathLike, flush_secs: int = 10):
    from tensorboardX import SummaryWriter
    from tensorboardX.proto.summary_pb2 import Summary
    self._summary = Summary
    self.logdir = os.fspath(logdir)
    self._writers = {field: SummaryWriter(os.path.join(self.logdir, directory),
                                          flush_secs=flush_secs)
                     for field, (directory, _) in STEP_AXES.items()}

  def write(self, record: Mapping) -> None:
    values = scalars(record)
    if not values:
      return
    summary = self._summary(value=[self._summary.Value(tag=name, simple_value=value)
                                   for name, value in values.items()])
    walltime = time.time()
    for field, (_, to_step) in STEP_AXES.items():
      if record.get(field) is None:
        continue
      self._writers[field].file_writer.add_summary(summary, to_step(record[field]), walltime)

  def close(self) -> None:
    for writer in self._writers.values():
      writer.close()


class WandbWriter:
  """One offline W&B run; each axis is its own step metric (`policy_version` the default x)."""

  def __init__(self, run_dir: str | os.PathLike, name: str, project: str = "jaxrl_async"):
    import wandb
    self._run = wandb.init(project=project, name=name, dir=os.fspath(run_dir),
                           mode=os.environ.get("WANDB_MODE", "offline"), reinit=True)
    for field in AXIS_FIELDS:
      self._run.define_metric(field)
    self._run.define_metric("*", step_metric="policy_version")
    self.directory = self._run.dir

  def write(self, record: Mapping) -> None:
    values = scalars(record)
    values.update({field: float(record[field]) for field in AXIS_FIELDS
                   if record.get(field) is not None})
    self._run.log(values)

  def close(self) -> None:
    self._run.finish()


class SpanFile:
  """Keeps `<run_dir>/spans.jsonl` up to date with the timer's latest spans (capped).

  Spans already in the file (a resumed run) are kept ahead of the new ones, within the cap.
  """

  def __init__(self, path: str | os.PathLike, timer: RoleTimer, every_s: float = 60.0,
               max_spans: int = MAX_SPANS, clock=time.monotonic):
    self.path, self.timer, self.every_s, self._clock = os.fspath(path), timer, every_s, clock
    self._max_spans = max_spans
    self._earlier: list | None = None  # the file's spans, read at the first save (after a
    self._last_save = clock()          # resumed run's ledger.rewind_logs has cut it back)

  def write(self, record: Mapping) -> None:
    del record
    if self._clock() - self._last_save >= self.every_s:
      self.save()

  def save(self) -> None:
    if self._earlier is None:
      self._earlier = read_spans(self.path) if os.path.exists(self.path) else []
    spans = collections.deque(self._earlier, maxlen=self._max_spans)
    spans.extend(self.timer.spans())
    write_spans(self.path, spans)
    self._last_save = self._clock()

  def close(self) -> None:
    self.save()


def write_spans(path: str | os.PathLike, spans) -> None:
  """(role, start, end) spans as `path`'s lines, replacing the file at once."""
  temporary = os.fspath(path) + ".tmp"
  with open(temporary, "w", encoding="utf-8") as f:
    for role, start, end in spans:
      f.write(json.dumps({"role": role, "start": round(start, 6), "end": round(end, 6)}) + "\n")
  os.replace(temporary, path)


def read_spans(path: str | os.PathLike) -> list[tuple[str, float, float]]:
  with open(path, encoding="utf-8") as f:
    rows = [json.loads(line) for line in f if line.strip()]
  return [(row["role"], float(row["start"]), float(row["end"])) for row in rows]


class CompositeWriter:
  """Writes every record to each writer; close() closes them all, then raises the first error."""

  def __init__(self, writers: Sequence):
    self.writers = list(writers)

  def write(self, record: Mapping) -> None:
    for writer in self.writers:
      writer.write(record)

  def close(self) -> None:
    errors = []
    for writer in self.writers:
      try:
        writer.close()
      except Exception as error:  # every sink gets closed; the first error is raised
        errors.append(error)
    if errors:
      raise errors[0]


def check_sinks(sinks) -> None:
  unknown = [sink for sink in sinks if sink not in SINKS]
  if unknown or isinstance(sinks, str):
    raise ValueError(f"metric_sinks must be a tuple of names from {SINKS}, got {sinks!r}")


def tensorboard_available() -> bool:
  import importlib.util
  return importlib.util.find_spec("tensorboardX") is not None


def make_writer(run_dir: str | os.PathLike, timer: RoleTimer | None = None,
                sinks=("tensorboard",), log=print) -> CompositeWriter:
  """metrics.jsonl plus the sinks named (TensorBoard skipped with a note if not installed)."""
  check_sinks(sinks)
  run_dir = os.fspath(run_dir)
  writers = [JsonlWriter(os.path.join(run_dir, "metrics.jsonl"))]
  if "tensorboard" in sinks:
    if tensorboard_available():
      writers.append(TensorBoardWriter(os.path.join(run_dir, "tensorboard")))
    else:
      log("metric_sinks: tensorboardX is not installed (pip install -e '.[tb]'); "
          "writing metrics.jsonl only")
  if "wandb" in sinks:
    try:
      writers.append(WandbWriter(run_dir, name=os.path.basename(os.path.abspath(run_dir))))
    except ImportError as error:
      raise ValueError("metric_sinks includes 'wandb' but wandb is not installed "
                       "(pip install -e '.[wandb]')") from error
  if timer is not None:
    writers.append(SpanFile(os.path.join(run_dir, SPANS_FILE), timer))
  return CompositeWriter(writers)
