import math
import os
import pickle

import numpy as np
import pytest

from jaxrl_async.rollout.rewards import RewardPool
from jaxrl_async.tasks import math_rewards
from jaxrl_async.tasks.subprocess_reward import (
    RewardCrashed,
    RewardTimeout,
    SubprocessReward,
    extract_code,
    python_tests_reward,
)
from jaxrl_async.types import RewardStatus, Sample

from . import verifiers


@pytest.fixture
def close_later():
  rewards = []
  yield rewards.append
  for reward in rewards:
    reward.close()


def test_answers_and_reuses_its_worker(close_later):
  reward = SubprocessReward(verifiers.add_one, timeout_s=30)
  close_later(reward)
  assert reward(1.0) == 2.0 and reward(2.5) == 3.5
  assert reward.counts == {"calls": 2, "timeouts": 0, "crashes": 0, "workers_started": 1}


def test_a_call_past_its_limit_is_killed_and_raises_timeout(close_later, tmp_path):
  reward = SubprocessReward(verifiers.write_pid_then_sleep, timeout_s=1.0)
  close_later(reward)
  pid_file = tmp_path / "pid"
  with pytest.raises(RewardTimeout, match="past 1.0 s"):
    reward(str(pid_file), 120.0)
  pid = int(pid_file.read_text())
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)  # the verifier's process is gone
  assert issubclass(RewardTimeout, TimeoutError)
  assert reward(str(pid_file), 0.0) == 1.0  # a fresh worker takes the next call
  assert reward.counts["timeouts"] == 1 and reward.counts["workers_started"] == 2


@pytest.mark.parametrize("fn, args, match", [
    (verifiers.raise_value_error, ("x",), "ValueError: cannot score 'x'"),
    (verifiers.exit_hard, (3,), "exited with code 3"),
])
def test_errors_and_crashes_raise_reward_crashed(close_later, fn, args, match):
  reward = SubprocessReward(fn, timeout_s=30)
  close_later(reward)
  with pytest.raises(RewardCrashed, match=match):
    reward(*args)
  assert not issubclass(RewardCrashed, TimeoutError)


def test_memory_limit(close_later):
  reward = SubprocessReward(verifiers.allocate_mb, timeout_s=30, memory_mb=256)
  close_later(reward)
  assert reward(8) == 8 * 1024 * 1024
  with pytest.raises(RewardCrashed, match="MemoryError"):
    reward(1024)


def test_pickles_without_its_workers(close_later):
  reward = SubprocessReward(verifiers.add_one, timeout_s=30)
  close_later(reward)
  reward(0.0)
  again = pickle.loads(pickle.dumps(reward))
  close_later(again)
  assert again(1.0) == 2.0 and again.counts["workers_started"] == 1


def test_bad_arguments():
  with pytest.raises(ValueError, match="timeout_s"):
    SubprocessReward(verifiers.add_one, timeout_s=0)
  with pytest.raises(ValueError, match="memory_mb"):
    SubprocessReward(verifiers.add_one, memory_mb=1)
  with pytest.raises(TypeError, match="callable"):
    SubprocessReward(3)
  with pytest.raises(Exception, match="lambda"):
    SubprocessReward(lambda x: x)  # cannot reach a worker process


class _TextVerifier:
  """A reward pool's (prompt, response, meta) call, scored in a subprocess by meta['kind']."""

  def __init__(self):
    self.inner = SubprocessReward(verifiers.sleep_then, timeout_s=1.0)

  def __call__(self, prompt_tokens, response_tokens, meta):
    kind = meta["kind"]
    if kind == "slow":
      return self.inner(60.0, 1.0)
    if kind == "crash":
      return SubprocessReward(verifiers.exit_hard, timeout_s=30)(1)
    return self.inner(0.0, 0.5)


def test_the_reward_pool_counts_timeouts_and_failures_and_scores_the_rest():
  verifier = _TextVerifier()
  samples = [Sample(prompt_id=i, group_id=i, group_size=1, prompt_tokens=[1, 5],
                    response_tokens=[6, 2], behaviour_logprobs=[-0.1, -0.2],
                    token_versions=[0, 0], meta={"kind": kind, "index_in_group": 0})
             for i, kind in enumerate(["ok", "slow", "crash", "ok"])]
  pool = RewardPool(verifier, num_workers=1, timeout_s=60.0, max_retries=0)
  try:
    pool.score_many(samples)
  finally:
    pool.close()
    verifier.inner.close()
  assert [s.reward_status for s in samples] == [RewardStatus.OK.value, RewardStatus.TIMEOUT.value,
                                                RewardStatus.FAILED.value, RewardStatus.OK.value]
  assert [s.reward for s in samples][::3] == [0.5, 0.5]
  assert math.isnan(samples[1].reward) and math.isnan(samples[2].reward)
  assert pool.counts == {"ok": 2, "failed": 1, "timeout": 1, "retries": 0}


def test_math_reward_in_a_subprocess(close_later):
  reward = SubprocessReward(math_rewards.MathReward(), timeout_s=60)
  close_later(reward)
  assert reward("#### 72", "so #### 72") == 1.0
  assert reward("#### 71", "so #### 72") == 0.0


@pytest.mark.parametrize("response, expected", [
    ("```python\ndef add(a, b):\n    return a + b\n```", 1.0),
    ("First try:\n```python\ndef add(a, b): return a - b\n```\nFixed:\n```py\n"
     "def add(a, b):\n    return b + a\n```", 1.0),                    # the last block
    ("```python\ndef add(a, b):\n    return a - b\n```", 0.0),       # a failing assert
    ("```python\ndef add(a, b) return a + b\n```", 0.0),            # a syntax error
    ("def add(a, b): return a + b", 0.0),                            # no code block
    ("```python\n```", 0.0),
    ("```python\nimport sys\nsys.exit(0)\n```", 0.0),               # exits before the tests
    ("```python\nimport os\nos._exit(0)\n```", 0.0),
    ("```python\ndef add(a, b): return a + b\nprint('tests passed')\n```", 1.0),  # prints ok
])
def test_python_tests_reward(response, expected):
  tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
  assert python_tests_reward(response, tests, timeout_s=60) == expected


def test_python_tests_reward_kills_a_program_past_its_limit():
  with pytest.raises(RewardTimeout):
    python_tests_reward("```python\nwhile True:\n    pass\n```", "", timeout_s=1.0)


def test_python_tests_reward_memory_limit():
  response = "```python\nx = bytearray(4 << 30)\n```"
  assert python_tests_reward(response, "", timeout_s=60, memory_mb=256) == 0.0


def test_extract_code():
  assert extract_code("```\nprint(1)\n```") == "print(1)\n"
  assert extract_code("no code") is None and extract_code(None) is None
  assert np.isscalar(python_tests_reward("```python\nprint(1)\n```", "", timeout_s=60))
