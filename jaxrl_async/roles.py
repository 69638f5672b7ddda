"""The thread every role runs in: named, started once, stopped by an event, joined with a
timeout. An exception in the role's body is kept in `error` for the controller to raise with
the role's name; a closed buffer is a normal way to end."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from jaxrl_async.buffer import BufferClosed

# Roles hand the GIL to each other around every device call; Python's default 5 ms switch
# interval makes a role wait that long for it (about +7% samples/s at 0.5 ms, async_stale, CPU).
# The same holds for a process's service threads (the buffer service beside the learner, a
# rollout server's reward and control threads beside its loop).
GIL_SWITCH_INTERVAL_S = 0.0005


@contextmanager
def short_gil_switch() -> Iterator[None]:
  """Python's GIL switch interval at GIL_SWITCH_INTERVAL_S inside, restored after."""
  previous = sys.getswitchinterval()
  sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
  try:
    yield
  finally:
    sys.setswitchinterval(previous)


class RoleThread:

  def __init__(self, name: str):
    self.name = name
    self.error: BaseException | None = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._main, name=name, daemon=True)

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    self._stop.set()

  def join(self, timeout: float) -> None:
    self._thread.join(timeout)
    if self._thread.is_alive():
      raise TimeoutError(f"{self.name} did not stop within {timeout} s")

  @property
  def alive(self) -> bool:
    return self._thread.is_alive()

  def _main(self) -> None:
    try:
      self.run()
    except BufferClosed:
      pass  # shutdown
    except BaseException as error:  # reaches the controller with the role's name
      self.error = error
    finally:
      self.finish()

  def run(self) -> None:
    raise NotImplementedError

  def finish(self) -> None:
    """Runs last in the role's thread, after run() returned or raised."""
