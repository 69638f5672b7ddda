"""A rollout server: the Rollouter role with its own engine, reward pool and prompt shard.

`RolloutServer` is process-agnostic: it runs in whatever process builds it (this one for the
threads backend, a spawned child for processes, a Ray actor for Ray) and talks to the learner's
side only through a `BufferClient` and a weight channel. `RolloutControl` is what the
controller asks of it; `processes.rollout_process.RolloutProcess` is the same interface for a
server in a child process.

Server k of K draws its share of the prompt stream (`tasks.prompt_stream.StreamShard`: on a
fresh run the positions k, k + K, k + 2K, ... of the shuffled epochs) and numbers its groups
s, s + K, s + 2K, ... from its start s (k on a fresh run; `restore['rollout']['next_group_id']`
otherwise), so prompts and group ids never collide between servers. When the number of servers
changes, `backends.fleet_shape` deals new shares and starts, which reach a server only through
its `restore`.
"""

from __future__ import annotations

import abc
import os
import socket
import threading
from typing import Any

from jaxrl_async import faults
from jaxrl_async.config import RunConfig
from jaxrl_async.metrics import RoleTimer
from jaxrl_async.rollout.evaluate import evaluate
from jaxrl_async.rollout.server_rollouter import ServerRollouter
from jaxrl_async.run.build import RolloutSide, build_rollout_side
from jaxrl_async.tasks.prompt_stream import StreamShard


class RolloutControl(abc.ABC):
  """What the controller asks of one rollout server; every call has a timeout."""

  @abc.abstractmethod
  def start(self, timeout: float) -> None:
    """Starts generating (returns once the server runs)."""

  @abc.abstractmethod
  def pause(self, timeout: float) -> None:
    """Stops at a decode-step boundary with nothing between roles (every rewarded sample is in
    the buffer), so that a snapshot and the buffer's state agree."""

  @abc.abstractmethod
  def resume(self, timeout: float) -> None:
    """Continues after `pause`."""

  @abc.abstractmethod
  def snapshot(self, timeout: float) -> dict[str, Any]:
    """While paused: `{'rollout': groups in flight + next group id, 'prompts': prompt iterator
    state}` (plain JSON data), to restore the server from a checkpoint."""

  @abc.abstractmethod
  def evaluate(self, timeout: float) -> dict[str, float]:
    """Held-out accuracy of the weights the server holds (on its own decode state)."""

  @abc.abstractmethod
  def health(self, timeout: float) -> dict[str, Any]:
    """`{'alive', 'error', 'version', 'counts'}`; raises TimeoutError when it does not answer."""

  @abc.abstractmethod
  def stop(self, timeout: float) -> dict[str, Any]:
    """Stops the server and returns its final counts (aborted samples counted as 'shutdown')."""


def reader_state(channel) -> dict | None:
  """The weight channel's view of this server's loads (the weight store has one)."""
  state = getattr(channel, "reader_state", None)
  return None if state is None else state()


def strip_admission(entries: list[dict]) -> list[dict]:
  """Re-issue entries for a restored buffer: admissions held before the save do not carry."""
  return [{key: value for key, value in entry.items() if key != "admitted"}
          for entry in entries]


def first_start(restore: dict | None, index: int) -> tuple[dict, dict]:
  """(what server `index` starts from, where its shard started) on its first start: a
  checkpoint's snapshot without its admissions, or a fresh start (`restore=None`). The second
  is what a replacement of the server resumes from when its predecessor left no position."""
  restore = dict(restore or {})
  rollout = dict(restore.get("rollout") or {})
  rollout["inflight"] = strip_admission(rollout.get("inflight", []))
  restore["rollout"] = rollout
  return restore, {"prompts": restore.get("prompts"),
                   "next_group_id": rollout.get("next_group_id", index)}


def open_prompts(side: RolloutSide, state, index: int, count: int, seed: int):
  """Server `index` of `count`'s prompt iterator, at `state` (None: its fresh start). A task
  with its own prompt pipeline (stored rows) keeps it: one server, and no re-dealt state."""
  if getattr(side.task, "prompt_dataset", None) is None:
    prompts = StreamShard(side.task, seed=seed, index=index, count=count)
  else:
    if isinstance(state, dict) and "stride" in state:
      raise ValueError(f"{type(side.task).__name__} makes its own prompt pipeline: its "
                       "prompts cannot be re-dealt to another number of rollout servers")
    prompts = side.prompts
  if state is not None:
    prompts.set_state(state)
  return prompts


class RolloutServer(RolloutControl):
  """One rollout server in this process; `restore` = {'rollout': ..., 'prompts': ...} from a
  snapshot (a checkpoint: admissions are re-acquired) or from the buffer service after a
  server was lost (`admitted` entries keep theirs)."""

  def __init__(self, config: RunConfig, *, server_index: int, num_servers: int, buffer,
               channel, restore: dict | None = None, side: RolloutSide | None = None):
    self.config = config
    self.server_index = server_index
    self.side = (build_rollout_side(config, server_index, num_servers) if side is None
                 else side)
    restore = restore or {}
    self.prompts = open_prompts(self.side, restore.get("prompts"), server_index, num_servers,
                                config.seed)
    rollout = restore.get("rollout") or {}
    self.timer = RoleTimer()
    self.side.rewards.timer = self.timer
    self.channel = channel
    self.rollouter = ServerRollouter(
        batcher=self.side.new_batcher(), prompts=self.prompts, rewards=self.side.rewards,
        buffer=buffer, channel=channel, timer=self.timer,
        make_requests=self.side.make_requests, group_size=config.group_size,
        partial_rollout=config.partial_rollout, partial_strategy=config.partial_strategy,
        next_group_id=rollout.get("next_group_id", server_index),
        reissue=rollout.get("inflight", []), group_id_stride=num_servers)
    self._evaluator = None
    self._spans_sent = 0  # of the timer's closed spans, how many health() has handed out
    self._drops: list = []  # every drop of this server, as (reason, sample uids)
    self._health_lock = threading.Lock()  # health answers may be asked for concurrently

  def start(self, timeout: float = 10.0) -> None:
    del timeout
    self.rollouter.start()

  def pause(self, timeout: float = 60.0) -> None:
    self.rollouter.pause(timeout)

  def resume(self, timeout: float = 10.0) -> None:
    del timeout
    self.rollouter.resume()

  def snapshot(self, timeout: float = 10.0) -> dict[str, Any]:
    del timeout
    return {"rollout": self.rollouter.snapshot(), "prompts": self.prompts.get_state()}

  def evaluate(self, timeout: float = 600.0) -> dict[str, float]:
    del timeout
    if self._evaluator is None:
      self._evaluator = self.side.new_batcher()
    version, params = self.channel.fetch()
    self._evaluator.set_params(params, version)
    return evaluate(self._evaluator, self.side.task, self.side.eval_problems,
                    seed=self.config.seed)

  def health(self, timeout: float = 10.0) -> dict[str, Any]:
    del timeout
    role = self.rollouter
    with self._health_lock:  # a late answer never misses drops an earlier one took
      self._spans_sent, spans = self.timer.spans_since(self._spans_sent)
      self._drops.extend(role.take_drop_log())
      drops = list(self._drops)
    return {"alive": role.alive, "error": None if role.error is None else repr(role.error),
            "version": role.batcher.version, "counts": dict(role.counts),
            "next_group_id": role.next_group_id, "drops": drops,
            "rewarding": role.rewarding, "reward_counts": dict(self.side.rewards.counts),
            "timer": self.timer.summary(), "pid": os.getpid(),
            "host": socket.gethostname(), "spans": spans,
            "hanging": sorted(faults.hanging),  # fault points a thread here is blocked at
            "sync": reader_state(self.channel)}

  def stop(self, timeout: float = 30.0) -> dict[str, Any]:
    """Stops the role and waits for the batches still being scored: each one ends in the buffer
    or as a 'shutdown' drop before the answer (this server's last health) is made, so the
    drops it lists are complete. Samples still scored after `timeout` are named in the answer
    (`rewarding`) and the run's ledger audit reports them missing."""
    faults.point("rollout.stop")
    self.rollouter.stop()
    try:
      self.rollouter.join(timeout)
      self.rollouter.wait_rewards(timeout)
    finally:
      self.side.rewards.close()
    return self.health()
