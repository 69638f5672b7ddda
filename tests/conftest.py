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
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_ROOT, "xla"))
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
TEST_CACHE = os.path.join(os.environ["JAXRL_ASYNC_TEST_ROOT"], "cache")


import pytest  # noqa: E402  (after the environment is set)


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



def _expected_length(item) -> tuple[int, int]:
  slow = item.get_closest_marker("slow") is not None
  timeout = item.get_closest_marker("timeout")
  bound = timeout.args[0] if timeout is not None and timeout.args else 600
  return (0 if slow else 1, -bound)


def pytest_collection_modifyitems(items):
  """Modules with slow tests first, the longest bound first: with pytest-xdist, a long test that
  starts last keeps one worker busy after the other has run out of work. A module's tests stay
  together, in their order (its module-scoped fixtures are built once)."""
  rank: dict[str, tuple[int, int]] = {}
  for item in items:
    rank[item.nodeid.split("::")[0]] = min(rank.get(item.nodeid.split("::")[0], (1, 0)),
                                           _expected_length(item))
  items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable within a module
