"""Wait for a 32-bit word in shared memory to change, across processes, without polling.

Linux futexes on a word of a `multiprocessing.shared_memory` segment: `wait(word, expected,
timeout)` sleeps in the kernel while the word still holds `expected` (returns at once when it
does not, so a change between reading the word and calling `wait` is never missed), and
`wake_all(word)` wakes every process sleeping on it. The waker never blocks, so a reader that
was stopped or killed cannot hold up the writer.

Elsewhere (another OS or architecture) `AVAILABLE` is False and callers poll instead.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import platform
import sys

import numpy as np

# The futex syscall number by architecture (Linux): asm/unistd.h.
_SYSCALLS = {"x86_64": 202, "aarch64": 98, "arm64": 98}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not FUTEX_PRIVATE_FLAG): the word is in shared memory
_WAKE_ALL = 2**31 - 1


class _Timespec(ctypes.Structure):
  _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall():
  if not sys.platform.startswith("linux") or platform.machine() not in _SYSCALLS:
    return None
  try:
    libc = ctypes.CDLL(None, use_errno=True)  # CDLL calls release the GIL while they run
    function = libc.syscall
  except (OSError, AttributeError):
    return None
  function.restype = ctypes.c_long
  return function


_SYSCALL = _syscall()
AVAILABLE = _SYSCALL is not None


def word(buffer, offset: int) -> np.ndarray:
  """The int32 at `offset` of `buffer` (4-byte aligned), as a 1-element numpy view."""
  if offset % 4:
    raise ValueError(f"a futex word must be 4-byte aligned, got offset {offset}")
  return np.ndarray((1,), np.int32, buffer=buffer, offset=offset)


def _address(view: np.ndarray) -> int:
  return view.__array_interface__["data"][0]


def wait(view: np.ndarray, expected: int, timeout: float) -> bool:
  """Sleeps while `view[0] == expected`, at most `timeout` seconds (> 0). Returns False when
  the word already differed, True otherwise (woken, timed out or interrupted: callers look at
  the shared state again either way)."""
  if not AVAILABLE:
    raise OSError(errno.ENOSYS, "futexes are not available here")
  if not (timeout > 0 and math.isfinite(timeout)):
    raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout}")
  seconds = int(timeout)
  span = _Timespec(seconds, int((timeout - seconds) * 1e9))
  result = _SYSCALL(_SYSCALLS[platform.machine()], ctypes.c_void_p(_address(view)),
                    _FUTEX_WAIT, ctypes.c_int(int(expected)), ctypes.byref(span), None, 0)
  if result == 0:
    return True
  code = ctypes.get_errno()
  if code == errno.EAGAIN:
    return False
  if code in (errno.ETIMEDOUT, errno.EINTR):
    return True
  raise OSError(code, f"futex wait failed: {os.strerror(code)}")


def bump_and_wake(view: np.ndarray) -> None:
  """Changes the word (+1, wrapping) and wakes every waiter on it."""
  view[0] = np.int32((int(view[0]) + 1 + 2**31) % 2**32 - 2**31)
  if AVAILABLE:
    _SYSCALL(_SYSCALLS[platform.machine()], ctypes.c_void_p(_address(view)), _FUTEX_WAKE,
             ctypes.c_int(_WAKE_ALL), None, None, 0)
