"""A rollout server that the buffer refuses does not ask again at every decode step: only under
a new version (a new admission window) or after its poll interval (a drop may have refunded a
slot). Each ask is a round trip to the learner's process."""

import contextlib
import time

import jax
import numpy as np

from jaxrl_async import faults, ledger
from jaxrl_async.backends import base as fleet
from jaxrl_async.backends.rollout_server import RolloutServer
from jaxrl_async.buffer.client import LocalBufferClient
from jaxrl_async.config import RunConfig
from jaxrl_async.model import init_model, split_model
from jaxrl_async.run import build as build_lib
from jaxrl_async.run.build import buffer_for as make_buffer
from jaxrl_async.sync.shm_channel import SharedMemoryWeightChannel
from jaxrl_async.tasks.reverse import DigitReverseTask


class CountingClient(LocalBufferClient):
  """The real buffer behind the real client, with every admission call recorded."""

  def __init__(self, buffer):
    super().__init__(buffer)
    self.calls: list[tuple[float, int, int, int]] = []  # (when, version, asked, granted)
    self.published: list[int] = []  # publish_version calls

  def acquire_group_slots(self, max_count, timeout, *, starts=None, holding_version=None):
    granted = super().acquire_group_slots(max_count, timeout, starts=starts,
                                          holding_version=holding_version)
    self.calls.append((time.monotonic(), holding_version, max_count, granted))
    return granted

  def publish_version(self, version):
    super().publish_version(version)
    self.published.append(version)


CONFIG = RunConfig(task=DigitReverseTask(0, max_len=8), group_size=4, mini_batch_size=2,
                   max_concurrent_decodes=8, eval_size=8, mode="async_stale",
                   staleness_threshold=1.0, backend="processes")


@contextlib.contextmanager
def server_on_a_real_buffer():
  """(server, buffer, client, the learner's end of the weight channel): a rollout server in
  this process on the run's buffer, with version 0 published; nobody consumes."""
  spec = build_lib.model_spec(CONFIG)
  model_config, abstract = spec.model_config, spec.abstract_params
  _, params = split_model(init_model(model_config, seed=0))
  channel = SharedMemoryWeightChannel.create(abstract)
  channel.publish(0, jax.tree.map(np.asarray, params))
  buffer = make_buffer(CONFIG)
  client = CountingClient(buffer)
  reader = SharedMemoryWeightChannel.attach(channel.name, abstract)
  server = RolloutServer(CONFIG, server_index=0, num_servers=1, buffer=client, channel=reader)
  try:
    yield server, buffer, client, channel
  finally:
    server.stop(60.0)
    reader.close()
    buffer.close()
    channel.close()


def test_a_refused_server_waits_for_a_new_window_or_its_poll_interval():
  with server_on_a_real_buffer() as (server, buffer, client, _):
    server.start(30.0)
    # Nobody consumes: the window (floor(2 * 2) = 4 groups) is spent after the first asks,
    # while the admitted groups still decode step by step.
    deadline = time.monotonic() + 120.0
    while sum(1 for c in client.calls if c[3] < c[2]) < 5:
      assert time.monotonic() < deadline, f"too few refusals: {client.calls}"
      time.sleep(0.05)
    poll_s = server.rollouter.poll_s
    refusals = 0
    for (when, version, asked, granted), (later, next_version, _, _) in zip(
        client.calls, client.calls[1:]):
      if granted < asked and next_version == version:
        refusals += 1
        assert later - when >= 0.9 * poll_s, (
            f"asked again {1e3 * (later - when):.2f} ms after a refusal at version {version} "
            f"(poll interval {1e3 * poll_s:.0f} ms)")
    assert refusals >= 4
    assert buffer.counts["put"] > 0


def test_a_new_version_reaches_the_buffer_with_the_next_admission_ask():
  """After a weight swap the server's first ask names the new version and opens its window in
  that call: no separate publish_version round trip while it has room to start groups."""
  with server_on_a_real_buffer() as (server, buffer, client, channel):
    server.start(30.0)
    spent = 4 * CONFIG.group_size  # the window's 4 groups, all put: the slots are empty
    deadline = time.monotonic() + 120.0
    while not any(c[3] < c[2] for c in client.calls) or buffer.counts["put"] < spent:
      assert time.monotonic() < deadline, f"the window was never spent: {client.calls}"
      time.sleep(0.05)
    _, params = channel.fetch()
    channel.publish(1, jax.tree.map(np.asarray, params))
    while buffer.rollout_version < 1 or not any(c[1] == 1 for c in client.calls):
      assert time.monotonic() < deadline, "version 1 never reached the buffer"
      time.sleep(0.01)
    assert client.published == [0]  # the first weights only: version 1 went with an ask


def test_a_stopped_server_accounts_for_every_sample_it_drew():
  """Stopped while the buffer refuses it (prompts drawn and not admitted, groups in the slots):
  every sample of every group it drew is in the buffer or in the drop log of its last health
  answer, exactly once."""
  with server_on_a_real_buffer() as (server, buffer, client, _):
    server.start(30.0)
    deadline = time.monotonic() + 120.0
    while not any(c[3] < c[2] for c in client.calls) or buffer.counts["put"] == 0:
      assert time.monotonic() < deadline, f"the window was never spent: {client.calls}"
      time.sleep(0.05)
    health = server.stop(60.0)
    buffer.discard_queued("shutdown")
    events = [{"event": "dropped", "reason": reason, "samples": uids}
              for reason, uids in buffer.take_drop_log() + [tuple(d) for d in health["drops"]]]
  produced = fleet.produced_groups([health["next_group_id"]])
  result = ledger.audit(events, groups=produced, group_size=CONFIG.group_size)
  assert result["missing"] == [] and result["duplicates"] == [] and result["unknown"] == []
  assert health["counts"]["unstarted_shutdown"] > 0  # drawn, never admitted
  assert result["dropped"]["shutdown"] == result["produced"] > 0


def test_a_server_stopped_while_a_batch_is_scored_accounts_for_the_batch():
  """Stopped while its first batch is in the reward pool (the first reward call takes 3 s): the
  stop waits for the batch, so its samples are in the buffer or in the last health answer's
  drops when the stop returns, not put into the buffer after the run has closed its books."""
  faults.configure("reward.call=delay:3@1")
  try:
    with server_on_a_real_buffer() as (server, buffer, _, _):
      server.start(30.0)
      deadline = time.monotonic() + 120.0
      while server.rollouter.rewarding == 0:
        assert time.monotonic() < deadline, "no batch reached the reward pool"
        time.sleep(0.01)
      health = server.stop(60.0)
      buffer.discard_queued("shutdown")
      events = [{"event": "dropped", "reason": reason, "samples": uids}
                for reason, uids in buffer.take_drop_log() + [tuple(d) for d in health["drops"]]]
  finally:
    faults.configure(None)
  result = ledger.audit(events, groups=fleet.produced_groups([health["next_group_id"]]),
                        group_size=CONFIG.group_size)
  assert result["missing"] == [] and result["duplicates"] == [] and result["unknown"] == []
  assert result["dropped"]["shutdown"] == result["produced"] > 0
  assert health["rewarding"] == 0
