"""The sample ledger: the audit finds lost, duplicated and unknown samples; rewinding cuts the
logs back to a checkpoint's view."""

import os

import numpy as np
import pytest

from jaxrl_async import ledger as ledger_lib
from jaxrl_async.backends import base as fleet
from jaxrl_async.metrics import RoleTimer
from jaxrl_async.sinks import SPANS_FILE, SpanFile, read_spans, write_spans
from jaxrl_async.types import Sample


def _group(group_id, prompt_id, size=2):
  return [Sample(prompt_id=prompt_id, group_id=group_id, group_size=size,
                 prompt_tokens=np.array([1]), meta={"index_in_group": i}) for i in range(size)]


def _write(tmp_path):
  ledger = ledger_lib.SampleLedger(tmp_path / "ledger.jsonl")
  ledger.consumed(1, [_group(0, 10), _group(2, 12)])
  ledger.dropped("stale", [(1, 0), (1, 1)])
  return ledger


def test_a_complete_ledger_audits_clean(tmp_path):
  ledger = _write(tmp_path)
  ledger.dropped("shutdown", [(3, 0)])
  ledger.consumed(2, [])
  ledger.dropped("reward_failed", [(3, 1)])
  ledger.close()
  result = ledger_lib.audit(ledger_lib.read_events(ledger.path), next_group_id=4, group_size=2)
  assert result["missing"] == [] and result["duplicates"] == [] and result["unknown"] == []
  assert result["consumed"] == 4
  assert result["dropped"] == {"stale": 2, "shutdown": 1, "reward_failed": 1}
  figures = ledger_lib.audit_metrics(result)
  assert figures["ledger/produced"] == 8 and figures["ledger/missing"] == 0


def test_the_audit_finds_lost_twice_and_unknown_samples(tmp_path):
  ledger = _write(tmp_path)
  ledger.consumed(2, [_group(1, 11)])  # group 1 was dropped already
  ledger.dropped("shutdown", [(9, 0)])  # never produced
  ledger.close()
  result = ledger_lib.audit(ledger_lib.read_events(ledger.path), next_group_id=4, group_size=2)
  assert result["missing"] == [(3, 0), (3, 1)]
  assert result["duplicates"] == [(1, 0), (1, 1)]
  assert result["unknown"] == [(9, 0)]


def test_the_audit_of_strided_servers_counts_only_their_groups(tmp_path):
  # Two rollout servers: server 0 drew groups 0, 2, 4; server 1 drew 1, 3 (next ids 6 and 5).
  groups = fleet.produced_groups([6, 5])
  assert groups == [0, 1, 2, 3, 4]
  ledger = _write(tmp_path)  # consumed 0 and 2, dropped 1
  ledger.consumed(2, [_group(4, 14)])
  ledger.dropped("shutdown", [(3, 0), (5, 0)])  # 5: no server drew it
  ledger.close()
  result = ledger_lib.audit(ledger_lib.read_events(ledger.path), groups=groups, group_size=2)
  assert result["produced"] == 10 and result["consumed"] == 6
  assert result["missing"] == [(3, 1)]
  assert result["unknown"] == [(5, 0)]
  with pytest.raises(ValueError, match="exactly one of"):
    ledger_lib.audit([], groups=groups, next_group_id=4, group_size=2)


def test_rewind_cuts_both_logs_back_to_the_checkpoint(tmp_path):
  ledger = _write(tmp_path)
  metrics = tmp_path / "metrics.jsonl"
  metrics.write_text('{"policy_version": 1}\n')
  offsets = ledger_lib.log_offsets(tmp_path, ledger)
  ledger.consumed(2, [_group(3, 13)])  # after the checkpoint: replayed on resume
  ledger.close()
  with open(metrics, "a") as f:
    f.write('{"policy_version": 2}\n')
  ledger_lib.rewind_logs(tmp_path, offsets)
  assert metrics.read_text() == '{"policy_version": 1}\n'
  events = ledger_lib.read_events(tmp_path / "ledger.jsonl")
  assert [e["event"] for e in events] == ["consumed", "dropped"]


def test_a_log_shorter_than_the_checkpoint_is_an_error(tmp_path):
  path = tmp_path / "ledger.jsonl"
  path.write_text("{}\n")
  with pytest.raises(ValueError, match="less than the 100 bytes"):
    ledger_lib.truncate(path, 100)
  assert os.path.getsize(path) == 3


def test_a_run_from_scratch_starts_both_logs_empty(tmp_path):
  # e.g. a crash before the first checkpoint, then --resume: nothing to resume, start over
  ledger = _write(tmp_path)
  ledger.close()
  (tmp_path / "metrics.jsonl").write_text('{"policy_version": 1}\n')
  ledger_lib.rewind_logs(tmp_path, None)
  assert (tmp_path / "metrics.jsonl").read_text() == ""
  assert ledger_lib.read_events(tmp_path / "ledger.jsonl") == []
  ledger_lib.rewind_logs(tmp_path / "nothing-here", None)  # no logs yet: nothing to cut


def test_rewind_cuts_the_stage_timeline_back_to_the_checkpoints_clock(tmp_path):
  spans = tmp_path / SPANS_FILE
  write_spans(spans, [("rollout", 0.5, 1.0), ("learner", 1.0, 2.0), ("sync", 2.0, 2.5),
                      ("rollout", 3.0, 4.0)])
  ledger_lib.rewind_logs(tmp_path, {"metrics_offset": 0, "ledger_offset": 0, "wall_s": 2.5})
  # the resumed run's clock continues from 2.5 s: spans after it would be made again
  assert read_spans(spans) == [("rollout", 0.5, 1.0), ("learner", 1.0, 2.0), ("sync", 2.0, 2.5)]
  ledger_lib.rewind_logs(tmp_path, None)  # a run from scratch: an empty timeline
  assert read_spans(spans) == []


def test_a_span_file_saves_the_cut_file_when_it_was_opened_before_the_cut(tmp_path):
  """The processes backend opens its writers before a resume cuts the logs back."""
  spans = tmp_path / SPANS_FILE
  write_spans(spans, [("learner", 0.0, 1.0), ("learner", 5.0, 6.0)])
  timer = RoleTimer()
  span_file = SpanFile(spans, timer)
  ledger_lib.rewind_logs(tmp_path, {"metrics_offset": 0, "ledger_offset": 0, "wall_s": 2.0})
  span_file.save()
  assert read_spans(spans) == [("learner", 0.0, 1.0)]
