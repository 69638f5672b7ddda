"""Updates dispatched and not yet finished: the learner takes its next groups while XLA computes.

A jitted call returns once it is dispatched; its outputs are futures. The learner dispatches an
update and goes on to take the next update's groups from the buffer (often a wait for a
straggler) while the update runs, and reads the update's metrics only when the version's record
needs them. Its busy time stays the updates' own: `CompletionWatcher` closes each update's busy
interval when its outputs are ready, from a thread of its own.
"""

from __future__ import annotations

import queue
import threading

import jax

from jaxrl_async.metrics import RoleTimer, sum_pairs

_STOP = object()


class CompletionWatcher:
  """Ends `role`'s busy interval, opened by the caller, when each watched output is ready."""

  def __init__(self, timer: RoleTimer, role: str):
    self._timer, self._role = timer, role
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._thread: threading.Thread | None = None

  def watch(self, outputs) -> None:
    """`outputs` come from work dispatched after `timer.begin(role)`: its interval ends when they
    are ready (at once if they already are)."""
    if self._thread is None:
      self._thread = threading.Thread(target=self._run, name=f"{self._role}-completion",
                                      daemon=True)
      self._thread.start()
    self._queue.put(outputs)

  def _run(self) -> None:
    while (outputs := self._queue.get()) is not _STOP:
      try:
        jax.block_until_ready(outputs)
      except Exception:  # the error surfaces where the outputs are read
        pass
      finally:
        self._timer.end(self._role)

  def close(self, timeout_s: float = 60.0) -> None:
    """Waits for the watched outputs (at most `timeout_s`) and stops the thread."""
    if self._thread is not None:
      self._queue.put(_STOP)
      self._thread.join(timeout_s)
      self._thread = None


class PendingMetrics:
  """Metric sums of dispatched updates, read (and waited for) only when asked."""

  def __init__(self):
    self._sums: dict = {}
    self._pending: list = []

  def add(self, metrics) -> None:
    self._pending.append(metrics)

  def clear(self) -> None:
    self._sums, self._pending = {}, []

  def sums(self) -> dict:
    """Every added update's metrics summed as (sum, count) pairs; waits for their updates."""
    for metrics in self._pending:
      self._sums = sum_pairs(self._sums, jax.device_get(metrics))
    self._pending = []
    return self._sums
