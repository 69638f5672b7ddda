"""A gRPC server speaking JetStream's protocol (`jetstream_proto.Orchestrator`) over our engine.

    server = PolicyServer(policy, host="127.0.0.1", port=0).start()
    ... OrchestratorStub(grpc.insecure_channel(server.address)).Decode(request) ...
    server.stop()

`Decode` streams one `DecodeResponse` per engine step in which the request's samples drew tokens
(each `StreamContent.samples[i]` holds sample i's new token ids and their text); a handler that
fell behind joins the steps queued for it into one message (`merge_chunks`, on by default). A
request that cannot be served as asked (no prompt, an empty prompt, one longer than the engine's
prefill limit or the cache, token ids outside the vocabulary, text the tokenizer cannot encode,
text for a policy without a tokenizer, a bad `max_tokens` or `num_samples`, fields this protocol
does not define) gets INVALID_ARGUMENT with a message naming the field and the allowed values.
The server binds to loopback unless told otherwise.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import queue
import time
from typing import Any

import grpc
import numpy as np
from google.protobuf import unknown_fields

from jaxrl_async.rollout.engine import Engine
from jaxrl_async.serve import jetstream_pb2 as pb
from jaxrl_async.serve import jetstream_pb2_grpc as pb_grpc
from jaxrl_async.serve.driver import CANCELLED, DONE, DecodeDriver, DriverStopped, StreamingBatcher

DEFAULT_HOST = "127.0.0.1"


@dataclasses.dataclass
class Policy:
  """What the server needs: the model, its params and the tokenizer (None: tokens only)."""

  graphdef: Any
  params: Any
  model_config: Any
  tokenizer: Any
  eos_id: int
  max_prefill_length: int
  max_response_len: int
  version: int = 0
  description: str = ""
  stop_ids: tuple = ()  # ids besides eos_id that end a response (a tokenizer's stop_ids)
  no_tokenizer_reason: str = ""  # tokenizer None: why, told to a client that sends text


class BadRequest(ValueError):
  """A request the server rejects with INVALID_ARGUMENT."""


def _unknown_field_numbers(message) -> list[int]:
  numbers = [field.field_number for field in unknown_fields.UnknownFieldSet(message)]
  for _, value in message.ListFields():
    if hasattr(value, "ListFields"):
      numbers += _unknown_field_numbers(value)
  return numbers


def check_request(request: pb.DecodeRequest, *, tokenizer, vocab_size: int,
                  max_prefill_length: int, cache_length: int, max_response_len: int,
                  max_samples: int, no_tokenizer_reason: str = "") -> tuple[np.ndarray, int, int]:
  """-> (prompt tokens, num_samples, max_tokens), or BadRequest naming the field.
  no_tokenizer_reason: why `tokenizer` is None (in the message refusing a text prompt)."""
  unknown = _unknown_field_numbers(request)
  if unknown:
    raise BadRequest(f"DecodeRequest has fields this server does not define (field numbers "
                     f"{sorted(set(unknown))}); known: max_tokens=4, text_content=5, "
                     "token_content=6, metadata=7, num_samples=8")
  content = request.WhichOneof("content")
  if content is None:
    raise BadRequest("DecodeRequest needs a prompt: set text_content or token_content")
  if content == "text_content":
    if tokenizer is None:
      reason = no_tokenizer_reason or "this server has no tokenizer"
      raise BadRequest(f"text_content cannot be served: {reason}, so send the prompt as token "
                       "ids (token_content.token_ids)")
    if not request.text_content.text:
      raise BadRequest("text_content.text is empty: the prompt needs at least one character")
    try:
      add_bos = getattr(tokenizer, "bos_id", None) is not None
      tokens = np.asarray(tokenizer.encode(request.text_content.text, add_bos=add_bos),
                          np.int32)
    except ValueError as error:
      raise BadRequest(f"text_content.text: {error}") from None
  else:
    tokens = np.asarray(request.token_content.token_ids, np.int32)
    if not len(tokens):
      raise BadRequest("token_content.token_ids is empty: the prompt needs at least one token")
    bad = tokens[(tokens < 0) | (tokens >= vocab_size)]
    if len(bad):
      raise BadRequest(f"token_content.token_ids has ids outside [0, {vocab_size}): "
                       f"{sorted(set(bad.tolist()))[:8]}")
  if request.max_tokens < 0 or request.max_tokens > max_response_len:
    raise BadRequest(f"max_tokens must be in [0, {max_response_len}] (0: the server's "
                     f"maximum {max_response_len}), got {request.max_tokens}")
  max_tokens = request.max_tokens or max_response_len
  if len(tokens) > max_prefill_length:
    raise BadRequest(f"prompt of {len(tokens)} tokens is longer than the server's "
                     f"max_prefill_length={max_prefill_length}")
  if len(tokens) + max_response_len > cache_length:
    raise BadRequest(
        f"prompt of {len(tokens)} tokens + max_response_len={max_response_len} exceeds the "
        f"cache length {cache_length}: prompts of at most {cache_length - max_response_len} "
        "tokens fit")
  if not 0 <= request.num_samples <= max_samples:
    raise BadRequest(f"num_samples must be in [0, {max_samples}] (0: one sample), got "
                     f"{request.num_samples}")
  return tokens, max(request.num_samples, 1), max_tokens


def _merge_queued(chunk: list, chunks: queue.Queue):
  """Join the chunks already queued behind `chunk` into one message (a handler that fell behind
  the driver sends one message, not one per engine step). Returns (chunk, DONE or an error that
  ended the queue, else None)."""
  chunk = [list(tokens) for tokens in chunk]
  while True:
    try:
      item = chunks.get_nowait()
    except queue.Empty:
      return chunk, None
    if item is DONE or item is CANCELLED or isinstance(item, BaseException):
      return chunk, item
    for member, tokens in enumerate(item):
      chunk[member].extend(tokens)


class OrchestratorServicer(pb_grpc.OrchestratorServicer):

  def __init__(self, driver: DecodeDriver, engine: Engine, tokenizer, *,
               stream_timeout_s: float = 600.0, merge_chunks: bool = True,
               no_tokenizer_reason: str = ""):
    self.driver = driver
    self.engine = engine
    self.tokenizer = tokenizer
    self.no_tokenizer_reason = no_tokenizer_reason
    self.stream_timeout_s = stream_timeout_s
    self.merge_chunks = merge_chunks

  def _text(self, tokens) -> str:
    if self.tokenizer is None or not tokens:
      return ""
    return self.tokenizer.decode(tokens, skip_special=True)

  def Decode(self, request, context):
    try:
      tokens, num_samples, max_tokens = check_request(
          request, tokenizer=self.tokenizer, vocab_size=self.engine.config.vocab_size,
          max_prefill_length=self.engine.max_prefill_length,
          cache_length=self.engine.cache_length, max_response_len=self.driver.max_response_len,
          max_samples=self.engine.max_concurrent_decodes,
          no_tokenizer_reason=self.no_tokenizer_reason)
    except BadRequest as error:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    try:
      stream = self.driver.submit(tokens, num_samples=num_samples, max_tokens=max_tokens)
    except DriverStopped as error:
      context.abort(grpc.StatusCode.UNAVAILABLE, str(error))
    context.add_callback(stream.cancel)
    deadline = time.monotonic() + self.stream_timeout_s
    while True:
      try:
        item = stream.chunks.get(timeout=max(deadline - time.monotonic(), 0.0))
      except queue.Empty:
        stream.cancel()
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      f"no result within the server's stream_timeout_s={self.stream_timeout_s}")
      if item is DONE or item is CANCELLED:
        return
      if isinstance(item, BaseException):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"decode driver stopped: {item!r}")
      item, last = _merge_queued(item, stream.chunks) if self.merge_chunks else (item, None)
      samples = [pb.DecodeResponse.StreamContent.Sample(text=self._text(chunk), token_ids=chunk)
                 for chunk in item]
      yield pb.DecodeResponse(stream_content=pb.DecodeResponse.StreamContent(samples=samples))
      if last is DONE or last is CANCELLED:
        return
      if isinstance(last, BaseException):
        context.abort(grpc.StatusCode.UNAVAILABLE, f"decode driver stopped: {last!r}")

  def HealthCheck(self, request, context):
    return pb.HealthCheckResponse(is_live=self.driver.alive)


class PolicyServer:
  """Engine + driver thread + gRPC server, started and stopped together."""

  def __init__(self, policy: Policy, *, host: str = DEFAULT_HOST, port: int = 0,
               max_concurrent_decodes: int = 32, sampling=None, seed: int = 0,
               steps_per_call: int = 1, max_streams: int = 256,
               stream_timeout_s: float = 600.0, merge_chunks: bool = True):
    from jaxrl_async.rollout.sampling import SamplingConfig
    self.policy = policy
    self.engine = Engine(policy.graphdef, policy.model_config,
                         max_concurrent_decodes=max_concurrent_decodes,
                         max_prefill_length=policy.max_prefill_length,
                         sampling=sampling or SamplingConfig(), steps_per_call=steps_per_call)
    batcher = StreamingBatcher(self.engine, eos_id=policy.eos_id,
                               max_response_len=policy.max_response_len,
                               stop_ids=tuple(policy.stop_ids))
    self.driver = DecodeDriver(batcher, policy.params, seed=seed, version=policy.version)
    self._executor = concurrent.futures.ThreadPoolExecutor(
        max_workers=max_streams, thread_name_prefix="serve-grpc")
    self._server = grpc.server(self._executor, maximum_concurrent_rpcs=max_streams)
    pb_grpc.add_OrchestratorServicer_to_server(
        OrchestratorServicer(self.driver, self.engine, policy.tokenizer,
                             stream_timeout_s=stream_timeout_s, merge_chunks=merge_chunks,
                             no_tokenizer_reason=policy.no_tokenizer_reason),
        self._server)
    self.host = host
    self.port = self._server.add_insecure_port(f"{host}:{port}")
    if not self.port:
      raise OSError(f"could not bind the server to {host}:{port}")

  @property
  def address(self) -> str:
    return f"{self.host}:{self.port}"

  def start(self) -> PolicyServer:
    self.driver.start()
    self._server.start()
    return self

  def wait(self, timeout_s: float | None = None) -> bool:
    """Block until the server stops (or `timeout_s`); True when it stopped."""
    return self._server.wait_for_termination(timeout=timeout_s)

  def stop(self, grace_s: float = 5.0) -> None:
    self._server.stop(grace_s).wait(timeout=grace_s + 5.0)
    self.driver.stop()
    self._executor.shutdown(wait=True, cancel_futures=True)

  def __enter__(self) -> PolicyServer:
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
