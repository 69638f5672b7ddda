"""Tokens/s of the JetStream-protocol server against the engine alone; one JSON line.

  python benchmarks/serve.py [--requests 32] [--slots 32] [--model tiny|small] [--repeats 3]
                             [--steps_per_call 1] [--out PATH]

The same `--requests` prompts (DigitReverseTask(0).problem(i)), keys and sampling
(temperature 1, random-init weights of `--model`) on both sides; responses stop at <eos> or the
task's max response length (always the latter with `--ignore_eos`), so both sides draw the same
tokens (`tokens_match` checks it). A server handler that falls behind the driver joins the
chunks queued for it into one message.

- engine: one `ContinuousBatcher.run_to_completion` over all the requests in one thread (prefill,
  insert and decode timed; no network, no threads).
- server: a `PolicyServer` on 127.0.0.1 in this process and `--requests` client threads, each
  sending one streamed `Decode` call at once over its own channel; timed from the first send to
  the last stream's end. Also reported: the median time to a request's first streamed chunk.

Both are run once untimed (compilation), then `--repeats` times in turn; medians are reported.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grpc
import jax
import numpy as np

from benchmarks.common import emit_json_line
from jaxrl_async.model import get_config, init_model, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_keys
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.serve import jetstream_pb2 as pb
from jaxrl_async.serve import jetstream_pb2_grpc as pb_grpc
from jaxrl_async.serve.driver import prompt_key
from jaxrl_async.serve.server import Policy, PolicyServer
from jaxrl_async.tasks.reverse import DigitReverseTask
from jaxrl_async.types import Sample

SEED = 0


def engine_run(batcher: ContinuousBatcher, prompts) -> tuple[float, list[list[int]]]:
  requests = []
  for index, prompt in enumerate(prompts):
    key = sample_keys(SEED, prompt_key(prompt), [0])[0]
    requests.append(GenerationRequest(Sample(prompt_id=index, group_id=index, group_size=1,
                                             prompt_tokens=prompt), key))
  start = time.perf_counter()
  done = batcher.run_to_completion(requests)
  elapsed = time.perf_counter() - start
  out = [None] * len(prompts)
  for sample in done:
    out[sample.prompt_id] = sample.response_tokens.tolist()
  return elapsed, out


def server_run(address: str, prompts, timeout_s: float = 600.0):
  """(seconds, tokens per request, seconds to each request's first chunk)."""
  channels = [grpc.insecure_channel(address) for _ in prompts]
  stubs = [pb_grpc.OrchestratorStub(channel) for channel in channels]
  for stub in stubs:  # connect before timing
    stub.HealthCheck(pb.HealthCheckRequest(), timeout=60)

  def call(index):
    request = pb.DecodeRequest(token_content=pb.DecodeRequest.TokenContent(
        token_ids=prompts[index].tolist()))
    tokens, first = [], None
    sent = time.perf_counter()
    for response in stubs[index].Decode(request, timeout=timeout_s):
      if first is None:
        first = time.perf_counter() - sent
      tokens.extend(response.stream_content.samples[0].token_ids)
    return tokens, first

  try:
    with concurrent.futures.ThreadPoolExecutor(len(prompts), thread_name_prefix="bench") as pool:
      start = time.perf_counter()
      results = list(pool.map(call, range(len(prompts)), timeout=timeout_s))
      elapsed = time.perf_counter() - start
  finally:
    for channel in channels:
      channel.close()
  return elapsed, [r[0] for r in results], [r[1] for r in results]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=32)
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
  parser.add_argument("--steps_per_call", type=int, default=1)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--ignore_eos", action="store_true",
                      help="every response runs to the task's max response length")
  parser.add_argument("--out", default=None, help="also write the JSON line to this file")
  args = parser.parse_args(argv)
  if min(args.requests, args.slots, args.repeats, args.steps_per_call) < 1:
    raise ValueError("--requests, --slots, --repeats and --steps_per_call must be >= 1")
  load_start = os.getloadavg()
  task = DigitReverseTask(0)
  model_config = get_config(args.model, vocab_size=task.tokenizer.vocab_size,
                            max_seq_len=task.max_sequence_len)
  graphdef, params = split_model(init_model(model_config, seed=0))
  eos_id = -1 if args.ignore_eos else task.tokenizer.eos_id
  policy = Policy(graphdef=graphdef, params=params, model_config=model_config,
                  tokenizer=task.tokenizer, eos_id=eos_id,
                  max_prefill_length=task.max_prompt_len, max_response_len=task.max_response_len)
  sampling = SamplingConfig(temperature=1.0)
  prompts = [np.asarray(task.problem(i).prompt_tokens, np.int32) for i in range(args.requests)]
  engine = Engine(graphdef, model_config, max_concurrent_decodes=args.slots,
                  max_prefill_length=policy.max_prefill_length, sampling=sampling,
                  steps_per_call=args.steps_per_call)
  batcher = ContinuousBatcher(engine, eos_id=policy.eos_id,
                              max_response_len=policy.max_response_len)
  batcher.set_params(params, 0)

  with PolicyServer(policy, port=0, max_concurrent_decodes=args.slots, sampling=sampling,
                    seed=SEED, steps_per_call=args.steps_per_call,
                    max_streams=max(64, 2 * args.requests)) as server:
    _, engine_tokens = engine_run(batcher, prompts)  # compile both sides
    _, served_tokens, _ = server_run(server.address, prompts)
    engine_s, server_s, first_chunk_s = [], [], []
    for _ in range(args.repeats):
      engine_s.append(engine_run(batcher, prompts)[0])
      elapsed, served_tokens, firsts = server_run(server.address, prompts)
      server_s.append(elapsed)
      first_chunk_s += firsts
  total = sum(len(tokens) for tokens in engine_tokens)
  engine_rate = total / statistics.median(engine_s)
  server_rate = total / statistics.median(server_s)
  emit_json_line({
      "benchmark": "serve",
      "model": args.model,
      "requests": args.requests,
      "slots": args.slots,
      "steps_per_call": args.steps_per_call,
      "ignore_eos": args.ignore_eos,
      "tokens": total,
      "engine_tokens_per_s": round(engine_rate, 1),
      "server_tokens_per_s": round(server_rate, 1),
      "server_over_engine": round(server_rate / engine_rate, 3),
      "server_first_chunk_s_median": round(statistics.median(first_chunk_s), 4),
      "tokens_match": served_tokens == engine_tokens,
      "repeats": args.repeats,
      "jax_version": jax.__version__,
      "backend": jax.default_backend(),
      "cpu_count": os.cpu_count(),
      "load_avg_1m_start": round(load_start[0], 2),
      "load_avg_1m_end": round(os.getloadavg()[0], 2),
      "date": datetime.datetime.now().strftime("%Y-%m-%d"),
  }, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
