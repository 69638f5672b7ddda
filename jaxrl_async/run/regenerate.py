"""Regenerates a run's recorded samples in one process, segment by segment, version by version.

A recorded sample's per-token versions split its response into segments, one per version that
drew it (`schedule_record.version_segments`). Given the params of version v, `regenerate` draws
every segment of version v, on the run's own engine (same slots, steps per call and sampling),
from the sample's recorded key, as the rollout did:

- a first segment from a prefill of the prompt;
- a later one, with 'reprefill', from a prefill of prompt + response so far under v (what the
  rollout does at a weight swap); with 'keep_kv', on the sample's own decode-state row as the
  previous version left it (kept between versions here), so its cache holds the old versions'
  keys and values as the rollout's did.

Each token is drawn with fold_in(key, its index) and a slot's work never depends on the other
slots (`rollout/engine.py`), so the tokens and logprobs come out as the run drew them when
the computation is the same: same params, same program, same platform. Only the current
version's params are needed at a time.
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import numpy as np

from jaxrl_async.rollout.engine import Engine
from jaxrl_async.run.schedule_record import version_segments
from jaxrl_async.types import Sample


@dataclasses.dataclass
class Trace:
  """One recorded sample being regenerated: its plan (segments) and what was drawn so far."""
  recorded: Sample
  key: np.ndarray  # uint32 [2]
  segments: list  # [(version, number of tokens)]
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)
  done_segments: int = 0
  row: object = None  # 'keep_kv': the decode-state row between versions

  @classmethod
  def of(cls, sample: Sample, key) -> Trace:
    versions, lengths = version_segments(sample.token_versions)
    return cls(recorded=sample, key=np.asarray(key, np.uint32),
               segments=list(zip(versions.tolist(), lengths.tolist(), strict=True)))

  @property
  def next_version(self) -> int | None:
    return (self.segments[self.done_segments][0] if self.done_segments < len(self.segments)
            else None)

  @property
  def complete(self) -> bool:
    return self.done_segments == len(self.segments)

  def sample(self) -> Sample:
    """The regenerated sample: the recorded one's identity and provenance, the new tokens;
    its reward is scored again by the caller."""
    recorded = self.recorded
    return Sample(prompt_id=recorded.prompt_id, group_id=recorded.group_id,
                  group_size=recorded.group_size, prompt_tokens=recorded.prompt_tokens,
                  response_tokens=self.tokens, behaviour_logprobs=self.logprobs,
                  token_versions=self.versions, finish_reason=recorded.finish_reason,
                  interruptions=recorded.interruptions, meta=dict(recorded.meta))


@jax.jit
def _take_row(state, slot):
  return jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, slot, keepdims=False), state)


@jax.jit
def _put_row(state, row, slot):
  return jax.tree.map(lambda x, r: jax.lax.dynamic_update_index_in_dim(x, r, slot, 0),
                      state, row)


def regenerate(engine: Engine, params, version: int, traces, *, partial_strategy: str) -> int:
  """Draws every `traces` segment of `version` with `params` (already loaded on the engine).
  Returns how many segments were drawn."""
  jobs = collections.deque(t for t in traces if t.next_version == version)
  count = len(jobs)
  state = engine.init_decode_state()
  slots: list[Trace | None] = [None] * engine.max_concurrent_decodes
  while jobs or any(slot is not None for slot in slots):
    for index, slot in enumerate(slots):
      if slot is None and jobs:
        trace = jobs.popleft()
        state = _start(engine, params, state, index, trace, partial_strategy)
        slots[index] = trace
    state, result = engine.generate(params, state)
    for index, trace in enumerate(slots):
      if trace is None:
        continue
      tokens, logprobs = result.get_result_at_slot(index)
      target = sum(length for _, length in trace.segments[:trace.done_segments + 1])
      take = min(target - len(trace.tokens), len(tokens))
      trace.tokens.extend(tokens[:take].tolist())
      trace.logprobs.extend(logprobs[:take].tolist())
      trace.versions.extend([version] * take)
      if len(trace.tokens) == target:
        trace.done_segments += 1
        if partial_strategy == "keep_kv" and not trace.complete:
          trace.row = _take_row(state, np.int32(index))
        slots[index] = None
  return count


def _start(engine: Engine, params, state, slot: int, trace: Trace, partial_strategy: str):
  """Puts the trace's next segment into `slot`, as the rollout started or resumed it."""
  if not trace.tokens:
    prefix = _prefill(engine, params, trace.recorded.prompt_tokens)
    return engine.insert(prefix, state, slot, rng=trace.key)
  if partial_strategy == "keep_kv":
    state, trace.row = _put_row(state, trace.row, np.int32(slot)), None
    return state
  sequence = np.concatenate([trace.recorded.prompt_tokens, np.asarray(trace.tokens, np.int32)])
  prefix = _prefill(engine, params, sequence)
  return engine.insert(prefix, state, slot, rng=trace.key, num_generated=len(trace.tokens))


def _prefill(engine: Engine, params, sequence):
  sequence = np.asarray(sequence, np.int32)
  return engine.prefill(params=params, padded_tokens=engine.pad_to_bucket(sequence),
                        true_length=len(sequence))


def compare_tokens(traces) -> dict:
  """How the regenerated samples compare with the recorded ones: samples whose tokens (and
  versions) are identical, and the largest behaviour logprob difference among those."""
  same, largest, first_different = 0, 0.0, None
  for trace in traces:
    recorded = trace.recorded
    if (np.array_equal(recorded.response_tokens, trace.tokens)
        and np.array_equal(recorded.token_versions, trace.versions)):
      same += 1
      if len(trace.logprobs):
        largest = max(largest, float(np.max(np.abs(
            recorded.behaviour_logprobs - np.asarray(trace.logprobs, np.float32)))))
    elif first_different is None:
      first_different = list(recorded.uid)
  return {"samples": len(traces), "identical_tokens": same,
          "behaviour_logprob_max_abs_diff": largest, "first_different": first_different}
