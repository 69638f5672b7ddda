"""Whether the other learner processes still live, as process 0 sees it while it waits for them.

Every follower raises a counter in the coordination service's key-value store every
ALIVE_EVERY_S (`signs_of_life`); process 0 takes a follower whose counter stood still SILENT_S
for gone (`Life`). Process 0 runs each step's body on a thread of its own and waits for it in
slices, watching the counters (`run_watching`): a body that blocks on a dead follower somewhere
that is neither a collective nor an acknowledgement (an orbax barrier in the coordination
service waits up to 20 minutes) is abandoned, before the service's heartbeat timeout aborts
the process.
"""

from __future__ import annotations

import contextlib
import threading
import time

import jax

ALIVE_KEY = "jaxrl_async/learner_alive/{process}"  # a counter each follower raises every second
ALIVE_EVERY_S = 1.0
SILENT_S = 30.0  # a follower whose counter stood still this long, while awaited, is gone
WATCH_SLICE_S = 2.0  # process 0's wait for a step's body, in slices of this length


class FollowerSilent(Exception):
  """Follower `process` gave no sign of life for `silent_s` seconds."""

  def __init__(self, process: int, silent_s: float):
    super().__init__(f"learner process {process}: no sign of life for {silent_s:.0f} s")
    self.process, self.silent_s = process, silent_s


class Life:
  """A follower's sign-of-life counter as process 0 sees it: how long it has stood still."""

  def __init__(self, client, process: int):
    self.client, self.process = client, process
    self.key = ALIVE_KEY.format(process=process)
    self.value, self.since = self._read(), time.monotonic()

  def _read(self):
    with contextlib.suppress(jax.errors.JaxRuntimeError):
      return self.client.key_value_increment(self.key, 0)

  def silent_s(self) -> float:
    value = self._read()
    if value != self.value:
      self.value, self.since = value, time.monotonic()
    return time.monotonic() - self.since


def check(lives, silent_s: float = SILENT_S) -> None:
  """Raises FollowerSilent for the first follower whose counter stood still `silent_s`."""
  for life in lives:
    if life.silent_s() >= silent_s:
      raise FollowerSilent(life.process, silent_s)


def signs_of_life(client, process: int, stop: threading.Event) -> None:
  """A follower's thread: raises its counter every ALIVE_EVERY_S until `stop`."""
  key = ALIVE_KEY.format(process=process)
  while not stop.wait(ALIVE_EVERY_S):
    with contextlib.suppress(Exception):
      client.key_value_increment(key, 1)


def run_watching(body, lives, *, silent_s: float = SILENT_S, slice_s: float = WATCH_SLICE_S):
  """`body()` on a daemon thread of its own -> its result (or its exception, raised here).

  While it runs, the followers' counters are read every `slice_s`: once one stood still
  `silent_s`, FollowerSilent is raised and the body is left where it blocks (the process is
  about to stop; a body blocked on a dead follower never returns). A KeyboardInterrupt while
  waiting is raised once the body has ended, so no new step starts beside a running one.
  """
  outcome: dict = {}

  def run():
    try:
      outcome["value"] = body()
    except BaseException as error:  # raised in the caller below
      outcome["error"] = error

  thread = threading.Thread(target=run, name="learner-step", daemon=True)
  thread.start()
  interrupted = None
  while thread.is_alive():
    try:
      thread.join(slice_s)
    except KeyboardInterrupt as interrupt:
      interrupted = interrupted or interrupt
    if thread.is_alive():
      check(lives, silent_s)
  if interrupted is not None:
    raise interrupted
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]
