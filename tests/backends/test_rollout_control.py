"""The RolloutControl contract, run against a rollout server in this process and one in a
spawned process: start, pause (a consistent snapshot: every started sample is in the buffer or
listed as missing), resume, evaluate, health, stop."""

import time

import jax
import numpy as np
import pytest

from jaxrl_async.backends.processes import child
from jaxrl_async.backends.processes.buffer_service import BufferService, RemoteBufferClient
from jaxrl_async.backends.processes.rollout_process import RolloutProcess
from jaxrl_async.backends.rollout_server import RolloutServer, first_start
from jaxrl_async.buffer.client import LocalBufferClient
from jaxrl_async.config import RunConfig
from jaxrl_async.model import init_model, split_model
from jaxrl_async.run import build as build_lib
from jaxrl_async.run.build import buffer_for as make_buffer
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
from jaxrl_async.tasks.reverse import DigitReverseTask

TIMEOUT_S = 300.0
GROUP_SIZE = 4


def wait_until(condition, what: str, timeout: float = TIMEOUT_S) -> None:
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


@pytest.fixture(params=["in_process", "process"])
def setup(request):
  config = RunConfig(task=DigitReverseTask(0, max_len=8), group_size=GROUP_SIZE,
                     mini_batch_size=2, max_concurrent_decodes=8, eval_size=8,
                     mode="async_stale", staleness_threshold=1.0, backend="processes")
  spec = build_lib.model_spec(config)
  model_config, abstract = spec.model_config, spec.abstract_params
  _, params = split_model(init_model(model_config, seed=0))
  channel = SharedMemoryWeightChannel.create(abstract)
  channel.publish(0, jax.tree.map(np.asarray, params))
  buffer = make_buffer(config)
  service = BufferService(buffer).start()
  made = {}
  if request.param == "in_process":
    reader = SharedMemoryWeightChannel.attach(channel.name, abstract)
    server = RolloutServer(config, server_index=0, num_servers=1,
                           buffer=LocalBufferClient(buffer), channel=reader)
    made["close"] = reader.close
  else:
    spec = {"config": config, "server_index": 0, "num_servers": 1,
            "buffer": RemoteBufferClient(service.address, service.authkey, "server"),
            "channel": {"kind": "shm", "location": channel.name}}
    server = RolloutProcess(spec, cores=None, name="rollout-under-test")
    made["close"] = lambda: child.reap(server.process)
  yield server, buffer
  try:
    server.stop(60.0)
  finally:
    made["close"]()
    buffer.close()
    service.stop()
    channel.close()


def test_the_rollout_control_contract(setup):
  server, buffer = setup
  server.start(30.0)
  wait_until(lambda: buffer.counts["put"] >= GROUP_SIZE, "the first samples")
  server.pause(60.0)
  put = buffer.counts["put"]
  health = server.health(30.0)
  assert health["alive"] and health["error"] is None and health["version"] == 0
  snapshot = server.snapshot(30.0)
  time.sleep(0.3)
  assert buffer.counts["put"] == put, "samples moved while paused"
  # Every sample the server started is in the buffer or listed as missing in the snapshot.
  missing = sum(len(entry["missing"]) for entry in snapshot["rollout"]["inflight"])
  started = health["counts"]["groups_started"] * GROUP_SIZE
  drawn = sum(len(e["missing"]) for e in snapshot["rollout"]["inflight"]
              if e["group_id"] >= health["counts"]["groups_started"])
  assert started + drawn == put + missing
  assert snapshot["prompts"]["next_index"] >= health["counts"]["groups_started"]
  server.resume(30.0)
  metrics = server.evaluate(120.0)
  assert 0.0 <= metrics["eval/accuracy"] <= 1.0
  final = server.stop(60.0)
  assert final["alive"] is False
  assert final["counts"]["groups_started"] >= health["counts"]["groups_started"]


def test_a_first_start_drops_held_admissions_and_records_where_the_shard_began():
  snapshot = {"rollout": {"next_group_id": 9, "inflight": [
      {"group_id": 5, "missing": [0, 1], "admitted": True}, {"group_id": 7, "missing": [3]}]},
              "prompts": b"shard"}
  restore, initial = first_start(snapshot, index=1)
  assert restore["rollout"]["inflight"] == [{"group_id": 5, "missing": [0, 1]},
                                            {"group_id": 7, "missing": [3]}]
  assert initial == {"prompts": b"shard", "next_group_id": 9}
  assert snapshot["rollout"]["inflight"][0]["admitted"]  # the caller's snapshot is untouched
  fresh, initial = first_start(None, index=3)  # server 3 of a fresh run starts at group id 3
  assert fresh == {"rollout": {"inflight": []}} and initial == {"prompts": None,
                                                                 "next_group_id": 3}

