"""Rewards that run in a child process with a time limit, for code and slow verifiers.

A reward in a thread cannot be stopped: the reward pool can only abandon it. In a child process
it can be killed. `SubprocessReward(fn, timeout_s)` runs `fn(*args)` in a worker process and
kills it at the limit; `python_tests_reward` runs a response's Python program with the
problem's tests in a fresh interpreter. Both report what happened by what they raise, which the
reward pool (rollout/rewards.py) counts and never trains on:

  RewardTimeout (a TimeoutError)  -> status 'timeout' (dropped as reward_timeout)
  any other exception             -> status 'failed'  (dropped as reward_failed)

The limit is on the verifier's own run: starting a worker (an interpreter that imports the
verifier's module) is bounded separately by `start_timeout_s`.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any


class RewardTimeout(TimeoutError):
  """The verifier ran past its time limit and was killed."""


class RewardCrashed(RuntimeError):
  """The verifier's process died (or raised) without giving a reward."""


# The worker: reads sys.path and the function, says it is ready, then answers calls. Results go
# to a private copy of stdout; fd 1 is pointed at stderr so the verifier's prints cannot corrupt
# them.
_WORKER = """
import os, pickle, sys
results = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
calls = sys.stdin.buffer
sys.path[:] = pickle.load(calls)
fn, memory_mb = pickle.load(calls)
if memory_mb is not None:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
results.write(b"R")
results.flush()
while True:
    try:
        args = pickle.load(calls)
    except EOFError:
        break
    try:
        result = ("ok", fn(*args))
    except BaseException as error:
        result = ("error", (type(error).__name__ + ": " + str(error))[:2000])
    pickle.dump(result, results)
    results.flush()
"""


class _Worker:
  """One worker process; its calls are one at a time."""

  def __init__(self, fn, memory_mb: int | None, start_timeout_s: float):
    self.process = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
    try:
      pickle.dump(list(sys.path), self.process.stdin)
      pickle.dump((fn, memory_mb), self.process.stdin)
      self.process.stdin.flush()
      if not self._wait_readable(start_timeout_s):
        raise RewardTimeout(f"reward worker for {fn!r} did not start within "
                            f"{start_timeout_s} s; killed")
      if self.process.stdout.read(1) != b"R":
        raise RewardCrashed(f"reward worker for {fn!r} exited with code "
                            f"{self.process.wait(timeout=10)} while starting")
    except BaseException:
      self.kill()
      raise

  def _wait_readable(self, timeout_s: float) -> bool:
    return bool(select.select([self.process.stdout], [], [], timeout_s)[0])

  def call(self, args: tuple, timeout_s: float) -> tuple[str, Any]:
    try:
      pickle.dump(args, self.process.stdin)
      self.process.stdin.flush()
    except BrokenPipeError:
      raise RewardCrashed("reward worker exited before the call") from None
    if not self._wait_readable(timeout_s):
      raise RewardTimeout(f"reward ran past {timeout_s} s; its process was killed")
    try:
      return pickle.load(self.process.stdout)
    except EOFError:
      code = self.process.wait(timeout=10)
      raise RewardCrashed(f"reward process exited with code {code} before giving a "
                          f"reward") from None

  def kill(self) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
      os.killpg(self.process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
      self.process.wait(timeout=10)
    for stream in (self.process.stdin, self.process.stdout):
      with contextlib.suppress(OSError):
        stream.close()


class SubprocessReward:
  """Calls `fn(*args)` in a worker process, killed (and replaced) when a call runs past
  `timeout_s`; see the module docstring.

  Worker processes are started on demand, one per concurrent caller, and kept between calls
  (starting an interpreter and importing the verifier's module costs seconds); a worker whose
  call timed out, crashed or died is killed with its whole session and not reused.

  Args:
    fn: a picklable callable (a module-level function or an instance of a module-level class),
      importable from this process's sys.path.
    timeout_s: the limit on one call, > 0.
    start_timeout_s: the limit on starting a worker, > 0.
    memory_mb: an address-space limit for each worker (None: none); a verifier over it gets a
      MemoryError, reported as a failure.
  """

  def __init__(self, fn: Callable[..., Any], *, timeout_s: float = 5.0,
               start_timeout_s: float = 120.0, memory_mb: int | None = None):
    if not callable(fn):
      raise TypeError(f"fn must be callable, got {fn!r}")
    for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
      if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if memory_mb is not None and (not isinstance(memory_mb, int) or memory_mb < 64):
      raise ValueError(f"memory_mb must be None or an int >= 64, got {memory_mb!r}")
    pickle.dumps(fn)  # fails now, naming the function, rather than in every call
    self.fn, self.timeout_s, self.start_timeout_s = fn, float(timeout_s), float(start_timeout_s)
    self.memory_mb = memory_mb
    self._init_pool()

  def _init_pool(self) -> None:
    self._idle: list[_Worker] = []
    self._lock = threading.Lock()
    self.counts = {"calls": 0, "timeouts": 0, "crashes": 0, "workers_started": 0}

  def __call__(self, *args: Any) -> Any:
    with self._lock:
      worker = self._idle.pop() if self._idle else None
      self.counts["calls"] += 1
    if worker is None or worker.process.poll() is not None:
      worker = _Worker(self.fn, self.memory_mb, self.start_timeout_s)
      with self._lock:
        self.counts["workers_started"] += 1
    try:
      status, value = worker.call(args, self.timeout_s)
    except BaseException as error:
      worker.kill()
      with self._lock:
        self.counts["timeouts" if isinstance(error, RewardTimeout) else "crashes"] += 1
      raise
    with self._lock:
      self._idle.append(worker)
    if status != "ok":
      raise RewardCrashed(f"reward {self.fn!r} raised in its process: {value}")
    return value

  def close(self) -> None:
    """Kills the idle workers (a call in progress keeps its worker until it returns)."""
    with self._lock:
      idle, self._idle = self._idle, []
    for worker in idle:
      worker.kill()

  def __getstate__(self):
    return {"fn": self.fn, "timeout_s": self.timeout_s, "start_timeout_s": self.start_timeout_s,
            "memory_mb": self.memory_mb}

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._init_pool()

  def __repr__(self) -> str:
    return (f"SubprocessReward({self.fn!r}, timeout_s={self.timeout_s}, "
            f"memory_mb={self.memory_mb})")


_CODE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(response: str) -> str | None:
  """The last fenced code block (```python ... ```) of a response, else None."""
  if not isinstance(response, str):
    return None
  blocks = _CODE_BLOCK.findall(response)
  return blocks[-1] if blocks else None


def python_tests_reward(response: str, tests: str, *, timeout_s: float = 10.0,
                        memory_mb: int | None = 1024) -> float:
  """1.0 if the response's last Python code block, followed by `tests` (e.g. asserts), runs
  through the tests in a fresh isolated interpreter (`python -I`, a temporary working directory,
  no stdin, an address-space limit of `memory_mb`): it must exit with code 0 and print a random
  token written after the tests, so a program that exits early (`sys.exit(0)`) does not pass.
  0.0 if it fails or there is no code. Raises RewardTimeout past `timeout_s`: the interpreter
  and any process it started (its session) are killed."""
  code = extract_code(response)
  if code is None or not code.strip():
    return 0.0
  prelude = ""
  if memory_mb is not None:
    limit = int(memory_mb) * 1024 * 1024
    prelude = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))\n"
  passed = f"tests passed {secrets.token_hex(16)}"
  program = f"{prelude}{code}\n\n{tests}\nprint({passed!r}, flush=True)\n"
  with tempfile.TemporaryDirectory(prefix="reward-") as directory:
    output_path = os.path.join(directory, "stdout")
    with open(output_path, "wb") as output:
      process = subprocess.Popen(
          [sys.executable, "-I", "-c", program], cwd=directory, stdin=subprocess.DEVNULL,
          stdout=output, stderr=subprocess.DEVNULL, start_new_session=True,
          env={"PATH": os.environ.get("PATH", "")})
      try:
        returncode = process.wait(timeout=timeout_s)
      except subprocess.TimeoutExpired:
        raise RewardTimeout(f"program ran past {timeout_s} s; killed") from None
      finally:  # the whole session: processes the program left behind go too
        with contextlib.suppress(ProcessLookupError, PermissionError):
          os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
    with open(output_path, "rb") as output:
      output.seek(max(0, os.path.getsize(output_path) - 4096))
      tail = output.read().decode("utf-8", errors="replace").splitlines()
  return 1.0 if returncode == 0 and tail and tail[-1] == passed else 0.0
