"""Test setup: 8 forced host devices stand in for an accelerator mesh (set before jax loads)."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's persistent compilation cache, one per test session and shared with the runs the tests
# start as subprocesses (they inherit the variables): tests build many learners and engines of
# the same shapes, and each new one would otherwise compile its programs again.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _XLA_CACHE = tempfile.mkdtemp(prefix="jaxrl_async_test_xla_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
  atexit.register(shutil.rmtree, _XLA_CACHE, ignore_errors=True)


import pytest  # noqa: E402  (after the environment is set)


@pytest.fixture(scope="session", autouse=True)
def warm_start_cache(tmp_path_factory):
  """One warm-start cache per test session (the path is shared by every test module)."""
  cache = tmp_path_factory.getbasetemp() / "jaxrl_async_cache"
  cache.mkdir(exist_ok=True)
  previous = os.environ.get("JAXRL_ASYNC_CACHE")
  os.environ["JAXRL_ASYNC_CACHE"] = str(cache)
  yield cache
  if previous is None:
    os.environ.pop("JAXRL_ASYNC_CACHE", None)
  else:
    os.environ["JAXRL_ASYNC_CACHE"] = previous
