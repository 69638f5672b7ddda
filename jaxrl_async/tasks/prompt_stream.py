"""The training prompts as one stream of positions, dealt to a fleet of rollout servers that may
change size.

Position p of the stream is problem `order[p]`, where `order` is the shuffled epoch of
`prompts.prompt_dataset` repeated (epoch p // epoch_size, reshuffled each epoch): the same
order a single server draws. A server's share is `holes` (single positions, drawn first) and
then the arithmetic tail `first, first + stride, first + 2 stride, ...`. Server k of K starts
with no holes, first k and stride K: in the first epoch that is exactly shard k of
`prompts.shard_prompt_dataset`.

A share's state is plain JSON, `{'first', 'stride', 'next_index', 'holes'}` (`next_index`: tail
positions drawn so far). The older state `{'next_index': n}` of a grain shard iterator reads as
the tail of server k of K at n.

`redeal_prompts` turns the states of K servers into those of K' servers: every position none
of them drew yet is in exactly one new share. With F the largest next tail position of the old
shares, every position >= F is undrawn; the undrawn positions below F (the old shares' holes and
tail positions under F) become holes, dealt round robin, and server k' of K' takes the tail
F + k', stride K'. Nothing is drawn twice and nothing is skipped.
"""

from __future__ import annotations

import grain

from jaxrl_async.tasks import base
from jaxrl_async.tasks.prompts import DEFAULT_EPOCH_SIZE

STATE_KEYS = ("first", "stride", "next_index", "holes")


def share_state(state: dict | None, index: int, count: int) -> dict:
  """`state` in the full form; None (nothing drawn) and a grain shard iterator's
  `{'next_index': n}` are read as the tail of server `index` of `count`."""
  if state is None:
    state = {}
  if not isinstance(state, dict):
    raise ValueError(f"a prompt share's state must be a dict, got {type(state).__name__}")
  if "stride" not in state:
    state = {"first": index, "stride": count, "next_index": state.get("next_index", 0),
             "holes": []}
  missing = [key for key in STATE_KEYS if key not in state]
  if missing:
    raise ValueError(f"prompt share state {state!r} lacks {missing}")
  out = {"first": int(state["first"]), "stride": int(state["stride"]),
         "next_index": int(state["next_index"]), "holes": [int(p) for p in state["holes"]]}
  if out["stride"] < 1 or out["first"] < 0 or out["next_index"] < 0:
    raise ValueError(f"prompt share state {state!r}: first, next_index must be >= 0 and "
                     "stride >= 1")
  return out


def next_tail(state: dict) -> int:
  """The next tail position of a (full) share state."""
  return state["first"] + state["stride"] * state["next_index"]


def redeal_prompts(states: list, count: int) -> list[dict]:
  """The shares of `count` servers that continue where the servers of `states` (one state per
  old server, in server order; any form `share_state` reads) stopped."""
  if not isinstance(count, int) or count < 1:
    raise ValueError(f"a fleet needs at least one rollout server, got count={count!r}")
  if not states:
    raise ValueError("redeal_prompts needs the states of at least one server")
  full = [share_state(state, index, len(states)) for index, state in enumerate(states)]
  strides = {state["stride"] for state in full}
  starts = sorted(next_tail(state) % len(full) for state in full)
  if strides != {len(full)} or starts != list(range(len(full))):
    raise ValueError(f"the prompt shares {full} do not tile the stream (each tail's stride must "
                     "be the number of servers and their next positions distinct modulo it)")
  frontier = max(next_tail(state) for state in full)
  holes = sorted({p for state in full for p in state["holes"]}
                 | {p for state in full
                    for p in range(next_tail(state), frontier, state["stride"])})
  return [{"first": frontier + k, "stride": count, "next_index": 0, "holes": holes[k::count]}
          for k in range(count)]


class StreamShard:
  """One server's share of the prompt stream as an iterator of `base.Problem`s, with
  `get_state` / `set_state` in the JSON form of the module docstring."""

  def __init__(self, task: base.Task, *, seed: int, index: int, count: int,
               epoch_size: int = DEFAULT_EPOCH_SIZE):
    if getattr(task, "prompt_dataset", None) is not None:
      raise ValueError(f"{type(task).__name__} makes its own prompt pipeline: its prompts "
                       "cannot be dealt as a stream")
    self.task = task
    self._order = grain.MapDataset.range(int(epoch_size)).shuffle(seed=int(seed)).repeat(None)
    self._state = share_state(None, index, count)

  def __iter__(self) -> StreamShard:
    return self

  def __next__(self) -> base.Problem:
    state = self._state
    if state["holes"]:
      position = state["holes"].pop(0)
    else:
      position = next_tail(state)
      state["next_index"] += 1
    return self.task.problem(int(self._order[position]), "train")

  def get_state(self) -> dict:
    return {**self._state, "holes": list(self._state["holes"])}

  def set_state(self, state: dict) -> None:
    self._state = share_state(state, self._state["first"], self._state["stride"])
