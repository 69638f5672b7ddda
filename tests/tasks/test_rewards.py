import math
import threading

import numpy as np
import pytest

from jaxrl_async.tasks.rewards import FlakyReward, accuracy, reverse_reward

EOS = 2
TARGET = [7, 6, 5]  # token ids of the reversed digits


@pytest.mark.parametrize("response, expected", [
    ([7, 6, 5, EOS], 1.0),  # correct
    ([7, 6, 5, EOS, 9, 9, 0], 1.0),  # tokens after the first <eos> are ignored
    ([7, 6, 5, EOS, EOS], 1.0),
    ([7, 6, 6, EOS], 0.0),  # a wrong digit
    ([7, 6, 5], 0.0),  # no <eos>: cut at the length limit
    ([7, 6, 5, 5, EOS], 0.0),  # an extra digit
    ([7, 6, EOS], 0.0),  # a missing digit
    ([EOS, 7, 6, 5, EOS], 0.0),  # <eos> first: empty answer
    ([], 0.0),  # empty response
    ([0, 7, 6, 5, EOS], 0.0),  # a pad token is not skipped
])
def test_reverse_reward_cases(response, expected):
  assert reverse_reward(np.asarray(response, np.int32), TARGET, EOS) == expected


def test_accuracy():
  assert accuracy([1.0, 0.0, 1.0, 1.0]) == 0.75
  assert accuracy([1.0, math.nan]) == 0.5  # a failed reward counts as not correct
  assert math.isnan(accuracy([]))


def _const_reward(value=1.0):
  return lambda prompt, response, meta: value


def _meta(i):
  return {"index_in_group": i}


PROMPT = np.array([1, 6, 7, 4], np.int32)


def test_flaky_fails_exactly_every_kth_call():
  flaky = FlakyReward(_const_reward(), fail_every=3)
  outcomes = []
  for i in range(10):
    try:
      outcomes.append(flaky(PROMPT, [], _meta(i)))
    except RuntimeError as e:
      assert f"call {i + 1}" in str(e)
      outcomes.append("fail")
  assert [i + 1 for i, o in enumerate(outcomes) if o == "fail"] == [3, 6, 9]
  assert flaky.calls == 10 and flaky.failures == 3


def test_flaky_nan_every():
  flaky = FlakyReward(_const_reward(), nan_every=2)
  values = [flaky(PROMPT, [], _meta(i)) for i in range(6)]
  assert [math.isnan(v) for v in values] == [False, True] * 3
  assert flaky.nans == 3


def test_flaky_failure_count_is_exact_under_threads():
  flaky = FlakyReward(_const_reward(), fail_every=4)
  failures = []
  lock = threading.Lock()

  def worker(offset):
    for i in range(50):
      try:
        flaky(PROMPT, [], _meta(offset * 100 + i))
      except RuntimeError:
        with lock:
          failures.append(1)

  threads = [threading.Thread(target=worker, args=(k,), name=f"reward-{k}") for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert flaky.calls == 200 and len(failures) == 50 == flaky.failures


def _fails(flaky, meta):
  try:
    flaky(PROMPT, [], meta)
    return False
  except RuntimeError:
    return True


def test_flaky_by_sample_is_deterministic_and_transient():
  flaky = FlakyReward(_const_reward(), fail_prob=0.3, fail_attempts=2, seed=5)
  chosen = [i for i in range(200) if flaky.sample_fails(PROMPT, _meta(i))]
  assert 30 < len(chosen) < 90  # about 30% of the samples
  # Same seed, same choice; another seed, another choice.
  twin = FlakyReward(_const_reward(), fail_prob=0.3, seed=5)
  assert chosen == [i for i in range(200) if twin.sample_fails(PROMPT, _meta(i))]
  other = FlakyReward(_const_reward(), fail_prob=0.3, seed=6)
  assert chosen != [i for i in range(200) if other.sample_fails(PROMPT, _meta(i))]
  # Chosen samples fail on their first two attempts, then answer; the rest never fail.
  for attempt in range(4):
    failed = [i for i in range(200) if _fails(flaky, _meta(i))]
    assert failed == (chosen if attempt < 2 else [])
  assert flaky.failures == 2 * len(chosen)


def test_flaky_permanent_failure():
  flaky = FlakyReward(_const_reward(), fail_prob=1.0)
  assert all(_fails(flaky, _meta(0)) for _ in range(5))


def test_flaky_slow_call_waits_and_close_releases():
  flaky = FlakyReward(_const_reward(0.5), slow_every=2, delay_s=30.0)
  assert flaky(PROMPT, [], _meta(0)) == 0.5  # call 1: fast
  result = []
  thread = threading.Thread(target=lambda: result.append(flaky(PROMPT, [], _meta(1))),
                            name="slow-reward")
  thread.start()
  thread.join(timeout=0.2)
  assert thread.is_alive() and not result  # call 2 sleeps past a caller's timeout
  flaky.close()
  thread.join(timeout=10)
  assert not thread.is_alive() and result == [0.5]
  assert flaky.slow_calls == 1


def test_flaky_slow_by_sample():
  flaky = FlakyReward(_const_reward(), slow_prob=0.5, delay_s=0.0, seed=1)
  slow = [i for i in range(100) if flaky.sample_is_slow(PROMPT, _meta(i))]
  for i in range(100):
    flaky(PROMPT, [], _meta(i))
  assert flaky.slow_calls == len(slow) and 20 < len(slow) < 80


@pytest.mark.parametrize("kwargs, knob", [
    ({"fail_every": 0}, "fail_every"),
    ({"fail_prob": 1.5}, "fail_prob"),
    ({"slow_prob": -0.1}, "slow_prob"),
    ({"fail_attempts": 0}, "fail_attempts"),
    ({"delay_s": -1.0}, "delay_s"),
])
def test_flaky_rejects_bad_knobs(kwargs, knob):
  with pytest.raises(ValueError, match=knob):
    FlakyReward(_const_reward(), **kwargs)
