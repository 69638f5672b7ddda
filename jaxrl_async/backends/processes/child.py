"""Child processes of a run: spawned (never forked: the parent holds XLA's threads), each on its
share of the CPU cores with XLA's and the BLAS libraries' thread pools sized to it, killed with
their parent, and always reaped.

The thread counts are environment variables read when numpy and XLA load, so they are set in
the environment the child is started with; the core affinity is set first thing in the child.
A child gets SIGKILL when the thread that spawned it ends (PR_SET_PDEATHSIG follows the thread),
so spawn from a thread that outlives the child. This module imports neither numpy nor jax.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import multiprocessing as mp
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1
_ENV_LOCK = threading.Lock()  # os.environ is process-wide: one child starts at a time
THREAD_ENV = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def core_shares(num_children: int, cores: list[int] | None = None) -> tuple[list[int],
                                                                            list[list[int]]]:
  """(the parent's cores, each child's cores): the parent first, the rest split evenly among
  the children; with fewer cores than processes, processes share cores round robin."""
  cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
  if not cores:
    raise ValueError("no CPU cores to share")
  processes = num_children + 1
  if len(cores) >= processes:
    per = len(cores) // processes
    shares = [cores[i * per:(i + 1) * per] for i in range(processes)]
    shares[-1] = cores[(processes - 1) * per:]
  else:
    shares = [[cores[i % len(cores)]] for i in range(processes)]
  return shares[0], shares[1:]


def child_env(cores: list[int]) -> dict[str, str]:
  """Environment for a child on `cores`: one XLA intra-op thread pool of that size."""
  threads = str(max(1, len(cores)))
  flags = os.environ.get("XLA_FLAGS", "")
  flags = " ".join(f for f in flags.split() if not f.startswith(
      ("--xla_cpu_multi_thread_eigen", "intra_op_parallelism_threads")))
  if len(cores) == 1:
    flags = (flags + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
  env = dict.fromkeys(THREAD_ENV, threads)
  env["XLA_FLAGS"] = flags.strip()
  env.update(compilation_cache_env())
  return env


def compilation_cache_env() -> dict[str, str]:
  """The parent's persistent compilation cache, for a spawned child (JAX reads these variables
  at import; a child started without them compiles every executable again)."""
  jax = sys.modules.get("jax")
  directory = jax.config.jax_compilation_cache_dir if jax is not None else None
  if not directory:
    return {}
  return {"JAX_COMPILATION_CACHE_DIR": str(directory),
          "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS":
              str(jax.config.jax_persistent_cache_min_compile_time_secs)}


def _child_main(target: str, args: tuple, cores: list[int] | None) -> None:
  """In the child: die with the parent, take the cores, then run `module:function(*args)`."""
  with contextlib.suppress(OSError, AttributeError):
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  if os.getppid() == 1:  # the parent died before prctl took effect
    os._exit(1)
  if cores:
    os.sched_setaffinity(0, cores)
  module, function = target.split(":")
  getattr(importlib.import_module(module), function)(*args)


def spawn(target: str, args: tuple, *, name: str, cores: list[int] | None = None,
          env: dict[str, str] | None = None) -> mp.Process:
  """Starts `module:function(*args)` in a spawned child on `cores` with `env` added."""
  context = mp.get_context("spawn")
  process = context.Process(target=_child_main, args=(target, args, cores), name=name,
                            daemon=True)
  extra = dict(env or {})
  with _ENV_LOCK:
    saved = {key: os.environ.get(key) for key in extra}
    os.environ.update(extra)
    try:
      process.start()
    finally:
      for key, value in saved.items():
        if value is None:
          os.environ.pop(key, None)
        else:
          os.environ[key] = value
  return process


def reap(process: mp.Process, timeout: float = 10.0) -> int | None:
  """Ends a child for sure: join, then SIGTERM, then SIGKILL; returns its exit code."""
  if process.pid is None:
    return None
  if process.is_alive():
    process.terminate()
    process.join(timeout)
  if process.is_alive():
    process.kill()
    process.join(timeout)
  if process.is_alive():
    raise TimeoutError(f"child {process.name} (pid {process.pid}) survived SIGKILL")
  return process.exitcode


def kill(process: mp.Process, timeout: float = 10.0) -> int | None:
  """SIGKILL now (a stopped process cannot handle SIGTERM) and reap."""
  if process.is_alive():
    process.kill()
  process.join(timeout)
  return reap(process, timeout)
