"""One weight swap's re-prefill of 56 in-flight samples (20-token prompts + 24 response tokens,
tiny model): one prefill and insert call each (the code before 2026-12-06) against
`Engine.prefill_insert` (one call per prefill bucket). Run as
`taskset -c 0 python benchmarks/results/reprefill-swap-20261206.py`; prints one JSON line."""

import json
import time

import jax
import numpy as np

from jaxrl_async.model import get_config, init_model, split_model
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_key
from jaxrl_async.types import Sample

CONFIG = get_config("tiny", max_seq_len=128)


def main() -> None:
  graphdef, params = split_model(init_model(CONFIG, seed=0))
  engine = Engine(graphdef, CONFIG, max_concurrent_decodes=64, max_prefill_length=128,
                  steps_per_call=4)
  rng = np.random.default_rng(0)
  batcher = ContinuousBatcher(engine, eos_id=-1, max_response_len=100)
  batcher.set_params(params, 0)
  for group in range(7):
    prompt = rng.integers(1, 10, size=20).astype(np.int32)
    batcher.submit([GenerationRequest(Sample(prompt_id=group, group_id=group, group_size=8,
                                             prompt_tokens=prompt), sample_key(0, group, m))
                    for m in range(8)])
  for _ in range(6):
    batcher.step()

  def batched():
    batcher.set_params(params, 1, partial_strategy="reprefill")
    jax.block_until_ready(batcher._state)

  def one_by_one():
    for i, slot in enumerate(batcher._slots):
      if slot is None:
        continue
      sequence = np.concatenate([slot.request.sample.prompt_tokens,
                                 np.asarray(slot.tokens, np.int32)])
      prefix = engine.prefill(params=params, padded_tokens=engine.pad_to_bucket(sequence),
                              true_length=len(sequence))
      batcher._state = engine.insert(prefix, batcher._state, i, rng=slot.request.key,
                                     num_generated=len(slot.tokens))
    jax.block_until_ready(batcher._state)

  out = {"in_flight": batcher.num_active,
         "tokens_each": 20 + len(batcher._slots[0].tokens), "rounds": []}
  for swap in (one_by_one, batched):
    swap()  # compile
  for _ in range(3):
    row = {}
    for swap in (one_by_one, batched):
      start = time.perf_counter()
      for _ in range(20):
        swap()
      row[swap.__name__ + "_ms"] = (time.perf_counter() - start) / 20 * 1e3
    out["rounds"].append(row)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
