"""The buffer's exceptions and the checks of its arguments (errors a user can act on)."""

from __future__ import annotations

import math
import numbers
import time
from typing import Any

from jaxrl_async.buffer.admission import admission_budget


class BufferClosed(RuntimeError):
  """The buffer was closed; raised by every blocked and every later blocking call."""


class BufferTimeout(TimeoutError):
  """A blocking call ran past its timeout; the message names the call and the buffer's state."""


def is_int(value: Any) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_real(value: Any) -> bool:
  return (isinstance(value, numbers.Real) and not isinstance(value, bool)
          and math.isfinite(value))


def check_timeout(call: str, timeout: float) -> float:
  """Validates a blocking call's timeout and returns its deadline on `time.monotonic`."""
  if (type(timeout) is float or type(timeout) is int) and 0 < timeout < math.inf:
    return time.monotonic() + timeout  # the common case, without the ABC checks
  if not (is_finite_real(timeout) and timeout > 0):
    raise ValueError(f"{call}: timeout={timeout!r} must be a finite number of seconds > 0")
  return time.monotonic() + timeout


VERSION_GAP_POLICIES = ("drop", "wait")


def check_version_gap_policy(policy: str, max_version_gap: int | None) -> None:
  """'drop' (groups older than the bound are dropped as stale) or 'wait' (the learner first
  waits for the groups about to pass the bound; needs a bound)."""
  if policy not in VERSION_GAP_POLICIES:
    raise ValueError(f"version_gap_policy={policy!r} must be one of {VERSION_GAP_POLICIES}")
  if policy == "wait" and max_version_gap is None:
    raise ValueError("version_gap_policy='wait' needs max_version_gap (an int >= 0): without a "
                     "bound there is nothing to wait for")


def check_buffer_config(group_size: int, groups_per_version: int, staleness_threshold: float,
                        max_version_gap: int | None, capacity: int) -> int:
  """Validates the VersionedBuffer's knobs; returns the admission budget floor((1 + s) * N)."""
  if not is_int(group_size) or group_size < 1:
    raise ValueError(f"group_size={group_size!r} must be an int >= 1")
  if not is_int(groups_per_version) or groups_per_version < 1:
    raise ValueError(f"groups_per_version={groups_per_version!r} must be an int >= 1")
  if not (is_finite_real(staleness_threshold) and staleness_threshold >= 0):
    raise ValueError(f"staleness_threshold={staleness_threshold!r} must be a finite number "
                     ">= 0 (0 = strictly on-policy)")
  if max_version_gap is not None and (not is_int(max_version_gap) or max_version_gap < 0):
    raise ValueError(f"max_version_gap={max_version_gap!r} must be None (no bound) or an "
                     "int >= 0")
  budget = admission_budget(staleness_threshold, groups_per_version)
  min_capacity = group_size * budget
  if not is_int(capacity) or capacity < min_capacity:
    raise ValueError(
        f"capacity={capacity!r} must be an int >= group_size * floor((1 + "
        f"staleness_threshold) * groups_per_version) = {group_size} * {budget} = "
        f"{min_capacity}: a smaller buffer can fill with partial groups and deadlock")
  return budget
