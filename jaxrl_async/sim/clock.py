"""The virtual clock: an event heap, and devices that do work on it.

Nothing here waits on real time. `Clock.run` pops events in time order (ties in the order they
were scheduled) and calls them; a callback schedules further events. A `Device` runs one piece
of work at a time and counts its busy seconds per role; devices on one `Host` with contention
c > 0 slow each other down (k busy at once: each at speed 1 / (1 + c (k - 1))), which is how
threads of one process share a CPU. A device may have its own c (`Host(c, {name: c'})`): roles
laid out unevenly on the cores (one process pinned to a core, another on every core) do not
slow each other down alike.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class Clock:
  __slots__ = ("_heap", "_seq", "now", "spans", "stopped")

  def __init__(self, spans: bool = False):
    self.spans: list[tuple[str, float, float]] | None = [] if spans else None  # (role, start, end)
    self.now = 0.0
    self._heap: list[list] = []
    self._seq = 0
    self.stopped = False

  def at(self, when: float, callback: Callable, *args) -> list:
    """Schedules callback(*args) at `when` (>= now); returns a handle for `cancel`."""
    self._seq += 1
    event = [max(when, self.now), self._seq, callback, args]
    heapq.heappush(self._heap, event)
    return event

  @staticmethod
  def cancel(event: list) -> None:
    event[2] = None

  def run(self, max_events: int) -> int:
    """Runs events until `stopped`, no event is left, or `max_events` ran; returns the count."""
    heap, count = self._heap, 0
    while heap and not self.stopped:
      if count >= max_events:
        raise RuntimeError(f"the simulation ran {max_events} events without finishing; raise "
                           "max_events or check the profile (a role may never get work)")
      when, _, callback, args = heapq.heappop(heap)
      if callback is None:
        continue
      self.now = when
      callback(*args)
      count += 1
    return count


class Host:
  """Devices that share a host; contention 0 means they do not slow each other down.

  `by_device` maps a device's name to its own contention (how much each other busy device
  slows it), in place of `contention`."""

  __slots__ = ("active", "by_device", "contention")

  def __init__(self, contention: float = 0.0, by_device: dict[str, float] | None = None):
    self.contention = float(contention)
    self.by_device = {name: float(c) for name, c in (by_device or {}).items()}
    for name, c in [("contention", self.contention), *self.by_device.items()]:
      if not c >= 0.0:
        raise ValueError(f"contention of {name} must be >= 0, got {c}")
    self.active: list[Device] = []

  @property
  def shared(self) -> bool:
    """Whether any device on this host slows down while another computes."""
    return self.contention > 0 or any(c > 0 for c in self.by_device.values())

  def contention_of(self, name: str) -> float:
    return self.by_device.get(name, self.contention)

  def speed(self, busy: int, contention: float | None = None) -> float:
    c = self.contention if contention is None else contention
    return 1.0 / (1.0 + c * max(busy - 1, 0))


class Device:
  """Runs one piece of work at a time; `busy_s[role]` sums the wall seconds spent on it."""

  __slots__ = ("_contention", "_done", "_event", "_host", "_last", "_left", "_role", "_since",
               "_speed", "_total", "busy_s", "clock", "name")

  def __init__(self, clock: Clock, name: str, host: Host | None = None):
    self.clock = clock
    self.name = name
    self._host = host if host is not None and host.shared else None
    self._contention = host.contention_of(name) if self._host is not None else 0.0
    self.busy_s: dict[str, float] = {}
    self._event = None
    self._done = None
    self._role = ""
    self._since = self._last = 0.0
    self._left = self._total = 0.0
    self._speed = 1.0

  @property
  def busy(self) -> bool:
    return self._done is not None

  def start(self, work_s: float, on_done: Callable[[], None], role: str) -> None:
    """Does `work_s` seconds of work (at full speed) for `role`, then calls on_done()."""
    if self._done is not None:
      raise RuntimeError(f"device {self.name} is already busy")
    now = self.clock.now
    self._done, self._role = on_done, role
    self._since = self._last = now
    self._left = self._total = max(float(work_s), 0.0)
    if self._host is None:
      self._speed = 1.0
      self._event = self.clock.at(now + self._left, self._finish)
    else:
      self._host.active.append(self)
      self._retime_host()

  def work_done(self) -> float:
    """Work (full-speed seconds) done so far on the current piece."""
    if self._done is None:
      return 0.0
    return self._total - self._left + (self.clock.now - self._last) * self._speed

  def set_total_work(self, total_s: float) -> None:
    """Ends the current piece after `total_s` of work in all (never before the work done)."""
    if self._done is None:
      return
    self._advance()
    done = self._total - self._left
    self._left = max(total_s - done, 0.0)
    self._total = done + self._left
    self.clock.cancel(self._event)
    self._event = self.clock.at(self.clock.now + self._left / self._speed, self._finish)

  # ---- internals ------------------------------------------------------------------------------
  def _advance(self) -> None:
    now = self.clock.now
    self._left = max(self._left - (now - self._last) * self._speed, 0.0)
    self._last = now

  def _retime_host(self) -> None:
    busy = len(self._host.active)
    for device in self._host.active:
      speed = self._host.speed(busy, device._contention)
      device._advance()
      device._speed = speed
      if device._event is not None:
        device.clock.cancel(device._event)
      device._event = device.clock.at(device.clock.now + device._left / speed, device._finish)

  def _finish(self) -> None:
    now = self.clock.now
    self.busy_s[self._role] = self.busy_s.get(self._role, 0.0) + now - self._since
    if self.clock.spans is not None:
      self.clock.spans.append((self._role, self._since, now))
    done, self._done, self._event = self._done, None, None
    if self._host is not None:
      self._host.active.remove(self)
      if self._host.active:
        self._retime_host()
    done()
