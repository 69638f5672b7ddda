"""The thread every role runs in: named, started once, stopped by an event, joined with a
timeout. An exception in the role's body is kept in `error` for the controller to raise with
the role's name; a closed buffer is a normal way to end."""

from __future__ import annotations

import threading

from jaxrl_async.buffer import BufferClosed


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
