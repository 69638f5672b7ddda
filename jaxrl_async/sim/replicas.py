"""Modelled generation: rollout replicas with decode slots, continuous batching and swaps.

Each replica mirrors `ContinuousBatcher`: free slots are refilled from its pending requests
(one prefill per prompt, shared by the group's members), then decode steps run with every
active slot drawing one token. Between two events nothing changes the active set, so a
replica runs whole stretches of steps at once: until the next response finishes, or until it
is asked to stop at the next step boundary (a weight swap, new requests for free slots). The
time of a stretch is steps x decode_curve(active slots).

Responses record the version of every token (one entry per `token_block` tokens) as segments,
so an interrupted response resumed under new weights spans versions exactly as in the engine.
Each stretch's finished responses go to the reward model as one batch (`workers` scorers, a
drawn latency per response) and into the buffer when the whole batch is scored.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

import numpy as np

from jaxrl_async.sim.clock import Clock, Device, Host
from jaxrl_async.sim.profile import Profile, RolloutCost
from jaxrl_async.types import Sample

_EMPTY_PROMPT = np.zeros((1,), np.int32)
_DRAW_BATCH = 8192
# The instance fields `_finish_all` writes: Sample's fields and SimSample's version summaries.
_SAMPLE_KEYS = frozenset((
    "prompt_id", "group_id", "group_size", "prompt_tokens", "response_tokens",
    "behaviour_logprobs", "token_versions", "finish_reason", "reward", "reward_status",
    "retries", "interruptions", "timestamps", "meta", "_oldest", "_newest"))
_UNIFORM_CACHE = 256  # cached per-version arrays before the cache is cleared


class SimSample(Sample):
  """A `Sample` whose version summaries are known when it is made (the simulator built its
  `token_versions` from segments), so the learner's checks need no pass over the array."""

  def set_versions(self, oldest: int, newest: int) -> SimSample:
    self._oldest, self._newest = oldest, newest
    return self

  @property
  def min_version(self) -> int:
    return self._oldest

  @property
  def max_version(self) -> int:
    return self._newest

  @property
  def version_span(self) -> int:
    return self._newest - self._oldest

  @property
  def is_partial(self) -> bool:
    return self._newest > self._oldest


_fields = set(vars(SimSample(prompt_id=0, group_id=0, group_size=1,
                            prompt_tokens=_EMPTY_PROMPT).set_versions(0, 0)))
if _fields != _SAMPLE_KEYS:
  raise ImportError(f"sim: SimSample's fields {sorted(_fields)} are not the ones "
                    "ReplicaPool._finish_all writes")
del _fields


def make_sample(template: SimSample, **fields) -> SimSample:
  """A SimSample with `template`'s fields replaced by `fields`, without the dataclass's
  validation: the simulator builds every array itself, with one entry per response unit."""
  sample = SimSample.__new__(SimSample)
  sample.__dict__ = {**template.__dict__, **fields}
  return sample


class Generation:
  """One response being generated: `units` token entries in all, version segments so far."""

  __slots__ = ("failed", "group_id", "index", "interruptions", "seg_start", "segments",
               "tokens", "truncated", "units")

  def __init__(self, group_id: int, index: int, tokens: int, units: int, truncated: bool,
               failed: bool):
    self.group_id = group_id
    self.index = index
    self.tokens = tokens  # real response tokens
    self.units = units  # simulated token entries (ceil(tokens / token_block))
    self.truncated = truncated
    self.failed = failed
    self.segments: list[tuple[int, int]] = []  # (policy version, entries)
    self.seg_start = 0  # replica position where the open segment began
    self.interruptions = 0


class Replica:
  __slots__ = (
    "active",
    "chunk_prefill_s",
    "chunk_steps",
    "device",
    "index",
    "pending",
    "pos",
    "stop_requested",
    "version",
  )

  def __init__(self, clock: Clock, index: int, host: Host | None):
    self.index = index
    self.device = Device(clock, f"rollout{index}", host)
    self.active: list[tuple[int, int, Generation]] = []  # heap of (finish pos, seq, gen)
    self.pending: deque[Generation] = deque()
    self.pos = 0  # decode steps (in token entries) run so far
    self.version = -1
    self.chunk_steps = 0
    self.chunk_prefill_s = 0.0
    self.stop_requested = False

  @property
  def load(self) -> int:
    return len(self.active) + len(self.pending)


class ReplicaPool:
  """The rollout side's replicas and reward scorers; controllers decide what runs when."""

  def __init__(self, clock: Clock, profile: Profile, rollout: RolloutCost, host: Host | None,
               rng: np.random.Generator, on_turn: Callable[[Replica], None],
               on_finished: Callable[[list[Sample]], None],
               on_rewarded: Callable[[list[Sample]], None], group_size: int):
    self.clock = clock
    self.group_size = group_size
    self.profile = profile
    self.rng = rng
    self.slots = rollout.slots
    self.block = profile.token_block
    self.unit_s = (rollout.step_table(rollout.slots) * self.block).tolist()  # s per entry step
    self.prefill_s_per_token = rollout.prefill_s_per_token
    self.weight_load_s = rollout.weight_load_s
    self.replicas = [Replica(clock, i, host) for i in range(rollout.replicas)]
    self.on_turn = on_turn
    self.on_finished = on_finished  # e.g. `score` (async) or hold until the step ends (sync)
    self.on_rewarded = on_rewarded
    self._reward_until = 0.0
    self._seq = 0
    self._reward_free = [0.0] * profile.reward_workers  # heap of scorer free times
    self.reward_busy_s = 0.0
    self.generated_tokens = 0
    self._zeros: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    self._uniform: dict[int, np.ndarray] = {}  # version -> read-only array
    self._max_units = -(-profile.response_length.max // self.block)
    self._template = SimSample(prompt_id=0, group_id=0, group_size=self.group_size,
                               prompt_tokens=_EMPTY_PROMPT, reward=1.0).set_versions(0, 0)
    self._template_fields = dict(self._template.__dict__)
    self._streams: dict[str, list] = {}

  # ---- requests -------------------------------------------------------------------------------
  def _draws(self, name: str, count: int) -> list:
    """`count` values of a random stream, drawn in large batches (cheaper than one by one)."""
    queue = self._streams.get(name)
    if queue is None or len(queue) < count:
      prof, size = self.profile, max(_DRAW_BATCH, count)
      if name.startswith("group"):  # "group<size>": whole groups' lengths
        fresh = prof.response_length.sample_groups(self.rng, size, int(name[len("group"):]))
      else:
        fresh = {"length": lambda: prof.response_length.sample(self.rng, size),
                 "failed": lambda: self.rng.random(size) < prof.reward_fail_prob,
                 "latency": lambda: prof.reward_latency.sample(self.rng, size)}[name]().tolist()
      queue = self._streams[name] = fresh[::-1] + (queue or [])  # pop() takes the oldest
    taken = queue[-count:]
    del queue[-count:]
    taken.reverse()
    return taken

  def new_group(self, group_id: int, group_size: int) -> list[Generation]:
    model = self.profile.response_length
    if model.kind == "groups":  # measured groups drawn whole
      lengths = self._draws(f"group{group_size}", 1)[0]
    else:
      lengths = self._draws("length", group_size)
    failed = self._draws("failed", group_size)
    top, block = self.profile.response_length.max, self.block
    return [Generation(group_id, i, n, -(-n // block), n >= top, f)
            for i, (n, f) in enumerate(zip(lengths, failed))]

  def least_loaded(self) -> Replica:
    replicas = self.replicas
    return replicas[0] if len(replicas) == 1 else min(replicas, key=lambda r: r.load)

  # ---- running a replica ------------------------------------------------------------------------
  def step(self, replica: Replica, admit: bool) -> bool:
    """Refill (if `admit`) and start a stretch of decode steps; False if nothing to run."""
    prefill_tokens = 0
    if admit and replica.pending and len(replica.active) < self.slots:
      prompts = set()
      while replica.pending and len(replica.active) < self.slots:
        gen = replica.pending.popleft()
        if gen.group_id not in prompts:
          prompts.add(gen.group_id)
          prefill_tokens += self.profile.prompt_tokens
        gen.seg_start = replica.pos
        self._seq += 1
        heapq.heappush(replica.active, (replica.pos + gen.units, self._seq, gen))
    if not replica.active:
      return False
    steps = replica.active[0][0] - replica.pos
    replica.chunk_steps = steps
    replica.chunk_prefill_s = prefill_tokens * self.prefill_s_per_token
    replica.stop_requested = False
    work = replica.chunk_prefill_s + steps * self.unit_s[len(replica.active)]
    replica.device.start(work, lambda: self._stretch_done(replica), "rollout")
    return True

  def stop_at_boundary(self, replica: Replica) -> None:
    """Cut the running stretch at the next step boundary (a swap or a refill is due)."""
    if not replica.device.busy or replica.chunk_steps == 0 or replica.stop_requested:
      return
    replica.stop_requested = True
    decode_done = replica.device.work_done() - replica.chunk_prefill_s
    step_s = self.unit_s[len(replica.active)]
    steps = min(replica.chunk_steps, max(0, math.ceil(decode_done / step_s - 1e-9)))
    if steps < replica.chunk_steps:
      replica.chunk_steps = steps
      replica.device.set_total_work(replica.chunk_prefill_s + steps * step_s)

  def _stretch_done(self, replica: Replica) -> None:
    replica.pos += replica.chunk_steps
    self.generated_tokens += replica.chunk_steps * len(replica.active) * self.block
    finished = []
    active = replica.active
    while active and active[0][0] <= replica.pos:
      finished.append(heapq.heappop(active)[2])
    if finished:
      self.on_finished(self._finish_all(replica, finished))
    self.on_turn(replica)

  def swap(self, replica: Replica, version: int, strategy: str | None,
           on_done: Callable[[], None]) -> int:
    """New weights at a step boundary; in-flight responses continue ('reprefill': their
    prompt + partial response is prefilled again). Returns how many were interrupted."""
    tokens = 0
    for finish, _, gen in replica.active:
      done = replica.pos - gen.seg_start
      if done > 0:
        gen.segments.append((replica.version, done))
      gen.seg_start = replica.pos
      gen.interruptions += 1
      if strategy == "reprefill":
        tokens += self.profile.prompt_tokens + min(
            gen.tokens, (gen.units - (finish - replica.pos)) * self.block)
    replica.version = int(version)
    work = self.weight_load_s + tokens * self.prefill_s_per_token
    replica.chunk_steps = 0
    replica.device.start(work, on_done, "rollout")
    return len(replica.active)

  # ---- finished responses -------------------------------------------------------------------------
  def _finish_all(self, replica: Replica, gens: list[Generation]) -> list[Sample]:
    """The finished responses as samples (one loop, its lookups hoisted: the hottest path)."""
    pos, version = replica.pos, replica.version
    now = self.clock.now
    template = self._template_fields
    group_size, prompt_tokens = template["group_size"], template["prompt_tokens"]
    reward, retries = template["reward"], template["retries"]
    zeros_cache, uniform, new = self._zeros, self._uniform_versions, SimSample.__new__
    made = []
    for gen in gens:
      done = pos - gen.seg_start
      segments = gen.segments
      if done > 0:
        segments.append((version, done))
      units = gen.units
      if len(segments) == 1:
        token_versions = uniform(segments[0][0], units)
      else:
        versions, counts = zip(*segments)
        token_versions = np.repeat(np.asarray(versions, np.int32), counts)
      zeros = zeros_cache.get(units)
      if zeros is None:
        zeros = zeros_cache[units] = (np.zeros(units, np.int32), np.zeros(units, np.float32))
      sample = new(SimSample)
      # make_sample's fields (the template's, then this response's own), as one dict.
      sample.__dict__ = {
          "prompt_id": gen.group_id, "group_id": gen.group_id, "group_size": group_size,
          "prompt_tokens": prompt_tokens, "response_tokens": zeros[0],
          "behaviour_logprobs": zeros[1], "token_versions": token_versions,
          "finish_reason": "length" if gen.truncated else "eos", "reward": reward,
          "reward_status": "failed" if gen.failed else "ok", "retries": retries,
          "interruptions": gen.interruptions, "timestamps": {"created": now, "generated": now},
          "meta": {"index_in_group": gen.index, "tokens": gen.tokens},
          "_oldest": segments[0][0], "_newest": segments[-1][0]}  # versions only grow
      made.append(sample)
    return made

  def _uniform_versions(self, version: int, units: int) -> np.ndarray:
    """A read-only int32 array of `units` entries equal to `version`: a view of one array per
    version, shared between samples (most responses run under one version; nothing downstream
    writes into token_versions)."""
    full = self._uniform.get(version)
    if full is None or full.size < units:
      if len(self._uniform) >= _UNIFORM_CACHE:
        self._uniform.clear()
      full = self._uniform[version] = np.full(max(units, self._max_units), version, np.int32)
      full.flags.writeable = False
    return full[:units]

  def score(self, samples: list[Sample]) -> None:
    """Hands one step's finished samples to the reward scorers as a batch (each sample to the
    first free scorer); `on_rewarded` gets the batch when all of it is scored, as the
    rollouter puts a scored batch into the buffer."""
    latencies = self._draws("latency", len(samples))
    free = self._reward_free
    now = self.clock.now
    batch_done = now
    heapreplace = heapq.heapreplace
    for latency in latencies:
      free_at = free[0]
      begin = free_at if free_at > now else now  # max(now, free_at)
      done = begin + latency
      heapreplace(free, done)  # the earliest free scorer takes it
      if done > batch_done:
        batch_done = done
      # Busy time of the reward role: the union of scoring intervals (as RoleTimer merges them).
      until = self._reward_until
      if done > until:
        self.reward_busy_s += done - (begin if begin > until else until)
        self._reward_until = done
    self.clock.at(batch_done, self._rewarded, samples)

  def _rewarded(self, samples: list[Sample]) -> None:
    now = self.clock.now
    for sample in samples:
      sample.timestamps["rewarded"] = now
    self.on_rewarded(samples)
