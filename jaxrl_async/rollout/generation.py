"""Continuous batching on the host: keep every decode slot busy, stream finished samples out.

`ContinuousBatcher` owns one engine's decode state. Each `step()` refills free slots from the
pending requests at once (one prefill per prompt, shared by the members of a GRPO group that are
admitted together; resumed partial responses prefilled together, one call per prefill bucket),
runs one `generate` call, appends each slot's new tokens with their behaviour logprobs and the
policy version that drew them, and returns the samples that finished (end token or max length).
A weight swap between steps is either waited for (`drain`), or applied at the step boundary with
the interrupted samples resumed by 'keep_kv' or 'reprefill' (batched the same way).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl_async import faults
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.types import FinishReason, Sample

PARTIAL_STRATEGIES = ("keep_kv", "reprefill")


@dataclasses.dataclass
class GenerationRequest:
  """A sample to fill (prompt set, response empty or partial) and its sampling key."""

  sample: Sample
  key: np.ndarray  # uint32 [2]: raw PRNG key data


@dataclasses.dataclass
class _Slot:
  request: GenerationRequest
  tokens: list = dataclasses.field(default_factory=list)
  log_probs: list = dataclasses.field(default_factory=list)
  versions: list = dataclasses.field(default_factory=list)


def sample_key(seed: int, group_id: int, index_in_group: int) -> np.ndarray:
  """The key of one sample: a function of (seed, group, member) only, never of the slot."""
  return sample_keys(seed, group_id, [index_in_group])[0]


@jax.jit
def _member_keys(seed, group_id, members):
  group_key = jax.random.fold_in(jax.random.PRNGKey(seed), group_id)
  return jax.vmap(lambda member: jax.random.fold_in(group_key, member))(members)


def sample_keys(seed: int, group_id: int, members) -> np.ndarray:
  """`sample_key` for several members of one group in one device call: uint32 [n, 2]."""
  members = np.asarray(members, np.uint32)
  return np.asarray(_member_keys(np.uint32(seed), np.uint32(group_id), members), np.uint32)


def stop_id_set(eos_id: int, stop_ids: Sequence[int] = ()) -> frozenset[int]:
  """The ids that end a sample: eos_id (unless -1) and stop_ids, checked to be ints."""
  ids = [] if eos_id == -1 else [eos_id]
  ids += list(stop_ids)
  for i in ids:
    if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
      raise ValueError(f"stop ids must be ints >= 0 (eos_id may be -1: none), got eos_id="
                       f"{eos_id!r}, stop_ids={tuple(stop_ids)!r}")
  return frozenset(int(i) for i in ids)


class ContinuousBatcher:
  """Host-side scheduler over an `Engine`; not thread-safe (one rollout thread owns it)."""

  def __init__(self, engine: Engine, *, eos_id: int, max_response_len: int,
               stop_ids: Sequence[int] = (), clock=time.time):
    """eos_id, stop_ids: a sample finishes (FinishReason.EOS, the token kept) at the first of
    them it draws, e.g. a tokenizer's `stop_ids` (its eos and the generation config's); -1
    for eos_id: none."""
    if max_response_len < 1:
      raise ValueError(f"max_response_len must be >= 1, got {max_response_len}")
    self.engine = engine
    self.eos_id = eos_id
    self.stop_ids = stop_id_set(eos_id, stop_ids)
    self.max_response_len = max_response_len
    self.clock = clock
    self.params = None
    self.version = -1
    self._state = engine.init_decode_state()
    self._slots: list[_Slot | None] = [None] * engine.max_concurrent_decodes
    self._pending: collections.deque[GenerationRequest] = collections.deque()
    self.tokens_generated = 0  # response tokens kept (not counting idle-slot work)
    self.slot_steps = 0  # slots x decode steps run, busy or idle

  # ---- state -------------------------------------------------------------------------------
  @property
  def num_active(self) -> int:
    return sum(slot is not None for slot in self._slots)

  @property
  def num_pending(self) -> int:
    return len(self._pending)

  @property
  def idle(self) -> bool:
    return not self._pending and self.num_active == 0

  def set_params(self, params, version: int, *, partial_strategy: str | None = None) -> int:
    """Swap weights at a step boundary. Returns how many in-flight samples were interrupted.

    With samples in flight, `partial_strategy` says how they continue: 'keep_kv' keeps their
    cache (old-weight keys and values), 'reprefill' recomputes prompt + partial response under
    the new weights. `None` requires that nothing is in flight (drain first).
    """
    if partial_strategy is not None and partial_strategy not in PARTIAL_STRATEGIES:
      raise ValueError(
          f"partial_strategy must be one of {PARTIAL_STRATEGIES}, got {partial_strategy!r}")
    active = [i for i, slot in enumerate(self._slots) if slot is not None]
    if active and partial_strategy is None:
      raise RuntimeError(
          f"{len(active)} samples in flight: drain them or pass a partial_strategy")
    if partial_strategy == "reprefill":  # check before changing anything
      longest = max((len(self._slots[i].request.sample.prompt_tokens) + len(self._slots[i].tokens)
                     for i in active), default=0)
      if longest > self.engine.max_prefill_length:
        raise ValueError(
            f"'reprefill' needs prompt + partial response ({longest} tokens) <= "
            f"max_prefill_length={self.engine.max_prefill_length}; raise max_prefill_length to "
            "the cache length or use 'keep_kv'")
    self.params = self.engine.load_params(params)
    self.version = int(version)
    for i in active:
      self._slots[i].request.sample.interruptions += 1
    if partial_strategy == "reprefill" and active:
      self._prefill_rows([(i, self._slots[i].request, np.asarray(self._slots[i].tokens, np.int32))
                          for i in active])
    return len(active)

  def submit(self, requests) -> None:
    for request in requests:
      prompt_len = len(request.sample.prompt_tokens)
      if prompt_len > self.engine.max_prefill_length:
        raise ValueError(
            f"prompt of {prompt_len} tokens exceeds max_prefill_length="
            f"{self.engine.max_prefill_length}")
      total = prompt_len + self.max_response_len
      if total > self.engine.cache_length:
        raise ValueError(
            f"prompt of {len(request.sample.prompt_tokens)} tokens + max_response_len="
            f"{self.max_response_len} exceeds the cache length {self.engine.cache_length}")
      self._pending.append(request)

  def take_pending(self) -> list[GenerationRequest]:
    """Remove and return requests not yet started (e.g. at shutdown, to count or re-issue)."""
    taken = list(self._pending)
    self._pending.clear()
    return taken

  def abort_active(self) -> list[Sample]:
    """Stop every in-flight sample (shutdown); returns them marked ABORTED with partial data."""
    aborted = []
    for i, slot in enumerate(self._slots):
      if slot is not None:
        aborted.append(self._finish(i, FinishReason.ABORTED))
    return aborted

  # ---- the loop ------------------------------------------------------------------------------
  def step(self, *, admit: bool = True) -> list[Sample]:
    """Refill free slots (if `admit`), run one generate call, return the finished samples."""
    if self.params is None:
      raise RuntimeError("set_params must be called before step")
    faults.point("rollout.decode_step")
    began = self.clock()  # work under self.version starts here (refill prefills with it too)
    if admit:
      self._refill()
    if self.num_active == 0:
      return []
    self._state, result = self.engine.generate(self.params, self._state)
    self.slot_steps += self.engine.max_concurrent_decodes * self.engine.steps_per_call
    finished = []
    for i, slot in enumerate(self._slots):
      if slot is None:
        continue
      tokens, log_probs = result.get_result_at_slot(i)
      if not slot.versions or slot.versions[-1] != self.version:  # its first token of this one
        slot.request.sample.stamp_version_began(self.version, began)
      for token, log_prob in zip(tokens.tolist(), log_probs.tolist()):
        slot.tokens.append(token)
        slot.log_probs.append(log_prob)
        slot.versions.append(self.version)
        self.tokens_generated += 1
        if token in self.stop_ids:
          finished.append(self._finish(i, FinishReason.EOS))
          break
        if len(slot.tokens) >= self.max_response_len:
          finished.append(self._finish(i, FinishReason.LENGTH))
          break
    return finished

  def run_to_completion(self, requests, *, max_steps: int = 1_000_000) -> list[Sample]:
    """Generate every request (continuous batching inside the call); the sync path."""
    self.submit(requests)
    done: list[Sample] = []
    for _ in range(max_steps):
      if self.idle:
        return done
      done.extend(self.step())
    raise RuntimeError(f"generation did not finish within {max_steps} steps")

  # ---- internals -----------------------------------------------------------------------------
  def _refill(self) -> None:
    """Fill free slots: one prefill per new prompt, one insert call for all its members."""
    new_prompts = {}  # id(prompt) -> (prefix, slots, keys)
    resumed = []  # partial responses: prefilled together, prompt + response so far
    for i, slot in enumerate(self._slots):
      if slot is not None or not self._pending:
        continue
      request = self._pending.popleft()
      sample = request.sample
      if len(sample.response_tokens):
        resumed.append((i, request, sample.response_tokens))
        self._slots[i] = _Slot(request, sample.response_tokens.tolist(),
                               sample.behaviour_logprobs.tolist(), sample.token_versions.tolist())
        continue
      key = id(sample.prompt_tokens)
      if key not in new_prompts:
        new_prompts[key] = (self._prefill(sample.prompt_tokens), [], [])
      new_prompts[key][1].append(i)
      new_prompts[key][2].append(request.key)
      self._slots[i] = _Slot(request)
    if resumed:
      self._prefill_rows(resumed)
    for prefix, slots, keys in new_prompts.values():
      self._state = self.engine.insert_many(prefix, self._state, slots, rngs=np.stack(keys))

  def _prefill(self, sequence: np.ndarray):
    sequence = np.asarray(sequence, np.int32)
    return self.engine.prefill(params=self.params, padded_tokens=self.engine.pad_to_bucket(sequence),
                               true_length=len(sequence))

  def _prefill_rows(self, rows) -> None:
    """Resume partial responses, rows of (slot, request, response so far): prompt + response
    prefilled under the current weights and inserted, one device call per prefill bucket (the
    same numbers as one prefill and insert each: `Engine.prefill_insert`)."""
    by_bucket = collections.defaultdict(list)
    for i, request, response in rows:
      sequence = np.concatenate([request.sample.prompt_tokens, np.asarray(response, np.int32)])
      by_bucket[self.engine.bucket_of(len(sequence))].append((i, request, sequence, len(response)))
    for group in by_bucket.values():
      self._state = self.engine.prefill_insert(
          params=self.params, decode_state=self._state, sequences=[r[2] for r in group],
          slots=[r[0] for r in group], rngs=np.stack([r[1].key for r in group]),
          num_generated=[r[3] for r in group])

  def _finish(self, slot_index: int, reason: FinishReason) -> Sample:
    slot = self._slots[slot_index]
    self._slots[slot_index] = None
    sample = slot.request.sample
    sample.response_tokens = np.asarray(slot.tokens, np.int32)
    sample.behaviour_logprobs = np.asarray(slot.log_probs, np.float32)
    sample.token_versions = np.asarray(slot.versions, np.int32)
    sample.finish_reason = reason.value
    sample.stamp("generated", self.clock())
    return sample


def task_batcher(engine: Engine, task) -> ContinuousBatcher:
  """A batcher for `task`: its tokenizer's EOS and extra stop ids (a Hugging Face tokenizer's
  generation-config EOS ids; none for the built-in tokenizer), its response length limit."""
  tokenizer = task.tokenizer
  return ContinuousBatcher(engine, eos_id=tokenizer.eos_id,
                           stop_ids=tuple(getattr(tokenizer, "stop_ids", ())),
                           max_response_len=task.max_response_len)
