"""The `processes` backend: the learner, the buffer service and the controller in this process,
K rollout servers in spawned child processes beside it, each on its own share of the cores.

Samples come in over the buffer service (one call per batch), weights go out over shared
memory (`sync_backend='device'`) or the weight store (`'store'`, sync/store_channel.py). A server that dies or stops
answering is replaced by the fleet (`fleet.py`), its unfinished groups re-issued exactly once.
Servers are added and retired during the run through `<run_dir>/fleet_control`
(`fleet_control.py`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager

from jaxrl_async.backends import fleet_control
from jaxrl_async.backends.base import Backend, Connection
from jaxrl_async.backends.processes import child
from jaxrl_async.backends.processes.buffer_service import BufferService
from jaxrl_async.backends.processes.fleet import ProcessFleet
from jaxrl_async.backends.processes.rollout_process import PROCESS_CHANNELS
from jaxrl_async.config import RunConfig
from jaxrl_async.run.build import Parts, buffer_for
from jaxrl_async.sync import TensorStoreChannel, store_options
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel


def refuse_rollout_mesh(config: RunConfig, backend: str) -> None:
  """A rollout server of another process builds its engine on its own default device: a
  `rollout_mesh` placement could not be honoured there, so it is refused, not ignored."""
  if config.rollout_mesh is not None or config.rollout_device_ids is not None:
    raise ValueError(
        f"RunConfig.rollout_mesh={config.rollout_mesh!r} / rollout_device_ids="
        f"{config.rollout_device_ids!r}: the {backend} backend runs each rollout server in its "
        "own process on that process's devices, so a rollout mesh placed beside the learner "
        "cannot apply; use backend='threads' for a placement on this process's devices, or "
        "leave rollout_mesh and rollout_device_ids unset")


def make_channel(parts: Parts, run_dir):
  """(learner end, spec the servers open their end from)."""
  abstract = parts.learner.spec.abstract_params
  if PROCESS_CHANNELS[parts.config.sync_backend] == "shm":
    channel = SharedMemoryWeightChannel.create(abstract)
    return channel, {"kind": "shm", "location": channel.name}
  directory = os.path.join(os.path.abspath(run_dir), "weights")
  shutil.rmtree(directory, ignore_errors=True)  # transport, not a checkpoint
  return (TensorStoreChannel(directory, abstract, parts.learner.spec.logical_axes,
                             **store_options(parts.config)),
          {"kind": "store", "location": directory})


class ProcessesBackend(Backend):
  name = "processes"

  def check_config(self, config: RunConfig) -> None:
    refuse_rollout_mesh(config, self.name)

  @contextmanager
  def connect(self, parts: Parts, run_dir, log=print) -> Iterator[Connection]:
    cfg = parts.config
    buffer = buffer_for(cfg)
    channel, channel_spec = make_channel(parts, run_dir)
    service = BufferService(buffer).start()
    _, server_cores = child.core_shares(cfg.num_rollout_servers)
    fleet = ProcessFleet(cfg, service, channel_spec, cores=server_cores,
                         heartbeat_timeout_s=cfg.heartbeat_timeout_s,
                         status_path=os.path.join(run_dir, "rollout_servers.json"),
                         control_path=os.path.join(run_dir, fleet_control.CONTROL_FILE),
                         log=log)
    try:
      yield Connection(buffer=buffer, channel=channel, fleet=fleet,
                       started_groups=service.started_groups)
    finally:
      try:
        fleet.stop()
      finally:
        buffer.close()
        service.stop()
        channel.close()
