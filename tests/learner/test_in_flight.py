"""Dispatched updates: the busy interval spans the computation, metrics are read when asked."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.learner.in_flight import CompletionWatcher, PendingMetrics
from jaxrl_async.metrics import RoleTimer, sum_pairs


@jax.jit
def _slow(x):
  for _ in range(6):
    x = jnp.tanh(x @ x)
  return {"loss": (jnp.sum(x), jnp.float32(1.0))}


def test_the_busy_interval_ends_when_the_dispatched_work_is_done_not_at_dispatch():
  x = jnp.ones((900, 900), jnp.float32) / 900
  jax.block_until_ready(_slow(x))  # compiled
  timer = RoleTimer(roles=("learner",))
  watcher = CompletionWatcher(timer, "learner")
  began = time.perf_counter()
  timer.begin("learner")
  out = _slow(x)
  dispatched = time.perf_counter() - began
  watcher.watch(out)
  jax.block_until_ready(out)
  ready = time.perf_counter() - began
  watcher.close()
  assert ready > 5 * dispatched, (ready, dispatched)  # the call returned before the work ended
  assert timer.busy_s("learner") >= 0.8 * ready
  assert timer.busy_s("learner") <= time.perf_counter() - began


def test_outputs_already_on_the_host_close_their_interval():
  timer = RoleTimer(roles=("learner",))
  watcher = CompletionWatcher(timer, "learner")
  for _ in range(3):
    timer.begin("learner")
    watcher.watch({"loss": (np.float32(1.0), np.float32(2.0))})
  watcher.close()
  closed = timer.busy_s("learner")
  time.sleep(0.05)
  assert timer.busy_s("learner") == closed  # no interval left open


def test_pending_metrics_sum_as_the_eager_sum():
  pending, eager = PendingMetrics(), {}
  x = jnp.ones((8, 8), jnp.float32)
  for scale in (1.0, 2.0, 3.0):
    metrics = _slow(x * scale)
    pending.add(metrics)
    eager = sum_pairs(eager, jax.device_get(metrics))
  sums = pending.sums()
  assert sums.keys() == eager.keys()
  assert sums["loss"][0] == pytest.approx(eager["loss"][0])
  assert sums["loss"][1] == 3.0
  assert pending.sums() == sums  # read once; asking again adds nothing
  pending.clear()
  assert pending.sums() == {}
