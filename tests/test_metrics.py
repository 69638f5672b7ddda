"""Tests for jaxrl_async.metrics: role timers on a fake clock, reductions, staleness, JSONL."""

import math
import threading

import numpy as np
import pytest

from jaxrl_async import metrics
from jaxrl_async.types import Sample


class FakeClock:
  """A clock the test advances by hand; safe to read from several threads."""

  def __init__(self, now: float = 100.0):
    self.now = now
    self._lock = threading.Lock()

  def __call__(self) -> float:
    with self._lock:
      return self.now

  def advance(self, seconds: float) -> None:
    with self._lock:
      self.now += seconds


# ---- RoleTimer -------------------------------------------------------------------------------
def test_busy_and_idle_ratios_are_exact():
  clock = FakeClock()
  timer = metrics.RoleTimer(clock=clock)
  with timer.busy("rollout"):
    clock.advance(3.0)
  clock.advance(1.0)
  with timer.busy("learner"):
    clock.advance(2.0)
  with timer.busy("rollout"):
    clock.advance(2.0)
  clock.advance(2.0)
  summary = timer.summary()
  assert summary["system/wall_s"] == 10.0
  assert summary["rollout/busy_s"] == 5.0
  assert summary["rollout/idle_ratio"] == 0.5
  assert summary["learner/busy_s"] == 2.0
  assert summary["learner/idle_ratio"] == pytest.approx(0.8)
  assert summary["reward/busy_s"] == 0.0 and summary["reward/idle_ratio"] == 1.0
  assert summary["sync/idle_ratio"] == 1.0


def test_overlapping_intervals_of_one_role_from_two_threads_count_once():
  clock = FakeClock()
  timer = metrics.RoleTimer(clock=clock)
  entered = [threading.Event(), threading.Event()]
  may_leave = [threading.Event(), threading.Event()]
  left = [threading.Event(), threading.Event()]

  def worker(i):
    with timer.busy("reward"):
      entered[i].set()
      may_leave[i].wait(timeout=10)
    left[i].set()

  threads = [threading.Thread(target=worker, args=(i,), name=f"reward-{i}") for i in range(2)]
  try:
    # reward busy over [0, 4] on one thread and [1, 6] on another: the union is 6 s, not 9 s.
    threads[0].start()
    assert entered[0].wait(timeout=5)
    clock.advance(1.0)
    threads[1].start()
    assert entered[1].wait(timeout=5)
    clock.advance(3.0)
    may_leave[0].set()
    assert left[0].wait(timeout=5)
    assert timer.busy_s("reward") == 4.0  # still open on the other thread: counted up to now
    clock.advance(2.0)
    may_leave[1].set()
    assert left[1].wait(timeout=5)
  finally:
    for event in may_leave:
      event.set()
    for thread in threads:
      thread.join(timeout=5)
  assert not any(thread.is_alive() for thread in threads)
  clock.advance(4.0)
  assert timer.busy_s("reward") == 6.0
  assert timer.summary()["reward/idle_ratio"] == pytest.approx(0.4)


def test_open_interval_counts_up_to_now_and_nested_busy_counts_once():
  clock = FakeClock()
  timer = metrics.RoleTimer(clock=clock)
  with timer.busy("learner"):
    clock.advance(1.0)
    with timer.busy("learner"):
      clock.advance(1.0)
    assert timer.busy_s("learner") == 2.0
    clock.advance(1.0)
  clock.advance(1.0)
  assert timer.busy_s("learner") == 3.0


def test_excluded_time_leaves_the_wall_clock():
  clock = FakeClock()
  timer = metrics.RoleTimer(clock=clock)
  with timer.busy("rollout"):
    clock.advance(2.0)
  with timer.excluded():
    clock.advance(6.0)
  clock.advance(2.0)
  assert timer.wall_s() == 4.0
  assert timer.summary()["rollout/idle_ratio"] == 0.5


def test_busy_time_is_recorded_even_when_the_body_raises():
  clock = FakeClock()
  timer = metrics.RoleTimer(clock=clock)
  with pytest.raises(RuntimeError), timer.busy("sync"):
    clock.advance(1.5)
    raise RuntimeError("boom")
  clock.advance(1.0)
  assert timer.busy_s("sync") == 1.5


def test_unknown_role_raises():
  timer = metrics.RoleTimer(roles=("a",), clock=FakeClock())
  with pytest.raises(KeyError, match="unknown role 'b'"), timer.busy("b"):
    pass
  assert set(timer.summary()) == {"system/wall_s", "a/busy_s", "a/idle_ratio"}


# ---- reductions --------------------------------------------------------------------------------
def test_reduce_metrics_divides_pairs_once():
  out = metrics.reduce_metrics({
      "kl": (np.float32(3.0), np.float32(4.0)),
      "empty": (0.0, 0.0),
      "grad_norm": np.asarray(2.5),
      "is_weight_max": 1.25,
      "algo/old_logprob_source": "recompute",
  }, prefix="algo/")
  assert out["algo/kl"] == 0.75
  assert math.isnan(out["algo/empty"])
  assert out["algo/grad_norm"] == 2.5 and isinstance(out["algo/grad_norm"], float)
  assert out["algo/is_weight_max"] == 1.25
  assert out["algo/algo/old_logprob_source"] == "recompute"


def test_sum_pairs_then_reduce_equals_the_global_mean():
  minibatches = [{"entropy": (2.0, 4.0), "loss": 1.0}, {"entropy": (6.0, 4.0), "loss": 3.0},
                 {"entropy": (1.0, 2.0), "loss": 5.0}]
  accumulated = {}
  for m in minibatches:
    accumulated = metrics.sum_pairs(accumulated, m)
  assert accumulated["entropy"] == (9.0, 10.0)
  assert accumulated["loss"] == 5.0  # non-pairs keep the latest
  assert metrics.reduce_metrics(accumulated)["entropy"] == 0.9


# ---- staleness -----------------------------------------------------------------------------------
def _sample(versions):
  n = len(versions)
  return Sample(prompt_id=0, group_id=0, group_size=2, prompt_tokens=[1, 2],
                response_tokens=np.zeros(n), behaviour_logprobs=np.zeros(n),
                token_versions=versions)


def test_staleness_metrics_on_hand_made_samples():
  groups = [[_sample([5, 5, 5]), _sample([3, 4, 5])],  # gaps 0 0 0 | 2 1 0
            [_sample([2, 5]), _sample([])]]  # gaps 3 0 | (none)
  out = metrics.staleness_metrics(groups, learner_version=5)
  gaps = [0, 0, 0, 2, 1, 0, 3, 0]
  assert out["algo/version_gap_mean"] == pytest.approx(np.mean(gaps))
  assert out["algo/version_gap_max"] == 3.0
  assert out["algo/stale_ratio"] == pytest.approx(3 / 8)
  assert out["algo/partial_ratio"] == pytest.approx(2 / 4)
  assert out["algo/max_partial_span"] == 3.0
  assert out["algo/version_gap_counts"] == [5, 1, 1, 1]  # tokens with gap 0, 1, 2, 3


def test_staleness_metrics_on_policy_and_empty():
  on_policy = metrics.staleness_metrics([[_sample([4, 4]), _sample([4])]], learner_version=4)
  assert on_policy == {"algo/version_gap_mean": 0.0, "algo/version_gap_max": 0.0,
                       "algo/stale_ratio": 0.0, "algo/partial_ratio": 0.0,
                       "algo/max_partial_span": 0.0, "algo/version_gap_counts": [3]}
  empty = metrics.staleness_metrics([], learner_version=4)
  assert empty["algo/version_gap_mean"] == 0.0 and empty["algo/partial_ratio"] == 0.0
  assert empty["algo/version_gap_counts"] == []


# ---- busy spans ------------------------------------------------------------------------------
def test_spans_are_merged_busy_intervals_on_the_run_clock():
  clock = FakeClock()
  timer = metrics.RoleTimer(clock=clock)
  clock.advance(1.0)
  with timer.busy("rollout"):
    clock.advance(2.0)
    with timer.busy("rollout"):  # nested: one span
      clock.advance(1.0)
  with timer.excluded():  # evaluation: removed from the clock the spans are on
    clock.advance(5.0)
  with timer.busy("learner"):
    clock.advance(0.5)
  assert timer.spans() == [("rollout", 1.0, 4.0), ("learner", 4.0, 4.5)]
  assert timer.wall_s() == 4.5


def test_spans_keep_only_the_latest():
  clock = FakeClock()
  timer = metrics.RoleTimer(clock=clock, max_spans=3)
  for _ in range(5):
    with timer.busy("sync"):
      clock.advance(1.0)
    clock.advance(1.0)
  assert timer.spans() == [("sync", 4.0, 5.0), ("sync", 6.0, 7.0), ("sync", 8.0, 9.0)]
  assert timer.summary()["sync/busy_s"] == 5.0  # the busy time still counts every interval
  # spans_since hands out only the kept ones, on the timer's own clock (it started at 100)
  closed, spans = timer.spans_since(1)
  assert closed == 5 and spans == [("sync", 104.0, 105.0), ("sync", 106.0, 107.0),
                                   ("sync", 108.0, 109.0)]
  assert timer.spans_since(4) == (5, [("sync", 108.0, 109.0)])


def test_spans_of_another_timer_land_on_this_timers_clock_without_its_excluded_time():
  clock = FakeClock()
  learner = metrics.RoleTimer(clock=clock)  # starts at 100
  clock.advance(2.0)
  server = metrics.RoleTimer(clock=clock)  # a rollout server started 2 s later
  with server.busy("rollout"):
    clock.advance(1.0)  # 102..103
  closed, spans = server.spans_since(0)
  assert closed == 1 and spans == [("rollout", 102.0, 103.0)]
  with learner.excluded():  # an evaluation: 103..107
    clock.advance(4.0)
  with server.busy("rollout"):
    clock.advance(1.0)  # 107..108
  with server.busy("reward"):
    with learner.excluded():  # a checkpoint inside it: 108..109
      clock.advance(0.5)
      clock.advance(0.5)
    clock.advance(0.5)  # 108..109.5
  closed, later = server.spans_since(closed)
  assert closed == 3 and later == [("rollout", 107.0, 108.0), ("reward", 108.0, 109.5)]
  assert server.spans_since(closed) == (3, [])
  learner.add_spans(spans + later)
  assert learner.spans() == [("rollout", 2.0, 3.0), ("rollout", 3.0, 4.0), ("reward", 4.0, 4.5)]
  assert learner.wall_s() == pytest.approx(4.5)
  assert learner.summary()["rollout/busy_s"] == 0.0  # a record only: busy totals are the server's
  with pytest.raises(KeyError, match="unknown role"):
    learner.add_spans([("decode", 0.0, 1.0)])
  with pytest.raises(RuntimeError, match="without excluded time"):
    learner.spans_since(0)


# ---- JSONL --------------------------------------------------------------------------------------
def test_jsonl_writer_writes_non_finite_as_null(tmp_path):
  path = tmp_path / "run" / "metrics.jsonl"
  writer = metrics.JsonlWriter(path)
  writer.write({"learner_step": 1, "loss": float("nan"), "kl": float("inf"),
                "gap": np.float64("-inf"), "reward": 0.5, "source": "recompute"})
  writer.write({"learner_step": 2, "loss": 0.25})
  writer.close()
  text = path.read_text()
  assert "NaN" not in text and "Infinity" not in text
  records = metrics.read_jsonl(path)
  assert records == [
      {"learner_step": 1, "loss": None, "kl": None, "gap": None, "reward": 0.5,
       "source": "recompute"},
      {"learner_step": 2, "loss": 0.25},
  ]
  again = metrics.JsonlWriter(path)  # appends, never truncates
  again.write({"learner_step": 3})
  again.close()
  assert [r["learner_step"] for r in metrics.read_jsonl(path)] == [1, 2, 3]


def test_jsonl_writer_is_safe_across_threads(tmp_path):
  path = tmp_path / "m.jsonl"
  writer = metrics.JsonlWriter(path)
  threads = [threading.Thread(target=lambda i=i: [writer.write({"thread": i, "n": n})
                                                  for n in range(50)], name=f"writer-{i}")
             for i in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=10)
  writer.close()
  records = metrics.read_jsonl(path)
  assert sorted((r["thread"], r["n"]) for r in records) == [(i, n) for i in range(4)
                                                            for n in range(50)]
