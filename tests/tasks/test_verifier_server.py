"""The verifier service's connection handling, on a server run in this process (a thread with
its own event loop, real sockets on 127.0.0.1): malformed requests are answered, garbage and
stalled messages close only their own connection, pipelined requests are answered in turn."""

import json
import socket
import threading
import time

import pytest

from jaxrl_async.tasks.verifier_server import VerifierServer
from jaxrl_async.tasks.verifier_service import (
    HEADER,
    MAX_MESSAGE_BYTES,
    VerifierClient,
    VerifierSettings,
    recv_message,
    send_message,
)

SETTINGS = VerifierSettings(time_scale=1e-3, concurrency=2, timeout_fraction=0.0)
PROMPT, RIGHT = [5, 6, 7], [7, 6, 5, 2]  # digits '0' '1' '2'; reversed, then <eos> (id 2)


@pytest.fixture
def server():
  """A server in a thread, with a short limit for a message to arrive whole."""
  serving = VerifierServer(SETTINGS, message_timeout_s=0.5)
  thread = threading.Thread(target=serving.serve, daemon=True)
  thread.start()
  yield serving
  serving.stopped.set()
  thread.join(timeout=10)
  assert not thread.is_alive()


def connect(server: VerifierServer) -> socket.socket:
  sock = socket.create_connection(server.listener.getsockname()[:2], timeout=5.0)
  return sock


def closed_by_server(sock: socket.socket) -> bool:
  """Whether the server closed `sock` (EOF or reset) without answering."""
  try:
    return sock.recv(1) == b""
  except ConnectionResetError:
    return True


def test_a_malformed_verify_request_is_answered_with_its_error_and_counted(server):
  client = VerifierClient(server.listener.getsockname()[:2], call_timeout_s=5.0)
  with socket.create_connection(server.listener.getsockname()[:2], timeout=5.0) as sock:
    send_message(sock, {"op": "verify", "prompt": PROMPT, "response": RIGHT})  # no id
    missing = recv_message(sock)
    send_message(sock, {"op": "verify", "id": -3, "prompt": PROMPT, "response": RIGHT})
    negative = recv_message(sock)
    send_message(sock, {"op": "verify", "id": 4})  # no prompt: fails at its check
    no_prompt = recv_message(sock)
    send_message(sock, {"op": "nap"})
    unknown = recv_message(sock)
  assert missing["ok"] is False and "KeyError" in missing["error"]
  assert negative["ok"] is False and "must be >= 0" in negative["error"]
  assert no_prompt["ok"] is False and "prompt" in no_prompt["error"]
  assert unknown == {"ok": False, "error": "unknown op 'nap'; allowed: 'verify', 'stats', 'stop'"}
  assert client.verify(9, PROMPT, RIGHT).reward == 1.0
  assert client.verify(10, PROMPT, [7, 5, 6, 2]).reward == 0.0
  stats = client.stats()
  assert (stats["requests"], stats["errors"], stats["completed"]) == (5, 3, 2)
  assert (stats["active"], stats["queued"]) == (0, 0)


@pytest.mark.parametrize("garbage", [
    HEADER.pack(5) + b"nope!",  # not JSON
    HEADER.pack(2) + b"[]",  # JSON, not an object
    HEADER.pack(MAX_MESSAGE_BYTES + 1),  # over the size limit
])
def test_garbage_closes_only_its_own_connection(server, garbage):
  client = VerifierClient(server.listener.getsockname()[:2], call_timeout_s=5.0)
  with connect(server) as bad:
    bad.sendall(garbage)
    assert closed_by_server(bad)
  assert client.verify(1, PROMPT, RIGHT).reward == 1.0


def test_a_message_not_whole_in_time_closes_its_connection_and_nothing_else(server):
  client = VerifierClient(server.listener.getsockname()[:2], call_timeout_s=5.0)
  with connect(server) as stalled:
    body = json.dumps({"op": "stats"}).encode()
    stalled.sendall(HEADER.pack(len(body)) + body[:3])  # begun, never finished
    began = time.monotonic()
    assert client.verify(1, PROMPT, RIGHT).reward == 1.0  # others are served meanwhile
    assert closed_by_server(stalled)
    assert 0.4 < time.monotonic() - began < 5.0  # closed at the server's 0.5 s limit
  with connect(server) as idle:  # a connection with nothing begun is left open
    time.sleep(0.8)
    send_message(idle, {"op": "stats"})
    assert recv_message(idle)["ok"] is True


def test_pipelined_requests_on_one_connection_are_answered_in_turn(server):
  messages = [{"op": "verify", "id": i, "prompt": PROMPT, "response": RIGHT} for i in range(5)]
  wire = b"".join(HEADER.pack(len(b)) + b for b in (json.dumps(m).encode() for m in messages))
  with connect(server) as sock:
    sock.sendall(wire)  # all at once, in one write
    data = b""
    answers = []
    while len(answers) < len(messages):
      chunk = sock.recv(1 << 16)
      assert chunk, "the server closed the connection"
      data += chunk
      while len(data) >= HEADER.size and len(data) >= HEADER.size + HEADER.unpack_from(data)[0]:
        size = HEADER.unpack_from(data)[0]
        answers.append(json.loads(data[HEADER.size:HEADER.size + size]))
        data = data[HEADER.size + size:]
  assert [a["id"] for a in answers] == list(range(5))
  assert all(a["ok"] and a["reward"] == 1.0 for a in answers)
  starts = [a["started_at"] for a in answers]
  finishes = [a["finished_at"] for a in answers]
  assert all(finishes[i] <= starts[i + 1] for i in range(4))  # one at a time on a connection


def test_the_client_refuses_bytes_after_an_answer():
  """An answer followed by more bytes is not this protocol: a clear error, not a desync."""
  listener = socket.create_server(("127.0.0.1", 0))
  replies = threading.Thread(target=lambda: _answer_twice(listener), daemon=True)
  replies.start()
  with socket.create_connection(listener.getsockname()[:2], timeout=5.0) as sock:
    send_message(sock, {"op": "stats"})
    with pytest.raises(ConnectionError, match="bytes after a message"):
      recv_message(sock)
  replies.join(timeout=5)
  listener.close()


def _answer_twice(listener: socket.socket) -> None:
  conn, _ = listener.accept()
  with conn:
    conn.recv(1 << 16)
    body = json.dumps({"ok": True}).encode()
    conn.sendall((HEADER.pack(len(body)) + body) * 2)
    time.sleep(0.5)
