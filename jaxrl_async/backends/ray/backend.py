"""The 'ray' backend's run: the learner in the driver, rollout servers as Ray actors.

The driver (on the node that starts the run; in a cluster the head, offering the 'learner'
resource) runs the controller and the learner role, as the processes backend does, and by
default the run's buffer (`RunConfig.ray_buffer = 'driver'`: served to the actors over the
buffer service's socket transport, `hosted.py`; 'actor': a buffer actor beside the driver,
resource `RunConfig.ray_learner_resource`). Ray places `num_rollout_servers` rollout actors on
the nodes that offer the rollout resource (`RunConfig.ray_rollout_resource`), each asking for
`ray_rollout_cpus` CPUs and `ray_rollout_gpus` GPUs. Each actor owns a `RolloutServer` (its
engine, reward pool and prompt shard) reached through a `links` link's buffer client and a
weight channel (`weight_channels`): with `sync_backend='device'` the driver's shared memory
when every rollout node is on the driver's host (`host_weights.py`), else Ray's object store
(`RayWeightChannel` and a weight store actor); with 'store' the weight store in
<run_dir>/weights (sync/store_channel.py), which every node must see (a shared file system).

Faults: Ray restarts a killed actor (`max_restarts`); the new incarnation takes over the groups
its predecessor left unfinished from the claim book beside the buffer (`claims.ClaimBook.claim`:
revoke the old client, register a new one), continues its prompt shard, and re-issues each of
those groups exactly once, counted under `runtime/reissued_groups/actor_restarted` (and
`.../server_unresponsive` when the driver's heartbeat killed a silent actor).

Elastic: actors are added and retired during the run through `<run_dir>/fleet_control`
(`add` / `retire K` lines, `backends.fleet_control`), read at the heartbeat; a change of shape
restarts every actor on the new shape's work (`reshape.py`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jaxrl_async.backends import fleet_control
from jaxrl_async.backends.base import (
  Backend,
  Connection,
  Fleet,
  RoleFailed,
  keep_spans,
  load_overdue,
  warn_unscored,
)
from jaxrl_async.backends.processes.backend import make_channel, refuse_rollout_mesh
from jaxrl_async.backends.ray import buffer as ray_buffer
from jaxrl_async.backends.ray import host_weights
from jaxrl_async.backends.ray import placement as ray_backend
from jaxrl_async.backends.ray import weights as ray_weights
from jaxrl_async.backends.ray.actor import RESTART_WAIT_S, RolloutActorImpl
from jaxrl_async.backends.ray.buffer import DriverBuffer
from jaxrl_async.backends.ray.hosted import HostedBuffer
from jaxrl_async.backends.ray.links import as_link
from jaxrl_async.backends.ray.placement import require_ray
from jaxrl_async.backends.ray.reshape import Reshaping
from jaxrl_async.backends.ray.weights import RayWeightChannel
from jaxrl_async.config import RunConfig
from jaxrl_async.run.build import Parts, buffer_kwargs

REISSUE_REASONS = ("actor_restarted", "server_unresponsive")
MAX_RESTARTS = 8
SILENCE_MIN_S = 60.0
LOAD_POLL_S = 0.5  # how often a stop asks whether a weight load has ended


class RolloutActorFailed(RoleFailed):
  """A rollout actor's role raised, or an actor could not be restarted."""


class RayFleet(Reshaping, Fleet):
  """The rollout actors seen from the driver. Ray restarts a killed actor; the heartbeat kills
  a silent one and applies the control file (`Reshaping`, which also pauses and resumes)."""

  def __init__(self, config, buffer, channel_spec: dict, *, book=None,
               status_path: str | None = None, control_path: str | None = None, log=print):
    """`buffer`: what the actors reach the buffer by (a `links` link, or the buffer actor's
    handle); `book`: the restarts' bookkeeping as the driver calls it (None: `buffer`'s);
    `control_path`: the fleet control file (None: the fleet keeps its size)."""
    super().__init__(config.num_rollout_servers, log=log)
    self.ray = require_ray()
    self.config = config
    self.buffer = buffer
    self.book = as_link(buffer) if book is None else book
    self.channel_spec = channel_spec  # how the actors reach the weights (`weight_channels`)
    self.status_path = status_path
    self.heartbeat_timeout_s = config.heartbeat_timeout_s
    # A server may be silent this long (a restart by Ray included) before it is killed.
    self.silence_limit_s = max(3 * self.heartbeat_timeout_s, SILENCE_MIN_S)
    self._actor_class = self.ray.remote(RolloutActorImpl)
    self._load_deadline_missed = 0
    self._started = False
    self._init_elastic(control_path)
    self._resize(self.num_servers)

  def _resize(self, count: int) -> None:
    """The per-actor lists for `count` actors (none created yet)."""
    self.num_servers = count
    self.actors: list = [None] * count
    self.last_health = [{}] * count
    self._last_answer = [time.monotonic()] * count
    # The constructors' arguments stay referenced here: Ray needs them to restart an actor.
    self._constructor_args: list[list | None] = [None] * count
    self._killed: list[str | None] = [None] * count  # client ids killed here

  @property
  def restarts(self) -> int:
    return int(self.book.restarts())

  @property
  def counts(self) -> dict[str, int]:
    return {**self.book.reissue_counts(), **self.elastic_counts,
            "sync/load_deadline_missed": self._load_deadline_missed}

  def _get(self, ref, timeout: float = 60.0):
    return self.ray.get(ref, timeout=timeout)

  def launch(self) -> None:
    """Creates the rollout actors ahead of `start`: each one's process starts and imports JAX
    and the rollout code (seconds) while the driver restores its checkpoint and evaluates;
    their constructors then wait for `start` to hand over their restores."""
    if any(actor is not None for actor in self.actors):
      return
    for index in range(self.num_servers):
      self._new_actor(index)

  def _new_actor(self, index: int) -> None:
    """Creates actor `index` of the current fleet on a node offering the rollout resource; its
    constructor waits for its restore (`ClaimBook.restore_for`)."""
    cfg = self.config
    options = ray_backend.role_options(
        node_resource=cfg.ray_rollout_resource, num_cpus=cfg.ray_rollout_cpus,
        num_gpus=cfg.ray_rollout_gpus, max_restarts=MAX_RESTARTS, max_concurrency=4,
        env=ray_backend.thread_env(max(1, int(cfg.ray_rollout_cpus))))
    args = [self.ray.put(cfg), index, self.num_servers, self.buffer, self.channel_spec]
    self._constructor_args[index] = args
    self.actors[index] = self._actor_class.options(**options).remote(*args)

  def start(self, restores: list[dict | None]) -> None:
    if len(restores) != self.num_servers:
      raise ValueError(f"{len(restores)} restores for {self.num_servers} rollout servers")
    self.launch()
    self.book.set_restores(list(restores))
    self._started = True
    for index in range(self.num_servers):
      self._call(index, "start", RESTART_WAIT_S)
    self.check()

  def _call(self, index: int, method: str, timeout: float):
    """One control call; while Ray restarts the actor the call is retried (the restarted
    server is already running, so a 'start' is not repeated)."""
    deadline = time.monotonic() + RESTART_WAIT_S
    while True:
      try:
        return self._get(self.actors[index].call.remote(method, timeout),
                         timeout + ray_backend.RPC_MARGIN_S)
      except self.ray.exceptions.RayActorError as error:
        if time.monotonic() > deadline:
          raise RolloutActorFailed(f"rollout actor {index} did not come back within "
                                   f"{RESTART_WAIT_S} s") from error
        if method == "start":
          return None
        time.sleep(0.5)

  def _write_status(self) -> None:
    if self.status_path is None:
      return
    status = [{"server": i, "pid": h.get("pid"), "client_id": h.get("client_id"),
               "node_id": h.get("node_id")} for i, h in enumerate(self.last_health)]
    with open(self.status_path + ".tmp", "w", encoding="utf-8") as f:
      json.dump({"servers": status, "restarts": self.restarts}, f)
    os.replace(self.status_path + ".tmp", self.status_path)

  def check(self) -> None:
    """One heartbeat: a silent actor is killed (Ray restarts it); a role error stops the run;
    then the control file's commands are applied (`Reshaping._apply_control`)."""
    for index, actor in enumerate(self.actors):
      try:
        health = self._get(actor.call.remote("health", self.heartbeat_timeout_s),
                           self.heartbeat_timeout_s)
      except (self.ray.exceptions.GetTimeoutError, self.ray.exceptions.RayActorError) as error:
        # Silent, or dead and being restarted by Ray (calls wait for the new incarnation).
        now = time.monotonic()
        if now - self._last_answer[index] > RESTART_WAIT_S:
          raise RolloutActorFailed(f"rollout actor {index} has not answered for "
                                   f"{RESTART_WAIT_S:.0f} s: {error!r}") from error
        if isinstance(error, self.ray.exceptions.RayActorError):
          continue  # died: Ray restarts it (past max_restarts this persists and fails above)
        if self.book.constructing(index):
          self._last_answer[index] = now
        elif now - self._last_answer[index] > self.silence_limit_s:
          self.log(f"rollout actor {index} silent for {self.silence_limit_s:.0f} s: killed, "
                   "Ray restarts it")
          self.book.note_unresponsive(index)
          self.ray.kill(actor, no_restart=False)
          self._last_answer[index] = now
        continue
      self._last_answer[index] = time.monotonic()
      self._take_answer(index, health)
      if health["error"] is not None:
        raise RolloutActorFailed(f"rollout actor {index} failed: {health['error']}")
      if load_overdue(health, self.config.sync_load_deadline_s):
        self._restart_stuck(index, f"still loading weights after "
                            f"{self.config.sync_load_deadline_s} s", deadline=True)
    self._write_status()
    self._apply_control()

  def _take_answer(self, index: int, answer: dict) -> None:
    """A health (or stop) answer of actor `index`: an answer of a new incarnation first keeps
    its predecessor's counts in the run's totals."""
    if self.last_health[index] and (
        answer.get("client_id") != self.last_health[index].get("client_id")):
      self.retire(index)
    self.last_health[index] = answer
    keep_spans(self.pending_spans, answer)

  def _restart_stuck(self, index: int, why: str, *, deadline: bool) -> None:
    """Kills the incarnation of actor `index` that answered last, so that Ray restarts it and
    the new one claims its groups and its group numbering from the buffer actor. An answer
    still coming from an incarnation already killed here is not killed again: that kill would
    land on its successor."""
    client_id = self.last_health[index].get("client_id")
    if client_id is not None and client_id == self._killed[index]:
      return
    self._killed[index] = client_id
    self.log(f"rollout actor {index} {why}: killed, Ray restarts it")
    if deadline:
      self._load_deadline_missed += 1
    self.book.note_unresponsive(index)
    self.ray.kill(self.actors[index], no_restart=False)

  def _each(self, method: str, timeout: float) -> list[Any]:
    return [self._call(index, method, timeout) for index in range(self.num_servers)]

  def placement(self) -> dict[str, Any]:
    """Where the actors ran (node ids of the servers' last answers, and the driver's)."""
    nodes = sorted({h.get("node_id") for h in self.last_health if h.get("node_id")})
    return {"ray/rollout_nodes": nodes,
            "ray/driver_node": self.ray.get_runtime_context().get_node_id()}

  def _stop_one(self, index: int, timeout: float) -> None:
    """Stops actor `index`; its answer (final counts, drops, next group id) must come from
    the incarnation that holds the actor's groups. A server in a weight load gets until
    `sync_load_deadline_s` to finish it (a stop waits for the load); a server still loading
    past it, or whose stop fails in its role (stuck), is killed as the heartbeat would kill it,
    and the stop goes to the incarnation Ray restarts, which claimed every group and the
    numbering of the stuck one."""
    deadline_s = self.config.sync_load_deadline_s
    while deadline_s is not None:
      health = self._call(index, "health", RESTART_WAIT_S)  # a restart may be under way
      self._take_answer(index, health)
      loading_s = (health.get("sync") or {}).get("loading_s")
      if loading_s is None:
        break
      if loading_s > deadline_s:
        self._restart_stuck(index, f"still loading weights after {deadline_s} s at the stop",
                            deadline=True)
        break
      time.sleep(min(LOAD_POLL_S, deadline_s - loading_s + 0.05))
    try:
      answer = self._call(index, "stop", timeout)
    except RolloutActorFailed:
      raise
    except Exception as error:  # raised in the server's role: it could not stop
      self._restart_stuck(index, f"did not stop ({error!r})", deadline=False)
      answer = self._call(index, "stop", timeout)
    self._take_answer(index, answer)

  def stop(self, timeout: float = 60.0) -> None:
    """Stops every actor; rollout_servers.json then names the incarnations that stopped (a
    restart after the last heartbeat is known only from the stop's answer). Actors launched
    but never started (a run that failed before `start`) are only killed."""
    if not self._started:
      for index, actor in enumerate(self.actors):
        if actor is not None:
          self.ray.kill(actor, no_restart=True)
          self.actors[index] = None
      return
    stopped = False
    for index, actor in enumerate(self.actors):
      if actor is None:
        continue
      stopped = True
      try:
        self._stop_one(index, timeout)
        warn_unscored(index, self.last_health[index], self.log)
      except Exception as error:  # reported; the actor is killed either way
        self.log(f"rollout actor {index} did not stop cleanly ({error!r}): killed")
      finally:
        self.ray.kill(actor, no_restart=True)
        self.actors[index] = None
    if stopped:
      try:
        self._write_status()
      except Exception as error:  # the buffer actor is gone (a failed run): reported only
        self.log(f"rollout_servers.json not updated at the stop: {error!r}")


def weight_channels(parts: Parts, run_dir, learner_place: dict) -> tuple[Any, dict, Any]:
  """(the learner's end, how the rollout actors open theirs: `host_weights.open_actor_channel`,
  the weight store actor or None), by `RunConfig.sync_backend`: 'device' through shared memory
  when every node that may host a rollout actor is on the driver's host (`host_weights`), else
  through Ray's object store (a weight store actor placed by `learner_place`); 'store' through
  the weight store in <run_dir>/weights, a directory every node must see (a shared file
  system)."""
  cfg = parts.config
  if cfg.sync_backend == "store" or host_weights.use_shared_memory(cfg.ray_rollout_resource):
    return (*make_channel(parts, run_dir), None)
  store = ray_weights.start_weight_store(**learner_place)
  return (RayWeightChannel(store, parts.learner.spec.logical_axes),
          {"kind": "ray", "store": store}, store)


def await_started(first_calls: dict[str, Any], timeout_s: float = RESTART_WAIT_S) -> None:
  """Waits for each actor's answer to a first call (its remote method, by the actor's name): an
  actor's start (a worker process importing JAX, slow on a loaded machine) is bounded by
  `timeout_s`, not by the margin of the calls that follow it."""
  ray = require_ray()
  for name, method in first_calls.items():
    try:
      ray.get(method.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as error:
      raise TimeoutError(f"the {name} actor did not start within {timeout_s:.0f} s") from error


class RayBackend(Backend):
  """Connects to the Ray cluster this process is attached to (`ray.init` done by the caller),
  else to RAY_ADDRESS, else starts a local one."""

  name = "ray"

  def check_config(self, config: RunConfig) -> None:
    refuse_rollout_mesh(config, self.name)

  @contextmanager
  def connect(self, parts: Parts, run_dir, log=print) -> Iterator[Connection]:
    ray = require_ray()
    if not ray.is_initialized():
      address = os.environ.get("RAY_ADDRESS")
      extra = {}
      if address and address.startswith(ray_backend.LOOPBACK + ":"):
        # A cluster on the loopback interface (one machine): this driver joins it there too,
        # never on the machine's outward address.
        extra = {"_node_ip_address": ray_backend.LOOPBACK, "namespace": "jaxrl_async"}
      ray.init(address=address, log_to_driver=False, **extra)
    cfg = parts.config
    learner_place = {"node_resource": cfg.ray_learner_resource}
    with buffer_side(cfg, learner_place) as (buffer, book, driver_buffer, ledger, first_calls):
      channel, channel_spec, store = weight_channels(parts, run_dir, learner_place)
      fleet = RayFleet(cfg, buffer, channel_spec, book=book,
                       status_path=os.path.join(run_dir, "rollout_servers.json"),
                       control_path=os.path.join(run_dir, fleet_control.CONTROL_FILE), log=log)
      try:
        fleet.launch()  # the rollout actors start meanwhile
        await_started({**first_calls,
                       **({} if store is None else {"weight store": store.latest})})
        yield Connection(buffer=driver_buffer, channel=channel, fleet=fleet,
                         started_groups=ledger)
      finally:
        try:
          fleet.stop()
        finally:
          channel.close()
          if store is not None:
            ray.kill(store, no_restart=True)


@contextmanager
def buffer_side(cfg: RunConfig, learner_place: dict):
  """The run's buffer where `RunConfig.ray_buffer` puts it, as (what the rollout actors reach
  it by, the claim book as the fleet calls it, the buffer as the learner uses it, the started
  groups' ledger, first calls to await): 'driver' serves it from this process on the address of
  its Ray node (`hosted.HostedBuffer`); 'actor' keeps it in a buffer actor on a node offering
  `ray_learner_resource`."""
  ray = require_ray()
  if cfg.ray_buffer == "driver":
    hosted = HostedBuffer(buffer_kwargs(cfg), host=ray.util.get_node_ip_address())
    try:
      yield (hosted.link(), hosted, hosted.buffer, hosted.service.started_groups, {})
    finally:
      hosted.stop()
    return
  actor = ray_buffer.start_buffer_actor(buffer_kwargs(cfg), **learner_place)
  try:
    yield (actor, None, DriverBuffer(actor),
           lambda: ray.get(actor.ledger.remote(), timeout=60.0), {"buffer": actor.node_id})
  finally:
    ray.kill(actor, no_restart=True)
