"""What `VersionedBuffer` (which mixes this in) offers adaptive staleness: a new staleness
threshold for its admission, taking effect at a window opening (`AdmissionLedger.schedule`).
Uses the buffer's lock, ledger and capacity, as the functions of observe.py do."""

from __future__ import annotations

import numbers
from typing import Any

from jaxrl_async.buffer.errors import check_buffer_config


class StalenessBudget:

  def set_staleness_threshold(self, staleness_threshold: float,
                              from_version: int) -> dict[str, Any]:
    """Admission budget floor((1 + s) N) for the windows opened at rollout versions >=
    `from_version` (the current window keeps its budget). Returns the ledger's `budgets()`.
    The buffer's capacity must hold the new budget's groups, as at construction
    (`check_buffer_config`: size the buffer for the largest s, RunConfig.staleness_max)."""
    if not isinstance(from_version, numbers.Integral) or isinstance(from_version, bool) or (
        from_version < 0):
      raise ValueError(f"set_staleness_threshold: from_version={from_version!r} must be an "
                       "int >= 0")
    budget = check_buffer_config(self._group_size, self.config["groups_per_version"],
                                 staleness_threshold, None, self._capacity)
    with self._lock:
      self._ledger.schedule(budget, from_version)
      return self._ledger.budgets()
