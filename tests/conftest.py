"""Test setup: 8 forced host devices stand in for an accelerator mesh (set before jax loads)."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One cache root per test session, shared by the pytest-xdist workers (they inherit the
# variables from the process that started them) and by the runs tests start as subprocesses:
# - XLA's persistent compilation cache: tests build many learners and engines of the same
#   shapes, and each new one would otherwise compile its programs again;
# - the warm-start cache (JAXRL_ASYNC_CACHE): each base policy is trained once per session.
if "JAXRL_ASYNC_TEST_ROOT" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _ROOT = tempfile.mkdtemp(prefix="jaxrl_async_test_")
  os.environ["JAXRL_ASYNC_TEST_ROOT"] = _ROOT
  atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)  # by the process that made it
  # The default run's base policy ships as a fixture (tools/make_base_fixture.py): the tests
  # that run the default task load it instead of training it (about 130 CPU-s).
  # JAXRL_ASYNC_TEST_FRESH_BASE=1 leaves the cache empty, so the session trains it again.
  _SHIPPED_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "base")
  if os.path.isdir(_SHIPPED_BASE) and not os.environ.get("JAXRL_ASYNC_TEST_FRESH_BASE"):
    shutil.copytree(_SHIPPED_BASE, os.path.join(_ROOT, "cache", "base"))
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, "xla"))
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
TEST_CACHE = os.path.join(os.environ["JAXRL_ASYNC_TEST_ROOT"], "cache")


import jax  # noqa: E402  (after the environment is set)
import pytest  # noqa: E402

# The tests compile hundreds of small programs, and XLA's optimisation passes are most of that
# compile time while gaining little at these shapes: the tests run with them off, slow ones
# included (test_resume_faults and test_end_to_end: 67 CPU-s with them, 49 without).
# JAXRL_ASYNC_TEST_XLA_OPT=1 keeps them on everywhere. The runs tests start as subprocesses
# compile as a user's run does, bar tiny ones (tests/run_lives.py).
XLA_OPT_EVERYWHERE = bool(os.environ.get("JAXRL_ASYNC_TEST_XLA_OPT"))


@pytest.fixture(scope="session", autouse=True)
def warm_start_cache():
  """The session's warm-start cache (shared by every test module and xdist worker)."""
  os.makedirs(TEST_CACHE, exist_ok=True)
  previous = os.environ.get("JAXRL_ASYNC_CACHE")
  os.environ["JAXRL_ASYNC_CACHE"] = TEST_CACHE
  yield TEST_CACHE
  if previous is None:
    os.environ.pop("JAXRL_ASYNC_CACHE", None)
  else:
    os.environ["JAXRL_ASYNC_CACHE"] = previous


def pytest_runtest_setup(item):
  """Before the test's fixtures are built (a module's fixtures follow its first test)."""
  del item
  jax.config.update("jax_disable_most_optimizations", not XLA_OPT_EVERYWHERE)


def _expected_length(item) -> tuple[int, int]:
  slow = item.get_closest_marker("slow") is not None
  timeout = item.get_closest_marker("timeout")
  bound = timeout.args[0] if timeout is not None and timeout.args else 600
  return (0 if slow else 1, -bound)


def pytest_collection_modifyitems(items):
  """A soak is also slow (`-m "not slow"` leaves it out). Modules with slow tests first, the
  longest bound first: with pytest-xdist, a long test that starts last keeps one worker busy
  after the other has run out of work. A module's tests stay together, in their order (its
  module-scoped fixtures are built once)."""
  for item in items:
    if item.get_closest_marker("soak") is not None and item.get_closest_marker("slow") is None:
      item.add_marker(pytest.mark.slow)
  rank: dict[str, tuple[int, int]] = {}
  for item in items:
    rank[item.nodeid.split("::")[0]] = min(rank.get(item.nodeid.split("::")[0], (1, 0)),
                                           _expected_length(item))
  items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable within a module


if os.environ.get("JAXRL_ASYNC_TEST_CPU_LOG"):  # per-test CPU seconds, to find what to trim
  import json
  import resource
  import time

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_protocol(item, nextitem):
    def cpu() -> float:
      own = resource.getrusage(resource.RUSAGE_SELF)
      children = resource.getrusage(resource.RUSAGE_CHILDREN)
      return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime
    began, (own0, children0) = time.monotonic(), cpu()
    yield
    own1, children1 = cpu()
    with open(os.environ["JAXRL_ASYNC_TEST_CPU_LOG"], "a", encoding="utf-8") as f:
      f.write(json.dumps({"test": item.nodeid, "wall": time.monotonic() - began,
                          "own": own1 - own0, "children": children1 - children0}) + "\n")
