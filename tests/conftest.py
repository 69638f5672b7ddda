"""Test setup: 8 forced host devices stand in for an accelerator mesh (set before jax loads)."""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


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
