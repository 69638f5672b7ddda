"""Tests for jaxrl_async.rollout.rewards: failures, timeouts and retries are data, never raised."""

import threading
import time

import numpy as np
import pytest

from jaxrl_async.rollout.rewards import RewardPool, spread
from jaxrl_async.types import Sample

TIMEOUT_S = 0.2


def _samples(kinds):
  return [Sample(prompt_id=i, group_id=i, group_size=1, prompt_tokens=[1, 5],
                 response_tokens=[6, 2], behaviour_logprobs=[-0.1, -0.2], token_versions=[0, 0],
                 meta={"kind": kind, "index_in_group": 0}) for i, kind in enumerate(kinds)]


class Verifier:
  """Reward by meta['kind']; counts calls per sample (thread-safe)."""

  def __init__(self):
    self.calls = {}
    self.release = threading.Event()  # lets sleeping calls end when the test is over
    self._lock = threading.Lock()

  def __call__(self, prompt_tokens, response_tokens, meta):
    with self._lock:
      self.calls[meta["kind"]] = self.calls.get(meta["kind"], 0) + 1
    kind = meta["kind"]
    if kind == "raise":
      raise RuntimeError("verifier crashed")
    if kind == "sleep":
      self.release.wait(timeout=5 * TIMEOUT_S)
      return 1.0
    if kind == "nan":
      return float("nan")
    if kind == "inf":
      return float("inf")
    if kind == "text":
      return "not a number"
    if kind == "flaky":  # fails on the first call only
      if self.calls[kind] == 1:
        raise ValueError("transient")
      return 0.5
    return float(len(response_tokens))


@pytest.fixture
def verifier():
  v = Verifier()
  yield v
  v.release.set()


def test_statuses_retries_and_counts(verifier):
  pool = RewardPool(verifier, num_workers=3, timeout_s=TIMEOUT_S, max_retries=1,
                    clock=lambda: 42.0)
  try:
    kinds = ["ok", "raise", "sleep", "nan", "ok", "flaky", "inf"]
    samples = _samples(kinds)
    done = pool.score_all(samples)
  finally:
    pool.close()
  assert [s.prompt_id for s in done] == list(range(len(kinds)))  # same samples, same order
  assert all(d is s for d, s in zip(done, samples))
  by_kind = {s.meta["kind"] + str(s.prompt_id): s for s in done}
  expected = {"ok0": ("ok", 2.0, 0), "raise1": ("failed", None, 1), "sleep2": ("timeout", None, 1),
              "nan3": ("failed", None, 1), "ok4": ("ok", 2.0, 0), "flaky5": ("ok", 0.5, 1),
              "inf6": ("failed", None, 1)}
  for name, (status, reward, retries) in expected.items():
    sample = by_kind[name]
    assert sample.reward_status == status, name
    assert sample.retries == retries, name
    if reward is None:
      assert np.isnan(sample.reward), name
    else:
      assert sample.reward == reward, name
    assert sample.timestamps["rewarded"] == 42.0
  assert pool.counts == {"ok": 3, "failed": 3, "timeout": 1, "retries": 5}
  assert verifier.calls["raise"] == 2 and verifier.calls["sleep"] == 2
  assert verifier.calls["ok"] == 2  # no retry after a success


def test_no_retries_means_one_call(verifier):
  pool = RewardPool(verifier, num_workers=1, timeout_s=TIMEOUT_S, max_retries=0)
  try:
    sample = pool.score(_samples(["raise"])[0])
  finally:
    pool.close()
  assert (sample.reward_status, sample.retries) == ("failed", 0)
  assert verifier.calls == {"raise": 1}


def test_timeouts_do_not_block_the_other_samples(verifier):
  pool = RewardPool(verifier, num_workers=2, timeout_s=TIMEOUT_S, max_retries=0)
  try:
    begin = time.monotonic()
    futures = [pool.submit(s) for s in _samples(["sleep", "sleep", "ok", "ok", "ok"])]
    done = [f.result(timeout=10) for f in futures]
    elapsed = time.monotonic() - begin
  finally:
    pool.close()
  assert [s.reward_status for s in done] == ["timeout", "timeout", "ok", "ok", "ok"]
  # Abandoned calls keep their call workers, but the drivers move on after the timeout.
  assert elapsed < 5 * TIMEOUT_S


def test_a_hung_call_in_a_batch_does_not_hold_the_rest(verifier):
  pool = RewardPool(verifier, num_workers=1, timeout_s=TIMEOUT_S, max_retries=0)
  try:
    begin = time.monotonic()
    done = pool.submit_many(_samples(["ok", "sleep", "ok", "raise", "ok", "text"])).result(
        timeout=10)
    elapsed = time.monotonic() - begin
  finally:
    pool.close()
  assert [s.reward_status for s in done] == ["ok", "timeout", "ok", "failed", "ok", "failed"]
  assert [s.reward for s in done if s.reward_status == "ok"] == [2.0, 2.0, 2.0]
  assert verifier.calls == {"ok": 3, "sleep": 1, "raise": 1, "text": 1}  # nothing run twice
  assert elapsed < 3 * TIMEOUT_S  # one timeout, then the rest on another call thread
  assert pool.counts == {"ok": 3, "failed": 2, "timeout": 1, "retries": 0}


@pytest.mark.parametrize("items, parts, lengths", [
    (list(range(10)), 4, [3, 3, 2, 2]),
    (list(range(3)), 8, [1, 1, 1]),
    (list(range(8)), 1, [8]),
    ([], 3, []),
])
def test_spread_cuts_in_order_into_near_equal_runs(items, parts, lengths):
  runs = spread(items, parts)
  assert [len(run) for run in runs] == lengths
  assert [x for run in runs for x in run] == items


def test_spread_refuses_no_parts():
  with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
    spread([1], 0)


def test_one_steps_samples_are_scored_by_every_worker_at_once():
  """A batch spread over 4 workers: each call waits for 4 calls to be in flight together, which
  a batch scored by one worker, one call after another, never reaches (the calls time out)."""
  barrier = threading.Barrier(4, timeout=2.0)

  def verifier(prompt_tokens, response_tokens, meta):
    barrier.wait()
    return 1.0

  pool = RewardPool(verifier, num_workers=4, timeout_s=5.0, max_retries=0)
  try:
    samples = _samples(["ok"] * 8)
    done = pool.submit_spread(samples).result(timeout=10)
  finally:
    pool.close()
  assert done == samples  # the same list, in order, scored
  assert [s.reward_status for s in done] == ["ok"] * 8
  assert pool.counts["ok"] == 8


def test_a_spread_batch_that_fails_fails_the_whole():
  """A reward function's SystemExit is the caller's to raise (not a reward failure): the batch
  that met it fails, and with it the whole call, after the other batch is scored."""
  def verifier(prompt_tokens, response_tokens, meta):
    if meta["kind"] == "exit":
      raise SystemExit("verifier asked to exit")
    return 1.0

  pool = RewardPool(verifier, num_workers=2, timeout_s=5.0, max_retries=0)
  try:
    samples = _samples(["ok", "ok", "exit", "ok"])
    with pytest.raises(SystemExit, match="verifier asked to exit"):
      pool.submit_spread(samples).result(timeout=10)
    assert [s.reward_status for s in samples[:2]] == ["ok", "ok"]  # the other batch
    assert pool.submit_spread([]).result(timeout=1) == []
  finally:
    pool.close()


@pytest.mark.parametrize("kwargs, match", [
    ({"num_workers": 0}, r"num_workers must be >= 1, got 0"),
    ({"timeout_s": 0.0}, r"timeout_s must be > 0, got 0.0"),
    ({"max_retries": -1}, r"max_retries must be >= 0, got -1"),
])
def test_bad_configuration_names_the_knob(kwargs, match):
  with pytest.raises(ValueError, match=match):
    RewardPool(lambda *a: 1.0, **kwargs)
