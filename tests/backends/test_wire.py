"""The columnar sample encoding: every field of every sample round-trips exactly; anything else
is refused with a clear error."""

import os
import pickle
import socket
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_async.backends.processes import wire
from jaxrl_async.types import STAGES, Sample

INT32 = st.integers(-2**31, 2**31 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


@st.composite
def samples(draw):
  length = draw(st.integers(0, 12))
  tokens = st.lists(INT32, min_size=length, max_size=length)
  return Sample(
      prompt_id=draw(st.integers(-2**70, 2**70)), group_id=draw(st.integers(0, 2**63)),
      group_size=draw(st.integers(1, 64)),
      prompt_tokens=np.array(draw(st.lists(INT32, max_size=12)), np.int32),
      response_tokens=np.array(draw(tokens), np.int32),
      behaviour_logprobs=np.array(draw(st.lists(FLOAT32, min_size=length, max_size=length)),
                                  np.float32),
      token_versions=np.array(draw(tokens), np.int32),
      finish_reason=draw(st.sampled_from(["eos", "length", "aborted"])),
      reward=draw(st.floats(allow_nan=True)), reward_status=draw(st.text(max_size=8)),
      retries=draw(st.integers(0, 9)), interruptions=draw(st.integers(0, 9)),
      timestamps=draw(st.dictionaries(st.sampled_from(STAGES), st.floats(allow_nan=False))),
      meta=draw(st.dictionaries(st.text(max_size=8), JSON, max_size=4)))


def assert_identical(got: Sample, want: Sample) -> None:
  for name in ("prompt_tokens", "response_tokens", "behaviour_logprobs", "token_versions"):
    a, b = getattr(got, name), getattr(want, name)
    assert a.dtype == b.dtype and a.shape == b.shape, name
    assert a.tobytes() == b.tobytes(), name  # bit for bit: NaN payloads, -0.0
  for name in ("prompt_id", "group_id", "group_size", "finish_reason", "reward_status",
               "retries", "interruptions", "timestamps", "meta"):
    assert type(getattr(got, name)) is type(getattr(want, name)), name
    assert pickle.dumps(getattr(got, name)) == pickle.dumps(getattr(want, name)), name
  assert np.float64(got.reward).tobytes() == np.float64(want.reward).tobytes()


@settings(max_examples=200, deadline=None)
@given(st.lists(samples(), max_size=6))
def test_every_field_round_trips_exactly(batch):
  decoded = wire.decode_samples(wire.encode_samples(batch))
  assert len(decoded) == len(batch)
  for got, want in zip(decoded, batch, strict=True):
    assert_identical(got, want)


def test_decoded_arrays_are_writable_and_independent():
  batch = [Sample(prompt_id=i, group_id=0, group_size=2, prompt_tokens=[1, 2],
                  response_tokens=[3, 4], behaviour_logprobs=[-0.5, -1.0],
                  token_versions=[0, 0]) for i in range(2)]
  first, second = wire.decode_samples(wire.encode_samples(batch))
  first.token_versions.fill(7)
  assert second.token_versions.tolist() == [0, 0]
  assert batch[0].token_versions.tolist() == [0, 0]


def test_samples_it_cannot_carry_exactly_are_refused():
  sample = Sample(prompt_id=0, group_id=0, group_size=1, prompt_tokens=[1])
  sample.behaviour_logprobs = np.zeros((0,), np.float64)  # changed after construction
  assert not wire.columnar(sample)
  with pytest.raises(ValueError, match="sample 0"):
    wire.encode_samples([sample])
  sample.behaviour_logprobs = np.zeros((0,), np.float32)
  sample.extra = 1
  assert not wire.columnar(sample)


@pytest.mark.parametrize("blob", [b"", b"JXS1", b"XXXX\x00\x00\x00\x00", b"JXS1\xff\x00\x00\x00",
                                  b"JXS1\x02\x00\x00\x00ab"])
def test_bad_blobs_fail_clearly(blob):
  with pytest.raises(ValueError, match="decode_samples"):
    wire.decode_samples(blob)


def test_a_truncated_blob_fails_clearly():
  blob = wire.encode_samples([Sample(prompt_id=0, group_id=0, group_size=1,
                                     prompt_tokens=[1, 2, 3])])
  with pytest.raises(ValueError, match="bytes of arrays"):
    wire.decode_samples(blob[:-4])


def _returns_within(fn, seconds: float):
  """Runs `fn` in a thread; (finished, what it raised) after at most `seconds`."""
  raised = []

  def target():
    try:
      fn()
    except Exception as error:  # reported to the test
      raised.append(error)

  thread = threading.Thread(target=target, daemon=True)
  thread.start()
  thread.join(seconds)
  return not thread.is_alive(), raised


def test_a_server_whose_accept_thread_is_held_still_stops_within_its_timeout():
  server = wire.Server(lambda conn: (lambda method, args, kwargs: None), b"key", name="held")
  server.start()
  silent = socket.create_connection(server.address)  # never answers the challenge
  try:
    time.sleep(0.2)  # the accept thread now waits for this peer's answer
    finished, raised = _returns_within(lambda: server.stop(timeout=1.0), 20.0)
    assert finished, "stop() blocked (its wake-up connect waited for a handshake)"
    assert raised and isinstance(raised[0], TimeoutError), raised  # named, not hung
  finally:
    silent.close()


def test_connect_to_a_server_that_never_answers_the_handshake_times_out():
  with socket.create_server(("127.0.0.1", 0)) as listener:  # the backlog accepts; no one answers
    began = time.monotonic()
    with pytest.raises(wire.ServiceTimeout, match="no handshake within"):
      wire.connect(listener.getsockname(), b"key", 0.5)
    assert time.monotonic() - began < 10.0


def test_a_connection_made_with_a_short_timeout_serves_slow_calls():
  def handler(method, args, kwargs):
    time.sleep(args[0])
    return method

  server = wire.Server(lambda conn: handler, b"key")
  server.start()
  try:
    conn = wire.connect(server.address, b"key", 0.3)
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:  # the handshake's bound is gone
      assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16) == bytes(16)
    assert wire.call(conn, "slow", (1.0,), {}, 5.0) == "slow"
    conn.close()
  finally:
    server.stop(timeout=5.0)


def test_many_clients_connecting_at_once_are_all_served():
  """The accept thread makes each connection in turn (the handshake, then the handler's
  opening, here 0.2 s as a client's hello may take); the others wait in the listen backlog.
  With a backlog of one, the kernel dropped those past it, and their clients waited for a
  handshake that never came (a rollout server's reward callbacks, connecting at once)."""
  def open_handler(conn):
    time.sleep(0.2)
    return lambda method, args, kwargs: method

  server = wire.Server(open_handler, b"key", name="busy-accept")
  server.start()
  answers, errors = [], []

  def client():
    try:
      conn = wire.connect(server.address, b"key", 8.0)
      answers.append(wire.call(conn, "ping", (), {}, 8.0))
      conn.close()
    except Exception as error:  # reported below
      errors.append(error)

  threads = [threading.Thread(target=client, daemon=True) for _ in range(12)]
  try:
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(30.0)
  finally:
    server.stop(timeout=5.0)
  assert not errors, errors
  assert answers == ["ping"] * 12
