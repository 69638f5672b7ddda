"""Module-level verifiers for subprocess reward tests (a child process imports them by name)."""

import os
import time


def add_one(x):
  return x + 1.0


def sleep_then(seconds, value):
  time.sleep(seconds)
  return value


def raise_value_error(text):
  raise ValueError(f"cannot score {text!r}")


def exit_hard(code):
  os._exit(code)


def allocate_mb(mb):
  return float(len(bytearray(mb * 1024 * 1024)))


def write_pid_then_sleep(path, seconds):
  with open(path, "w") as f:
    f.write(str(os.getpid()))
  time.sleep(seconds)
  return 1.0
