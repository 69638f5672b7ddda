"""The RLVR workload: published response lengths scaled onto the digit-reverse task, and a
verifier service on 127.0.0.1 with a concurrency limit, a latency model, timeouts and a
lifetime tied to its parent. Every service here is started by the test itself."""

import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.rollout.rewards import RewardPool
from jaxrl_async.run import api
from jaxrl_async.tasks import rlvr
from jaxrl_async.tasks.rlvr import RLVRReverseTask, request_id
from jaxrl_async.tasks.verifier_service import (
    VerifierError,
    VerifierProcess,
    VerifierSettings,
    VerifierTimeout,
    latency_s,
)
from jaxrl_async.types import RewardStatus, Sample

FAST = VerifierSettings(time_scale=1e-3, concurrency=2)  # median 0.3 ms, timeouts 30 ms


@pytest.fixture
def start():
  """Starts verifier services for a test and stops every one of them after it."""
  processes = []

  def started(settings: VerifierSettings) -> VerifierProcess:
    processes.append(VerifierProcess.start(settings))
    return processes[-1]

  yield started
  for process in processes:
    process.stop()


def alive(pid: int) -> bool:
  """Whether process `pid` runs (a zombie left for a reaper that never comes counts as ended)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
      return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
  except FileNotFoundError:
    return False


def stopped(pid: int, timeout_s: float = 10.0) -> None:
  """Waits until every thread of `pid` is stopped: a SIGSTOP takes effect after kill returns."""
  def states() -> list[str]:
    found = []
    for tid in os.listdir(f"/proc/{pid}/task"):
      with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as f:
        found.append(f.read().rsplit(")", 1)[1].split()[0])
    return found

  deadline = time.monotonic() + timeout_s
  while any(state not in ("T", "t") for state in states()):
    assert time.monotonic() < deadline, f"process {pid} did not stop: {states()}"
    time.sleep(0.01)


def answer(task, digits: str, reverse: bool = True):
  """(prompt tokens, response tokens) for `digits`, answered right or copied."""
  tok = task.tokenizer
  prompt = np.concatenate([[tok.bos_id], tok.encode(digits), [tok.equals_id]])
  body = tok.encode(digits[::-1] if reverse else digits).tolist()
  return prompt, np.asarray(body + [tok.eos_id], np.int32)


# ---- lengths -------------------------------------------------------------------------------
def test_scaling_a_log_uniform_table_matches_hand_computed_masses():
  # Lengths log-uniform on [10, 1000] source tokens, cap 1000 -> 10: response r holds
  # F((r + 1/2) * 100) - F((r - 1/2) * 100) with F(x) = log(x / 10) / log(100).
  points = rlvr.check_quantiles(((0.0, 10), (1.0, 1000)), 1000)
  responses, probs = rlvr.scaled_response_lengths(points, 1000, 1, 10)
  cdf = lambda x: math.log(x / 10) / math.log(100)  # noqa: E731
  expected = [cdf(150)] + [cdf((r + 0.5) * 100) - cdf((r - 0.5) * 100) for r in range(2, 10)]
  expected.append(1 - cdf(950))
  np.testing.assert_array_equal(responses, np.arange(1, 11))
  np.testing.assert_allclose(probs, expected, rtol=1e-12)


def test_a_repeated_length_is_a_point_mass_at_the_cap():
  points = rlvr.check_quantiles(((0.0, 10), (0.9, 100), (1.0, 100)), 100)
  _, probs = rlvr.scaled_response_lengths(points, 100, 1, 10)
  assert probs[-1] == pytest.approx(0.1 + 0.9 * (1 - math.log(95 / 10) / math.log(10)))


def test_sampled_lengths_match_the_scaled_published_quantiles():
  task = RLVRReverseTask(0)
  scale = task.max_response_len / rlvr.ROLLPACKER_MAX_RESPONSE_LEN  # 96 / 16384
  published = dict(rlvr.ROLLPACKER_CODE_LENGTHS)
  responses = np.asarray([len(task.problem(i).meta["digits"]) + 1 for i in range(20_000)])
  for q in (0.5, 0.9, 0.95):  # the scaled published length, to within rounding (+- 1 token)
    assert abs(np.quantile(responses, q) - published[q] * scale) <= 1.0, q
  # p99 falls in the tail the published run reached (15135 tokens and more), scaled.
  assert np.quantile(responses, 0.99) >= published[0.9898] * scale - 1
  # The share cut at the cap: 0.91% published, 0.92% after rounding; binomial sd 0.07%.
  at_cap = np.mean(responses == task.max_response_len)
  assert abs(at_cap - 0.0092) < 4 * math.sqrt(0.0092 * 0.9908 / len(responses))
  assert task.max_prompt_len + task.max_response_len == task.max_sequence_len == 193


def test_bad_settings_fail_naming_the_setting():
  for kwargs, name in (({"concurrency": 0}, "concurrency"), ({"latency_min_s": -0.1},
                        "latency_min_s"), ({"latency_sigma": -1.0}, "latency_sigma"),
                       ({"time_scale": 0.0}, "time_scale"), ({"timeout_fraction": 1.0},
                        "timeout_fraction"), ({"latency_max_s": 0.2}, "latency_max_s"),
                       ({"call_timeout_s": 0}, "call_timeout_s")):
    with pytest.raises(ValueError, match=name):
      VerifierSettings(**kwargs)
  with pytest.raises(ValueError, match="length_quantiles"):
    RLVRReverseTask(length_quantiles=((0.1, 5), (1.0, 10)))
  with pytest.raises(ValueError, match="source_max_response_len"):
    RLVRReverseTask(length_quantiles=((0.0, 5), (1.0, 20_000)))
  with pytest.raises(ValueError, match="call_timeout_s"):
    RLVRReverseTask(verifier=VerifierSettings(time_scale=1.0, call_timeout_s=10.0))


# ---- latency model -------------------------------------------------------------------------
def test_latencies_follow_the_configured_distribution_reproducibly():
  settings = VerifierSettings(time_scale=1.0)
  draws = np.asarray([latency_s(settings, i) for i in range(20_000)])
  timed_out = draws == settings.latency_max_s
  assert abs(timed_out.mean() - 0.05) < 4 * math.sqrt(0.05 * 0.95 / len(draws))
  body = draws[~timed_out]
  assert np.median(body) == pytest.approx(0.30, rel=0.03)
  assert np.quantile(body, 0.9) == pytest.approx(0.30 * math.exp(1.2816 * 0.70), rel=0.05)
  assert body.min() >= settings.latency_min_s
  assert latency_s(settings, 7) == latency_s(settings, 7)
  assert latency_s(VerifierSettings(time_scale=0.01), 7) == pytest.approx(0.01 * draws[7])


def test_each_answer_takes_at_least_its_drawn_latency(start):
  settings = VerifierSettings(time_scale=0.05, concurrency=8, timeout_fraction=0.0)
  client = start(settings).client()
  task = RLVRReverseTask(0)
  prompt, response = answer(task, "123")
  verdicts = [client.verify(i, prompt, response) for i in range(40)]
  drawn = np.asarray([latency_s(settings, i) for i in range(40)])  # median 15 ms
  service = np.asarray([v.service_s for v in verdicts])
  assert all(v.reward == 1.0 for v in verdicts)
  assert np.all(service >= drawn)
  assert np.median(service - drawn) < 0.25 * np.median(drawn) + 0.01  # sleep's overshoot only


# ---- the service ---------------------------------------------------------------------------
def test_never_more_than_concurrency_requests_at_once_and_fifo_beyond(start):
  settings = VerifierSettings(concurrency=3, latency_median_s=1.0, latency_sigma=0.0,
                              timeout_fraction=0.0, time_scale=0.03)  # every request 30 ms
  process = start(settings)
  client = process.client()
  prompt, response = answer(RLVRReverseTask(0), "42")
  verdicts, lock = [], threading.Lock()

  def caller(first: int) -> None:
    for i in range(first, first + 4):
      verdict = client.verify(i, prompt, response)
      with lock:
        verdicts.append(verdict)

  threads = [threading.Thread(target=caller, args=(4 * k,)) for k in range(8)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=60)
  assert len(verdicts) == 32
  # Overlap of the answers' [started_at, finished_at]: an end before a start at equal times.
  events = sorted([(v.started_at, 1) for v in verdicts] + [(v.finished_at, -1) for v in verdicts])
  running = np.cumsum([step for _, step in events])
  assert running.max() == 3
  stats = client.stats()
  assert stats["max_active"] == 3 and stats["requests"] == stats["completed"] == 32
  assert max(v.queue_s for v in verdicts) > 0.03  # 8 callers, 3 slots: requests waited


def test_a_killed_or_hung_service_gives_a_clear_error_within_the_timeout(start):
  process = start(VerifierSettings(time_scale=1e-3, call_timeout_s=1.0, connect_timeout_s=1.0))
  client = process.client()
  task = RLVRReverseTask(0)
  prompt, response = answer(task, "907")
  assert client.verify(1, prompt, response).reward == 1.0
  os.kill(process.process.pid, signal.SIGSTOP)  # hung: the call times out
  stopped(process.process.pid)
  began = time.monotonic()
  with pytest.raises(VerifierTimeout, match="call_timeout_s=1.0"):
    client.verify(2, prompt, response)
  assert time.monotonic() - began < 10.0  # bounded by the call's timeout, not a hang
  process.process.kill()  # dead: refused at once
  os.kill(process.process.pid, signal.SIGCONT)
  process.process.wait(timeout=10)
  began = time.monotonic()
  with pytest.raises(VerifierError, match="unreachable"):
    client.verify(3, prompt, response)
  assert time.monotonic() - began < 10.0  # bounded by the connect timeout, not a hang
  # In a reward pool the two are counted as a timeout and a failure, never trained on.
  pool = RewardPool(task.with_client(client).reward, num_workers=1, timeout_s=5, max_retries=0)
  sample = Sample(prompt_id=0, group_id=0, group_size=1, prompt_tokens=prompt,
                  response_tokens=response, behaviour_logprobs=np.zeros(len(response)),
                  token_versions=np.zeros(len(response)), meta={"split": "train"})
  assert pool.score(sample).reward_status == RewardStatus.FAILED.value
  pool.close()


def test_the_service_ends_when_its_parent_ends(tmp_path):
  parent = textwrap.dedent("""
      import sys, time
      from jaxrl_async.tasks.verifier_service import VerifierProcess, VerifierSettings
      process = VerifierProcess.start(VerifierSettings())
      print(process.process.pid, flush=True)
      time.sleep(600)
  """)
  runner = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
  try:
    service_pid = int(runner.stdout.readline())
    assert alive(service_pid)
  finally:
    runner.kill()  # SIGKILL: the parent cannot stop its service itself
    runner.wait(timeout=10)
  deadline = time.monotonic() + 10
  while alive(service_pid) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not alive(service_pid)


def test_stop_ends_the_service_and_later_calls_fail_clearly(start):
  process = start(FAST)
  client = process.client()
  assert process.stop() == 0
  with pytest.raises(VerifierError, match="unreachable"):
    client.stats()


# ---- the task ------------------------------------------------------------------------------
def test_services_route_training_answers_to_the_service_and_the_task_pickles():
  task = RLVRReverseTask(0, verifier=FAST)
  right, copied = answer(task, "5061"), answer(task, "5061", reverse=False)
  assert task.client is None and task.reward(*right, {"split": "train"}) == 1.0  # local
  with task.services(log=lambda *a: None) as served:
    assert served.client is not None and repr(served) == repr(task)  # same warm start
    remote = pickle.loads(pickle.dumps(served))  # as a rollout server receives it
    assert remote.reward(*right, {"split": "train"}) == 1.0
    assert remote.reward(*copied, {"split": "train"}) == 0.0
    assert remote.reward(*right, {"split": "eval"}) == 1.0  # held out: checked locally
    metrics = served.data_metrics()
    assert metrics["verifier/requests"] == metrics["verifier/completed"] == 2
    assert metrics["verifier/max_active"] == 1
    assert served.reward(*right, {}) == 1.0 and request_id(*right) == request_id(*right)
  with pytest.raises(VerifierError):
    served.reward(*right, {"split": "train"})  # the service is gone with the context


@pytest.mark.slow
def test_a_run_on_the_threads_backend_takes_its_rewards_from_the_service(tmp_path):
  task = RLVRReverseTask(0, max_len=15, verifier=FAST)
  config = RunConfig(mode="on_policy", backend="threads", task=task,
                     warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=4,
                     mini_batch_size=2, total_samples=3 * 2 * 4, max_concurrent_decodes=8,
                     reward_workers=4, eval_size=16, eval_every_versions=2,
                     checkpoint_every_versions=10)
  summary = api.run(config, tmp_path / "run", progress=False, log=lambda *a: None)
  assert summary["consumed_samples"] == 24
  assert summary["verifier/requests"] >= 24 and summary["verifier/errors"] == 0
  assert 1 <= summary["verifier/max_active"] <= FAST.concurrency
  assert "eval/accuracy" in summary
