"""The learner over several processes (`jax.distributed`): one global learner mesh, one update.

Process 0 is the controller: it runs the whole run as a single process does (buffer, rollout
fleet, ledger, evaluation, metrics, the one loop of `loop.py` / `sync_loop.py`). Every other
process is a follower: it builds the same learner side on the global mesh and then only does
what process 0 tells it, step by step, so that every program over the global arrays is run by
all processes in the same order:

    update   the next batch (its shapes in the instruction, its values by a collective
             broadcast from process 0), then the same jitted update as process 0's;
    copy     a copy of the current params (a version window's anchor);
    host     the current params gathered to every host (a publish or an evaluation on 0);
    open / save / restore / close
             the run's checkpointer: orbax's multi-process save and restore, every process
             writing and reading its shards of the learner's state;
    stop     the run is over.

Instructions travel through the coordination service's key-value store; a follower acknowledges
each one, and process 0 waits at most `ack_timeout_s` for that before it sends the next, so a
follower that hangs is an error instead of a hang. A follower that dies fails process 0's next
collective, or stops the counter it raises every second in the store while process 0 awaits it:
its acknowledgement, or a step's body, which runs on a thread of its own so that process 0 can
leave it where it blocks (an orbax barrier; `multihost_life.py`). `LearnerLost` comes after
`SILENT_S`, before the coordination service's heartbeat timeout aborts the process, and names
the last checkpoint. A dead controller ends the followers' wait.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from jaxrl_async import distributed, sharding
from jaxrl_async.checkpoint import RunCheckpointer
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.batching import TrainBatch
from jaxrl_async.learner.sft import cached_base_policy
from jaxrl_async.run import build as build_lib
from jaxrl_async.run import multihost_life as life_lib
from jaxrl_async.run.multihost_life import SILENT_S

OP_KEY = "jaxrl_async/learner/{seq}"
ACK_KEY = "jaxrl_async/learner_ack/{process}/{seq}"
ACK_TIMEOUT_S = 600.0  # the longest one instruction (an update, a checkpoint) may take
POLL_MS = 1000  # a follower's wait for its next instruction, in slices of this length
ACK_SLICE_MS = 2000  # process 0's wait for an acknowledgement, in slices of this length


class LearnerLost(RuntimeError):
  """A learner process stopped answering: the run cannot go on (the learner's state spans it)."""


def _client():
  from jax._src import distributed as jax_distributed
  client = jax_distributed.global_state.client
  if client is None:
    raise RuntimeError("a multi-process learner needs jax.distributed.initialize first")
  return client


def check_config(config: RunConfig) -> None:
  """Settings a multi-process learner cannot honour, refused before anything is built."""
  if config.rollout_mesh is not None or config.rollout_device_ids is not None:
    raise ValueError("a multi-process learner places the rollout engine on process 0's first "
                     "device: rollout_mesh and rollout_device_ids must be None")
  if config.learner_device_ids is not None:
    raise ValueError("a multi-process learner spans every process's devices: "
                     "learner_device_ids must be None")
  devices = len(jax.devices())
  if config.learner_mesh.num_devices(devices) != devices:
    raise ValueError(f"learner_mesh={config.learner_mesh} takes "
                     f"{config.learner_mesh.num_devices(devices)} of the {devices} devices of "
                     f"{jax.process_count()} processes: a multi-process learner's mesh spans "
                     "them all (add gin/placement/multihost.gin: fsdp = -1)")
  if config.checkpoint is not None:
    raise ValueError("a multi-process learner starts from the cached base policy; "
                     "RunConfig.checkpoint (a Hugging Face checkpoint) is one process only")


# ---- what every process builds ------------------------------------------------------------
def _base_policy_on_host(config: RunConfig, spec, log):
  """Process 0: the cached base policy as numpy, read (or trained and cached) by this process
  alone, on its own devices. The other processes: zeros of the same shapes."""
  if jax.process_index() != 0:
    return jax.tree.map(lambda x: np.zeros(x.shape, x.dtype), spec.abstract_params)
  local = sharding.make_mesh(sharding.MeshShape(fsdp=-1), jax.local_devices())
  alone = ocp.StandardCheckpointer(multiprocessing_options=ocp.options.MultiprocessingOptions(
      primary_host=0, active_processes={0}))
  params = cached_base_policy(spec.task, spec.model_config, config.warm_start, local, log=log,
                              checkpointer=alone)
  return jax.device_get(params)


def global_learner_side(config: RunConfig, spec, *, log=print, leader=None):
  """The learner side on the global mesh, the same on every process: the base policy comes from
  process 0 (a collective broadcast), so every process starts from the very same weights."""
  check_config(config)
  mesh = distributed.global_mesh(config.learner_mesh)
  host = multihost_utils.broadcast_one_to_all(_base_policy_on_host(config, spec, log))
  params = distributed.to_global(
      host, sharding.param_shardings(spec.logical_axes, host, mesh))
  return build_lib.build_learner_side(config, spec, mesh, log=log, params=params,
                                      multihost=leader)


def precompile(learner, config: RunConfig, spec, *, log=print) -> None:
  if config.precompile_updates and config.pack_sequences:
    build_lib.precompile_updates(learner, spec.task.eval_set(config.eval_size), log=log)


def build_leader(config: RunConfig, *, log=print) -> build_lib.Parts:
  """Process 0's parts: the learner on the global mesh (driven through a `Leader`), the rollout
  side on this process's first device."""
  spec = build_lib.model_spec(config)
  leader = Leader()
  learner = global_learner_side(config, spec, log=log, leader=leader)
  rollout = build_lib.build_rollout_side(config, spec=spec, mesh=None)
  if config.precompile_updates and config.pack_sequences:
    build_lib.precompile_updates(learner, rollout.eval_problems, log=log)
  return build_lib.Parts(config=config, learner=learner, rollout=rollout, rollout_mesh=None)


# ---- the steps every process runs alike ---------------------------------------------------
def _describe(batch: TrainBatch) -> dict:
  return {name: [list(value.shape), np.dtype(value.dtype).name]
          for name, value in vars(batch).items()}


def _blank(fields: dict) -> TrainBatch:
  return TrainBatch(**{name: np.zeros(shape, dtype) for name, (shape, dtype) in fields.items()})


def update_step(learner, state, batch: TrainBatch, window_params, version: int, local: int):
  """Process 0's batch on every process (a broadcast), placed on the global mesh, and the
  update -> (state, metrics as numpy)."""
  batch = multihost_utils.broadcast_one_to_all(batch)
  batch = distributed.to_global(batch, jax.tree.map(
      lambda x: sharding.batch_sharding(learner.mesh, x.shape), batch))
  state, metrics = build_lib.update_on_batch(learner, state, batch, window_params, version,
                                             local)
  return state, distributed.to_host(metrics)


def host_params(params):
  """Every process gathers the params (a collective); process 0 puts them on its first device."""
  gathered = distributed.to_host(params)
  return jax.device_put(gathered, jax.local_devices()[0])


class NoPrompts:
  """A follower's stand-in for the prompt iterator in a checkpoint (process 0 holds the
  prompts; orbax writes one prompt file per process)."""

  def get_state(self) -> bytes:
    return b"{}"

  def set_state(self, state: bytes) -> None:
    del state

  def start_prefetch(self) -> None:
    return None


# ---- process 0 -----------------------------------------------------------------------------
class Leader:
  """Process 0's side: each step over the learner's global arrays is announced to the other
  processes, then run here as there. One step at a time (a lock): the learner's thread, the
  watchdog and the main thread may each take one."""

  def __init__(self, *, ack_timeout_s: float = ACK_TIMEOUT_S):
    self.ack_timeout_s = ack_timeout_s
    self.seq = 0
    self.lost: str | None = None  # why the run cannot go on, once a follower is gone
    self.last_checkpoint: int | None = None
    self._lock = threading.RLock()

  @property
  def followers(self) -> range:
    return range(1, jax.process_count())

  def _await_acks(self) -> None:
    client = _client()
    for process in self.followers:
      key = ACK_KEY.format(process=process, seq=self.seq)
      began, life = time.monotonic(), life_lib.Life(client, process)
      while True:
        try:
          client.blocking_key_value_get(key, ACK_SLICE_MS)
          break
        except jax.errors.JaxRuntimeError as error:
          waited = time.monotonic() - began
          if "DEADLINE_EXCEEDED" not in str(error) or waited >= self.ack_timeout_s:
            raise self.lose(f"learner process {process} did not finish step {self.seq} "
                             f"within {waited:.0f} s ({str(error)[:200]})") from error
          if life.silent_s() >= SILENT_S:
            raise self.lose(f"learner process {process} stopped answering during step "
                             f"{self.seq} (no sign of life for {SILENT_S:.0f} s)") from error
      client.key_value_delete(key)
    # Every follower has read the instruction: only now may it go (a follower that deleted it
    # on reading would hide it from the others).
    client.key_value_delete(OP_KEY.format(seq=self.seq))

  def lose(self, why: str) -> LearnerLost:
    """The run cannot go on (the first `why` is kept): the error that names the last
    checkpoint."""
    self.lost = self.lost or why
    where = ("no checkpoint was written" if self.last_checkpoint is None
             else f"the last checkpoint is policy_version {self.last_checkpoint}")
    return LearnerLost(f"{self.lost}; the learner's state spans that process, so the run "
                       f"stops: {where} (continue with --resume, every process again)")

  def run(self, op: str, body, **fields):
    """Announce `op`, then run `body()` here -> its result. A collective that fails (a follower
    died), a follower that never finishes its previous step, or one that stops raising its
    counter while `body` waits on it (an orbax barrier) raises LearnerLost."""
    with self._lock:
      if self.lost is not None:
        raise self.lose(self.lost)
      if self.seq:
        self._await_acks()
      self.seq += 1
      client = _client()
      client.key_value_set(OP_KEY.format(seq=self.seq), json.dumps({"op": op, **fields}))
      try:
        return life_lib.run_watching(body, [life_lib.Life(client, p) for p in self.followers])
      except life_lib.FollowerSilent as silent:
        raise self.lose(f"learner process {silent.process} stopped answering during step "
                         f"{self.seq} ({op}; no sign of life for {SILENT_S:.0f} s)") from None
      except jax.errors.JaxRuntimeError as error:
        raise self.lose(f"a collective of step {self.seq} ({op}) failed: "
                         f"{str(error)[:300]}") from error

  def update(self, learner, state, batch: TrainBatch, window_params, version: int, local: int):
    return self.run("update", lambda: update_step(learner, state, batch, window_params, version,
                                                  local),
                    version=version, local=local, fields=_describe(batch),
                    window=window_params is not None)

  def copy(self, params):
    return self.run("copy", lambda: build_lib.copy_params(params))

  def host(self, params):
    return self.run("host", lambda: host_params(params))

  def checkpointer(self, directory, *, log=print) -> LeaderCheckpointer:
    return LeaderCheckpointer(self, directory, log=log)

  def publishing(self, channel) -> PublishFromHost:
    return PublishFromHost(channel, self)

  def abort(self, why: str) -> None:
    """Process 0 failed: the followers leave their loop with an error (best effort, no wait)."""
    with contextlib.suppress(Exception):
      _client().key_value_set(OP_KEY.format(seq=self.seq + 1),
                              json.dumps({"op": "abort", "why": why[:500]}))

  def stop(self) -> None:
    """The run is over: the followers leave their loop (waits for their last step)."""
    if self.lost is None:
      self.run("stop", lambda: None)
      self._await_acks()


class LeaderCheckpointer(RunCheckpointer):
  """The run's checkpointer on process 0: every open, save, restore and close is also done by
  the other processes (orbax's multi-process path)."""

  def __init__(self, leader: Leader, directory, *, log=print):
    self.leader = leader
    leader.run("open", lambda: super(LeaderCheckpointer, self).__init__(directory, log=log),
               directory=str(directory))

  def save(self, step, state, prompt_iterator, run_state, *, wait: bool = True) -> None:
    try:
      self.leader.run("save", lambda: super(LeaderCheckpointer, self).save(
          step, state, prompt_iterator, run_state, wait=True), step=int(step))
    except LearnerLost:
      # A follower died in orbax's last barrier, after the checkpoint's directory got its
      # final name (orbax's commit): that checkpoint is whole, and the message says so.
      if not os.path.isdir(os.path.join(self.directory, str(int(step)))):
        raise
      self.leader.last_checkpoint = int(step)
      raise self.leader.lose(self.leader.lost) from None
    self.leader.last_checkpoint = int(step)

  def restore_latest(self, state, prompt_iterator):
    restored = self.leader.run(
        "restore", lambda: super(LeaderCheckpointer, self).restore_latest(state, prompt_iterator))
    if restored is not None:
      self.leader.last_checkpoint = restored[2]
    return restored

  def close(self) -> None:
    if self.leader.lost is not None:  # a barrier with a dead process would fail or hang
      return
    self.leader.run("close", super().close)


class PublishFromHost:
  """A weight channel whose publishes take the learner's global params: gathered onto process
  0's first device (a collective every process joins), then published as before."""

  def __init__(self, channel, leader: Leader):
    self._channel = channel
    self._leader = leader

  def publish(self, version: int, params) -> None:
    self._channel.publish(version, self._leader.host(params))

  def __getattr__(self, name):
    return getattr(self._channel, name)


# ---- the other processes -------------------------------------------------------------------
def _next_instruction(seq: int) -> dict:
  """Waits for instruction `seq` for as long as process 0 lives (its coordination service)."""
  client = _client()
  key = OP_KEY.format(seq=seq)
  while True:
    try:
      value = client.blocking_key_value_get(key, POLL_MS)
    except jax.errors.JaxRuntimeError as error:
      if "DEADLINE_EXCEEDED" in str(error):
        continue
      raise LearnerLost(f"learner process {jax.process_index()}: the controller (process 0) "
                        f"is gone: {str(error)[:300]}") from error
    return json.loads(value)  # process 0 deletes it once every follower has acknowledged it


def follow(config: RunConfig, *, log=print) -> int:
  """A follower's whole run: build the learner side, then do process 0's steps until 'stop'.
  Returns the number of updates it ran."""
  stop = threading.Event()
  threading.Thread(target=life_lib.signs_of_life, args=(_client(), jax.process_index(), stop),
                   name="alive", daemon=True).start()
  try:
    return _follow(config, log=log)
  finally:
    stop.set()


def _follow(config: RunConfig, *, log=print) -> int:
  spec = build_lib.model_spec(config)
  learner = global_learner_side(config, spec, log=log)
  precompile(learner, config, spec, log=log)
  state, window, checkpointer, updates = learner.initial_state, None, None, 0
  seq, client, me = 0, _client(), jax.process_index()
  while True:
    seq += 1
    message = _next_instruction(seq)
    op = message["op"]
    if op == "update":
      state, _ = update_step(learner, state, _blank(message["fields"]),
                             window if message["window"] else None, message["version"],
                             message["local"])
      updates += 1
    elif op == "copy":
      window = build_lib.copy_params(state.params)
    elif op == "host":
      distributed.to_host(state.params)
    elif op == "open":
      checkpointer = RunCheckpointer(message["directory"], log=log)
    elif op == "save":
      checkpointer.save(message["step"], state, NoPrompts(), {})
    elif op == "restore":
      restored = checkpointer.restore_latest(state, NoPrompts())
      if restored is not None:
        state = restored[0]
    elif op == "close":
      checkpointer.close()
      checkpointer = None
    elif op == "abort":
      raise LearnerLost(f"process 0 stopped the run: {message.get('why')}")
    elif op != "stop":
      raise ValueError(f"learner process {me}: unknown instruction {message!r}")
    client.key_value_set(ACK_KEY.format(process=me, seq=seq), "done")
    if op == "stop":
      return updates
