"""Admission control: how many groups the Rollouter may start per policy-version window.

With N groups consumed per policy version and staleness threshold s >= 0, the Rollouter may have
at most `budget = floor((1 + s) * N)` groups charged to the current version window
(docs/knobs.md). The ledger below is plain bookkeeping; the buffer holds the lock.

Ledger rules (`used` is what the current window is charged):

- `open_window()` (a new rollout version): `used = outstanding`, where outstanding counts every
  group admitted and neither consumed nor dropped: in flight (admitted, nothing put yet),
  partially arrived, or ready in the queue. Work carried over from older versions thus reduces
  the new window.
- `admit()`: `used += 1`; callers block while `used >= budget`.
- a consumed group leaves `outstanding` but stays charged (consumption does not refund);
- a dropped group (any reason) leaves `outstanding` and refunds its slot: `used -= 1`.

Hence `used == outstanding + groups consumed in this window`, so `outstanding <= used <= budget`
holds at all times and a refund never takes `used` below zero. With s = 0 (budget N), at most N
groups that can still reach the learner are charged to window v, and a dropped one can always be
replaced; once the learner has consumed N groups of version v, nothing is left for it to see
before `open_window(v + 1)`, so every consumed token has version gap 0.

A new budget (adaptive staleness, `staleness_control.py`) is scheduled from a version with
`schedule`, never applied inside a window: `open_window(version)` takes the latest budget
scheduled from a version <= `version` (a rollout side that skips versions still gets the newest
one due) and keeps the later ones. A lowered budget may open below the carried work; the window
then admits nothing until drops refund it below the budget, so `used <= max(budget, carried)`.
"""

from __future__ import annotations

import math
from typing import Any

_LEDGER_FIELDS = ("used", "carried", "admitted", "refunded", "in_flight", "outstanding",
                  "total_admitted")


def admission_budget(staleness_threshold: float, groups_per_version: int) -> int:
  """floor((1 + s) * N): groups the Rollouter may start per version window.

  The product is rounded to 9 decimals before the floor so that binary rounding of s cannot
  lose a group (s = 0.16, N = 25 gives 29, where the float product is 28.999999999999996).
  """
  return math.floor(round((1.0 + staleness_threshold) * groups_per_version, 9))


class AdmissionLedger:
  """Counts of the admission ledger; not thread-safe (the buffer's lock guards it)."""

  __slots__ = ("budget", "scheduled") + _LEDGER_FIELDS

  def __init__(self, budget: int):
    self.budget = budget
    self.scheduled: list[tuple[int, int]] = []  # (from version, budget), by version
    self.used = 0  # groups charged to the current window
    self.carried = 0  # outstanding groups when the window opened
    self.admitted = 0  # admitted in this window
    self.refunded = 0  # drops (and voided admissions) refunded in this window
    self.in_flight = 0  # admitted, no sample put yet
    self.outstanding = 0  # admitted, neither consumed nor dropped
    self.total_admitted = 0

  @property
  def available(self) -> int:
    return max(0, self.budget - self.used)

  def can_admit(self) -> bool:
    return self.used < self.budget

  def admit(self) -> None:
    self.used += 1
    self.admitted += 1
    self.in_flight += 1
    self.outstanding += 1
    self.total_admitted += 1

  def start_group(self) -> bool:
    """A new group's first sample arrived; True if it takes an admitted slot."""
    if self.in_flight > 0:
      self.in_flight -= 1
      return True
    return False

  def finish_group(self, admitted: bool, dropped: bool) -> bool:
    """A group was consumed or dropped. Returns True if a slot was refunded."""
    if not admitted:
      return False
    self.outstanding -= 1
    if dropped:
      self.used = max(0, self.used - 1)
      self.refunded += 1
      return True
    return False

  def schedule(self, budget: int, from_version: int) -> None:
    """`budget` for the windows opened at versions >= `from_version` (it replaces what was
    scheduled from that version or a later one)."""
    self.scheduled = [entry for entry in self.scheduled if entry[0] < from_version]
    self.scheduled.append((int(from_version), int(budget)))

  def open_window(self, version: int) -> None:
    due = [budget for from_version, budget in self.scheduled if from_version <= version]
    if due:
      self.budget = due[-1]
      self.scheduled = [entry for entry in self.scheduled if entry[0] > version]
    self.carried = self.outstanding
    self.used = self.outstanding
    self.admitted = 0
    self.refunded = 0

  def void_in_flight(self) -> int:
    """Forget admissions whose groups never started (their prompts are re-issued)."""
    voided = self.in_flight
    self.in_flight = 0
    self.outstanding -= voided
    self.used = max(0, self.used - voided)
    self.refunded += voided
    return voided

  def problems(self, admitted_partial: int, admitted_ready: int) -> list[str]:
    """Violated ledger invariants, given the admitted groups found in the queue."""
    found = []
    if self.outstanding != self.in_flight + admitted_partial + admitted_ready:
      found.append(f"outstanding={self.outstanding} != in_flight={self.in_flight} + "
                   f"partial={admitted_partial} + ready={admitted_ready}")
    if not 0 <= self.outstanding <= self.used <= max(self.budget, self.carried):
      found.append(f"need 0 <= outstanding={self.outstanding} <= used={self.used} <= "
                   f"max(budget={self.budget}, carried={self.carried})")
    if self.used != self.carried + self.admitted - self.refunded:
      found.append(f"used={self.used} != carried={self.carried} + admitted={self.admitted} - "
                   f"refunded={self.refunded}")
    return found

  def budgets(self) -> dict[str, Any]:
    """The budget in force and the scheduled ones, [[from version, budget], ...]."""
    return {"budget": self.budget, "scheduled": [list(entry) for entry in self.scheduled]}

  def to_state(self) -> dict[str, Any]:
    return {**{name: int(getattr(self, name)) for name in _LEDGER_FIELDS}, **self.budgets()}

  def load_state(self, state: dict[str, Any]) -> None:
    """Counts and budgets saved by `to_state` (a state without budgets keeps this ledger's)."""
    for name in _LEDGER_FIELDS:
      setattr(self, name, int(state[name]))
    self.budget = int(state.get("budget", self.budget))
    self.scheduled = [(int(version), int(budget))
                      for version, budget in state.get("scheduled", [])]

