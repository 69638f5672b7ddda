"""A watchdog for runs: no wait anywhere lasts beyond a bound.

The run calls `progress()` each time it makes a policy version (and when an evaluation or a
checkpoint after it finishes). If `timeout_s` passes without
one (`startup_s` for the first, which includes compilation), the watchdog thread
1. prints every thread's stack and the state it was given (`describe()`: buffer, ledger),
   and names the fault point a thread is blocked at, when a fault plan made it hang;
2. calls `rescue()` (stop the roles, write a checkpoint if they stop), bounded by `rescue_s`;
3. ends the process with exit code `EXIT_CODE` (os._exit: a hung thread cannot hold it open).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from jaxrl_async import faults

EXIT_CODE = 3


class Watchdog:

  def __init__(self, timeout_s: float | None, *, startup_s: float | None = None,
               describe: Callable[[], str] = lambda: "",
               rescue: Callable[[], None] = lambda: None, rescue_s: float = 60.0,
               exit_fn: Callable[[int], None] = os._exit, stream=None):
    if timeout_s is not None and not timeout_s > 0:
      raise ValueError(f"watchdog_timeout_s must be > 0 or None (off), got {timeout_s}")
    if startup_s is not None and not startup_s > 0:
      raise ValueError(f"watchdog_startup_s must be > 0 or None, got {startup_s}")
    self.timeout_s = timeout_s
    self.startup_s = max(startup_s or 0.0, timeout_s or 0.0)
    self._started = False  # a first version was made
    self.describe = describe
    self.rescue = rescue
    self.rescue_s = rescue_s
    self.exit_fn = exit_fn
    self.stream = stream
    self.fired = threading.Event()
    self._last = time.monotonic()
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

  def __enter__(self) -> Watchdog:
    if self.timeout_s is not None:
      self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    if self.fired.is_set():
      # The watchdog is ending the process (bounded by `rescue_s`): the run must not go on,
      # nor race the rescue's checkpoint, whatever the caller's thread saw meanwhile.
      self._thread.join()
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=5.0)

  def progress(self) -> None:
    self._last = time.monotonic()
    self._started = True

  @property
  def bound_s(self) -> float:
    return self.timeout_s if self._started else self.startup_s

  def _run(self) -> None:
    while not self._stop.wait(min(1.0, self.timeout_s / 4)):
      if time.monotonic() - self._last > self.bound_s:
        self._fire()
        return

  def _fire(self) -> None:
    self.fired.set()
    stream = self.stream or sys.stderr
    where = (f" (a thread is blocked at fault point {', '.join(sorted(faults.hanging))})"
             if faults.hanging else "")
    print(f"\njaxrl_async watchdog: no policy version for {self.bound_s:.0f} s{where}; "
          "thread stacks follow", file=stream, flush=True)
    try:
      faulthandler.dump_traceback(file=stream, all_threads=True)
    except (AttributeError, ValueError, OSError):  # a stream without a file descriptor
      for thread_id, frame in sys._current_frames().items():
        print(f"thread {thread_id}:\n{''.join(traceback.format_stack(frame))}", file=stream)
    try:
      print(f"state: {self.describe()}", file=stream, flush=True)
    except Exception as error:  # describing must never keep the watchdog from ending the run
      print(f"state: unavailable ({error!r})", file=stream, flush=True)
    rescuer = threading.Thread(target=self._rescue, name="watchdog-rescue", daemon=True)
    rescuer.start()
    rescuer.join(self.rescue_s)
    if rescuer.is_alive():
      print(f"jaxrl_async watchdog: no checkpoint written (the rescue took over "
            f"{self.rescue_s:.0f} s)", file=stream, flush=True)
    print(f"jaxrl_async watchdog: exiting with code {EXIT_CODE}", file=stream, flush=True)
    self.exit_fn(EXIT_CODE)

  def _rescue(self) -> None:
    stream = self.stream or sys.stderr
    try:
      self.rescue()
    except Exception as error:
      print(f"jaxrl_async watchdog: no checkpoint written ({error!r})", file=stream, flush=True)
