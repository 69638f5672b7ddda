"""The futex word: a wait on a stale value returns at once, a wake reaches a sleeper in another
thread, and the counter wraps within int32."""

import threading
from multiprocessing import shared_memory

import pytest

from jaxrl_async.sync import futex

pytestmark = pytest.mark.skipif(not futex.AVAILABLE, reason="no futexes on this platform")

TIMEOUT_S = 30.0


@pytest.fixture
def word():
  segment = shared_memory.SharedMemory(create=True, size=64)
  view = futex.word(segment.buf, 40)
  view[0] = 0
  yield view
  del view
  segment.close()
  segment.unlink()


def test_a_wait_on_a_changed_word_returns_at_once(word):
  futex.bump_and_wake(word)
  assert int(word[0]) == 1
  assert futex.wait(word, 0, TIMEOUT_S) is False  # 0 is stale: no sleep


def test_a_wake_reaches_a_sleeper(word):
  woke = threading.Event()

  def sleeper():
    # A lost wake would keep it asleep for the whole (long) timeout.
    while int(word[0]) == 0:
      futex.wait(word, 0, 600.0)
    woke.set()

  thread = threading.Thread(target=sleeper, name="futex-sleeper", daemon=True)
  thread.start()
  thread.join(0.2)  # most likely asleep by now (if not, the wait sees the change at once)
  futex.bump_and_wake(word)
  thread.join(TIMEOUT_S)
  assert woke.is_set() and not thread.is_alive()


def test_the_counter_wraps_within_int32(word):
  word[0] = 2**31 - 1
  futex.bump_and_wake(word)
  assert int(word[0]) == -(2**31)


def test_bad_arguments_are_refused(word):
  with pytest.raises(ValueError, match="aligned"):
    futex.word(bytearray(64), 2)
  for timeout in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="timeout"):
      futex.wait(word, 0, timeout)
