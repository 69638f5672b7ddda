"""Backends: where a run's rollout servers live and how they reach the learner (`base.Backend`).

The registry maps `RunConfig.backend` to the module and class that implement it; a new backend
(a cluster scheduler) is one more entry and one module that passes
tests/backends/test_backend_contract.py, with no change to the loop.
"""

from __future__ import annotations

import importlib

from jaxrl_async.backends.base import Backend

REGISTRY: dict[str, str] = {
    "threads": "jaxrl_async.backends.threads:ThreadsBackend",
    "processes": "jaxrl_async.backends.processes.backend:ProcessesBackend",
    "ray": "jaxrl_async.backends.ray.backend:RayBackend",
}


def get_backend(name: str) -> Backend:
  """The backend registered under `name` (ValueError naming the registered ones)."""
  if name not in REGISTRY:
    raise ValueError(f"RunConfig.backend={name!r} is not a registered backend; allowed: "
                     f"{sorted(REGISTRY)}")
  module, attribute = REGISTRY[name].split(":")
  return getattr(importlib.import_module(module), attribute)()
