"""A rollout-server child must not outlive its parent: when the learner's process is SIGKILLed,
its children (spawned from a thread that lives as long as the fleet, as fleet.py does) end too."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARENT = textwrap.dedent("""
    import concurrent.futures, sys, time
    from jaxrl_async.backends.processes import child
    spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fleet-spawner")
    process = spawner.submit(child.spawn, sys.argv[2], (600.0,), name="orphan").result(60)
    with open(sys.argv[1] + ".tmp", "w") as f:
      f.write(str(process.pid))
    import os
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(600)
""")


def _running(pid: int) -> bool:
  """True while `pid` exists and is not a zombie (a reaped or dead process is not running)."""
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      state = f.read().rsplit(")", 1)[1].split()[0]
  except (FileNotFoundError, ProcessLookupError):
    return False
  return state not in ("Z", "X")


def _wait(predicate, timeout: float) -> bool:
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.05)
  return predicate()


def _spawn_and_kill_parent(tmp_path, target: str, ready_file: str | None = None) -> int:
  """Starts a parent that spawns `target` in a child, SIGKILLs the parent; the child's pid.
  ready_file: the parent is killed only once the child has written it."""
  pid_file = str(tmp_path / "child.pid")
  env = dict(os.environ)
  if ready_file:
    env["JAXRL_ASYNC_TEST_ORPHAN_READY"] = ready_file
  parent = subprocess.Popen([sys.executable, "-c", PARENT, pid_file, target], cwd=ROOT, env=env)
  try:
    assert _wait(lambda: os.path.exists(pid_file), 60.0), "the parent never spawned its child"
    if ready_file:
      assert _wait(lambda: os.path.exists(ready_file), 60.0), "the child never got ready"
    with open(pid_file, encoding="utf-8") as f:
      child_pid = int(f.read())
    assert _running(child_pid), "the child was not running before the parent was killed"
    parent.send_signal(signal.SIGKILL)
    parent.wait(10.0)
    return child_pid
  finally:
    if parent.poll() is None:
      parent.kill()
      parent.wait(10.0)


def test_a_child_ends_when_its_parent_is_sigkilled(tmp_path):
  child_pid = _spawn_and_kill_parent(tmp_path, "time:sleep")
  assert _wait(lambda: not _running(child_pid), 10.0), (
      f"child {child_pid} still runs 10 s after its parent was SIGKILLed")


def test_the_check_sees_an_orphan_that_lost_its_death_signal(tmp_path):
  """The control: without the death signal the child would outlive its parent, so the test
  above can fail."""
  # Killed only after the child cleared its death signal: killed before, it would die with
  # the parent (the signal is set before the target runs), and the control would not hold.
  child_pid = _spawn_and_kill_parent(tmp_path, "tests.backends.children:sleep_without_death_signal",
                                     ready_file=str(tmp_path / "cleared"))
  try:
    time.sleep(2.0)
    assert _running(child_pid)
  finally:
    with contextlib.suppress(ProcessLookupError):
      os.kill(child_pid, signal.SIGKILL)
