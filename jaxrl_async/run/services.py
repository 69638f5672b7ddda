"""A task's own services for the length of a run (e.g. a verifier process its reward calls).

A task may define `services(log)`: a context manager that starts what its reward needs and
yields the task to run with (a copy that knows where the services are, e.g. a verifier's
address). `task_services(config)` enters it before anything is built, so every process of the
run (rollout servers of the processes and Ray backends get the config pickled) reaches the same
services, and stops them when the run ends, however it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

from jaxrl_async.config import RunConfig


@contextlib.contextmanager
def task_services(config: RunConfig, log=print) -> Iterator[RunConfig]:
  """Yields `config` with the task its services returned (the same config for a task without
  services)."""
  start = getattr(config.task, "services", None)
  if start is None:
    yield config
    return
  with start(log=log) as task:
    yield dataclasses.replace(config, task=task)
