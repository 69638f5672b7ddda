"""The watchdog ends a run that makes no version: stacks, state, rescue, exit code."""

import io
import threading
import time

import pytest

from jaxrl_async import faults
from jaxrl_async.watchdog import EXIT_CODE, Watchdog


def _stuck_here(event):
  event.wait(30)


def test_it_fires_without_progress_and_reports_stacks_state_and_the_point():
  exited, rescued, release = [], [], threading.Event()
  stuck = threading.Thread(target=_stuck_here, args=(release,), name="stuck-role", daemon=True)
  stuck.start()
  stream = io.StringIO()
  faults.hanging.add("sync.publish")
  try:
    with Watchdog(0.5, describe=lambda: "buffer: 3 queued", rescue=lambda: rescued.append(1),
                  exit_fn=exited.append, stream=stream) as watchdog:
      assert watchdog.fired.wait(10)
      deadline = time.monotonic() + 10
      while not exited and time.monotonic() < deadline:
        time.sleep(0.05)
  finally:
    faults.hanging.discard("sync.publish")
    release.set()
  text = stream.getvalue()
  assert exited == [EXIT_CODE] and rescued == [1]
  assert "no policy version for" in text
  assert "fault point sync.publish" in text
  assert "_stuck_here" in text  # every thread's stack
  assert "buffer: 3 queued" in text


def test_progress_keeps_it_quiet():
  exited = []
  with Watchdog(0.6, exit_fn=exited.append, stream=io.StringIO()) as watchdog:
    for _ in range(15):
      watchdog.progress()
      time.sleep(0.1)
  assert not watchdog.fired.is_set() and exited == []


def test_a_rescue_that_hangs_is_bounded():
  exited, stream = [], io.StringIO()
  with Watchdog(0.3, rescue=lambda: time.sleep(30), rescue_s=0.5, exit_fn=exited.append,
                stream=stream) as watchdog:
    assert watchdog.fired.wait(10)
    deadline = time.monotonic() + 10
    while not exited and time.monotonic() < deadline:
      time.sleep(0.05)
  assert exited == [EXIT_CODE]
  assert "no checkpoint written" in stream.getvalue()


def test_a_bad_bound_is_refused():
  with pytest.raises(ValueError, match="watchdog_timeout_s"):
    Watchdog(0)


def test_the_first_version_gets_the_startup_bound():
  exited = []
  with Watchdog(0.3, startup_s=3.0, exit_fn=exited.append, stream=io.StringIO()) as watchdog:
    time.sleep(1.0)  # past timeout_s, within startup_s: still compiling
    assert not watchdog.fired.is_set()
    watchdog.progress()
    assert watchdog.fired.wait(5)  # after the first version, timeout_s holds
    deadline = time.monotonic() + 10
    while not exited and time.monotonic() < deadline:
      time.sleep(0.05)
  assert exited == [EXIT_CODE]
