"""Metric sinks: TensorBoard events read back with TensorBoard's own reader (every metric name on
every step axis), spans.jsonl capped and kept across a resume, the composite writer, W&B offline."""

import json
import os

import pytest

from jaxrl_async import metrics, sinks

pytest.importorskip("tensorboardX")
event_accumulator = pytest.importorskip(
    "tensorboard.backend.event_processing.event_accumulator")

RECORDS = [
    {"policy_version": 0, "learner_step": 0, "samples": 0, "time_s": 0.0, "eval/accuracy": 0.25},
    {"policy_version": 1, "learner_step": 2, "samples": 64, "time_s": 1.5,
     "result/reward_mean": 0.5, "algo/stale_ratio": 0.0, "queue/depth": 3,
     "algo/old_logprob_source": "recompute", "algo/version_gap_counts": [10, 2],
     "sync/latency_s": float("nan")},
    {"policy_version": 2, "learner_step": 4, "samples": 128, "time_s": 2.25,
     "result/reward_mean": 0.75, "algo/stale_ratio": 0.5, "queue/depth": 1,
     "eval/accuracy": 0.5, "algo/debug": True},
]


def read_events(directory):
  accumulator = event_accumulator.EventAccumulator(
      str(directory), size_guidance={event_accumulator.SCALARS: 0})
  accumulator.Reload()
  return {tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
          for tag in accumulator.Tags()["scalars"]}


def expected_points(axis_field, to_step):
  points = {}
  for record in RECORDS:
    for name, value in record.items():
      if name in sinks.AXIS_FIELDS or isinstance(value, str | list):
        continue
      points.setdefault(name, []).append((to_step(record[axis_field]), float(value)))
  return points


def test_tensorboard_events_hold_every_metric_on_every_step_axis(tmp_path):
  writer = sinks.TensorBoardWriter(tmp_path / "tb")
  for record in RECORDS:
    writer.write(record)
  writer.close()
  assert sorted(os.listdir(tmp_path / "tb")) == ["learner_step", "policy_version",
                                                 "wall_clock_ms"]
  for field, (directory, to_step) in sinks.STEP_AXES.items():
    events = read_events(tmp_path / "tb" / directory)
    expected = expected_points(field, to_step)
    assert set(events) == set(expected), directory
    for name, points in expected.items():
      got = events[name]
      assert [step for step, _ in got] == [step for step, _ in points], (directory, name)
      for (_, value), (_, want) in zip(got, points):
        assert value == pytest.approx(want, nan_ok=True), (directory, name)
  steps = [step for step, _ in read_events(tmp_path / "tb" / "wall_clock_ms")["samples"]]
  assert steps == [0, 1500, 2250]
  steps = [step for step, _ in read_events(tmp_path / "tb" / "learner_step")["samples"]]
  assert steps == [0, 2, 4]


def test_scalars_keep_numbers_only():
  out = sinks.scalars(RECORDS[1])
  assert "algo/old_logprob_source" not in out and "algo/version_gap_counts" not in out
  assert "policy_version" not in out and "time_s" not in out
  assert out["queue/depth"] == 3.0 and out["samples"] == 64.0


class Recorder:
  def __init__(self, fail_on_close=False):
    self.records, self.closed, self.fail_on_close = [], False, fail_on_close

  def write(self, record):
    self.records.append(record)

  def close(self):
    self.closed = True
    if self.fail_on_close:
      raise OSError("disk full")


def test_composite_writer_fans_out_and_closes_every_sink():
  first, second = Recorder(fail_on_close=True), Recorder()
  writer = sinks.CompositeWriter([first, second])
  writer.write(RECORDS[0])
  assert first.records == second.records == [RECORDS[0]]
  with pytest.raises(OSError, match="disk full"):
    writer.close()
  assert first.closed and second.closed


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


def test_span_file_is_capped_rewritten_and_kept_across_a_resume(tmp_path):
  clock = FakeClock()
  path = tmp_path / "spans.jsonl"
  timer = metrics.RoleTimer(clock=clock)
  spans = sinks.SpanFile(path, timer, every_s=10.0, max_spans=4, clock=clock)
  for role in ("rollout", "learner", "sync"):
    with timer.busy(role):
      clock.now += 1.0
  spans.write({})  # before every_s: nothing written yet
  assert not path.exists()
  clock.now += 10.0
  spans.write({})
  assert [row[0] for row in sinks.read_spans(path)] == ["rollout", "learner", "sync"]
  # A resumed run: a new timer, the file's spans ahead of the new ones, within the cap.
  timer = metrics.RoleTimer(clock=clock)
  timer.start -= 3.0
  spans = sinks.SpanFile(path, timer, every_s=10.0, max_spans=4, clock=clock)
  for role in ("reward", "learner"):
    with timer.busy(role):
      clock.now += 1.0
  spans.close()
  rows = sinks.read_spans(path)
  assert [row[0] for row in rows] == ["learner", "sync", "reward", "learner"]
  assert rows[2][1] == pytest.approx(3.0)  # the resumed clock continues
  assert not (tmp_path / "spans.jsonl.tmp").exists()


def test_make_writer_writes_jsonl_tensorboard_and_spans(tmp_path):
  timer = metrics.RoleTimer()
  with timer.busy("learner"):
    pass
  writer = sinks.make_writer(tmp_path, timer, ("tensorboard",), log=lambda *a: None)
  for record in RECORDS:
    writer.write(record)
  writer.close()
  records = metrics.read_jsonl(tmp_path / "metrics.jsonl")
  assert [r["policy_version"] for r in records] == [0, 1, 2]
  assert records[1]["algo/version_gap_counts"] == [10, 2]
  assert set(read_events(tmp_path / "tensorboard" / "policy_version")) >= {
      "eval/accuracy", "result/reward_mean", "queue/depth"}
  with open(tmp_path / "spans.jsonl", encoding="utf-8") as f:
    assert json.loads(f.readline())["role"] == "learner"


def test_unknown_sink_is_refused_naming_the_setting(tmp_path):
  with pytest.raises(ValueError, match="metric_sinks"):
    sinks.make_writer(tmp_path, None, ("tensorboard", "mlflow"))
  with pytest.raises(ValueError, match="metric_sinks"):
    sinks.make_writer(tmp_path, None, "tensorboard")


def test_wandb_offline_run_logs_every_record(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  writer = sinks.WandbWriter(tmp_path, name="test-run")
  run = writer._run
  for record in RECORDS:
    writer.write(record)
  assert run.summary["policy_version"] == 2.0
  assert run.summary["result/reward_mean"] == 0.75
  writer.close()
  offline = [name for name in os.listdir(tmp_path / "wandb") if name.startswith("offline-run")]
  assert len(offline) == 1
  files = os.listdir(tmp_path / "wandb" / offline[0])
  assert any(name.endswith(".wandb") for name in files), files
  del wandb
