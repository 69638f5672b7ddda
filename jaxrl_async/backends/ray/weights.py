"""The 'ray' backend's weights: the newest published version in Ray's object store.

`WeightStoreImpl` (a Ray actor body) holds a reference to the newest version's host copy;
`RayWeightChannel` publishes there from the learner and fetches onto the caller's devices (its
rollout mesh's shardings), on any node. Readers learn of a new version from one long-polling
call at a time, so asking for the latest version between decode steps costs no Ray call.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import numpy as np

from jaxrl_async import sharding
from jaxrl_async.backends.ray.placement import (
  ACTOR_CONCURRENCY,
  RPC_MARGIN_S,
  require_ray,
  role_options,
)
from jaxrl_async.sync.channel import WeightChannel, tree_bytes

WATCH_S = 1.0  # one long-polling wait on the weight store lasts at most this long


class WeightStoreImpl:
  """The newest published version, as an object in Ray's object store (Ray actor body)."""

  def __init__(self):
    self._cond = threading.Condition()
    self._version = -1
    self._ref = None

  def publish(self, version: int, boxed_ref: list) -> None:
    with self._cond:
      if version <= self._version:
        raise ValueError(f"version {version} is not newer than the published {self._version}")
      self._version, self._ref = int(version), boxed_ref[0]
      self._cond.notify_all()

  def latest(self) -> int:
    with self._cond:
      return self._version

  def wait(self, newer_than: int, timeout: float) -> int:
    with self._cond:
      self._cond.wait_for(lambda: self._version > newer_than, timeout=timeout)
      return self._version

  def get(self) -> tuple[int, list]:
    with self._cond:
      return self._version, [self._ref]  # boxed: Ray passes the reference, not the value


def start_weight_store(**placement):
  ray = require_ray()
  options = role_options(**{"num_cpus": 0.0, **placement}, max_concurrency=ACTOR_CONCURRENCY)
  return ray.remote(WeightStoreImpl).options(**options).remote()


class RayWeightChannel(WeightChannel):
  """Weights through Ray's object store: `publish` puts a host copy of the params there (the
  learner's process owns it); `fetch` brings the newest onto this process's devices with the
  rollout mesh's shardings (`rollout_mesh=None`: the default device)."""

  def __init__(self, store, logical_axes=None, rollout_mesh=None, *,
               margin_s: float = RPC_MARGIN_S):
    super().__init__()
    self.store = store
    self.logical_axes = logical_axes
    self.rollout_mesh = rollout_mesh
    self.margin_s = margin_s
    self._fetched: tuple[int, Any] | None = None
    self._refs: list = []  # this publisher's last versions stay alive while readers fetch them
    self._remote = -1  # the newest version the store has announced, as last seen here
    self._closed = threading.Event()
    self._watcher: threading.Thread | None = None
    self._watch_error: BaseException | None = None

  def __getstate__(self):
    return {"store": self.store, "logical_axes": self.logical_axes, "margin_s": self.margin_s}

  def __setstate__(self, state):
    self.__init__(state["store"], state["logical_axes"], None, margin_s=state["margin_s"])

  def _get(self, ref, timeout: float | None = None):
    ray = require_ray()
    return ray.get(ref, timeout=self.margin_s + (timeout or 0.0))

  def publish(self, version: int, params) -> None:
    ray = require_ray()
    with self._cond:
      self._check_newer(version, self._version)
    began = time.perf_counter()
    host = jax.tree.map(np.asarray, jax.device_get(params))
    ref = ray.put(host)
    self._get(self.store.publish.remote(int(version), [ref]))
    self._refs = (self._refs + [ref])[-2:]
    self._announce(version, time.perf_counter() - began, tree_bytes(host))
    self._seen_version(int(version))

  # The rollout side asks for the latest version between decode steps: one long-polling call
  # to the store (in a named thread) keeps a local copy, so asking costs no Ray call.
  def _seen_version(self, version: int) -> None:
    with self._cond:
      if version > self._remote:
        self._remote = version
        self._cond.notify_all()

  def _watch(self) -> None:
    while not self._closed.is_set():
      with self._cond:
        seen = self._remote
      try:
        self._seen_version(int(self._get(self.store.wait.remote(seen, WATCH_S), WATCH_S)))
      except Exception as error:  # the store is gone (end of run): readers see the last one
        self._watch_error = error
        self._closed.wait(WATCH_S)

  def _ensure_watcher(self) -> None:
    if self._watcher is None:
      self._seen_version(int(self._get(self.store.latest.remote())))
      self._watcher = threading.Thread(target=self._watch, name="ray-weights-watch",
                                       daemon=True)
      self._watcher.start()

  def latest_version(self) -> int:
    self._ensure_watcher()
    with self._cond:
      return self._remote

  def wait_for_version(self, newer_than: int, timeout: float) -> int:
    if not timeout > 0:
      raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
    self._ensure_watcher()
    with self._cond:
      self._cond.wait_for(lambda: self._remote > newer_than, timeout=timeout)
      return self._remote

  def close(self) -> None:
    self._closed.set()
    if self._watcher is not None:
      self._watcher.join(WATCH_S + self.margin_s)
      self._watcher = None

  def fetch(self):
    version, boxed = self._get(self.store.get.remote())
    if version < 0:
      raise LookupError("no weights published yet")
    if self._fetched is not None and self._fetched[0] == version:
      return self._fetched
    host = self._get(boxed[0])
    if self.rollout_mesh is None or self.logical_axes is None:
      params = jax.device_put(host)
    else:
      params = jax.device_put(host, sharding.param_shardings(self.logical_axes, host,
                                                             self.rollout_mesh))
    self._fetched = (version, params)
    return self._fetched
