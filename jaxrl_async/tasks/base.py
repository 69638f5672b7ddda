"""What a task is: a deterministic source of problems plus a verifier.

A task maps (its seed, split, index) to a `Problem`, always the same one, so that prompts can be
re-created after a restart from their index alone and a grain pipeline over indices is
checkpointable by its position. The reward is a pure Python function of the prompt, the
response and the problem's `meta`, safe to call from worker threads.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Protocol, runtime_checkable

import numpy as np

SPLITS = ("train", "eval")


def check_split(split: str) -> int:
  """Returns the split's integer code (its position in SPLITS) or raises ValueError."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  return SPLITS.index(split)


@dataclasses.dataclass(frozen=True, eq=False)
class Problem:
  """One prompt with what the verifier needs to judge a response.

  prompt_id: the problem's index in its split (it repeats across epochs of a pipeline).
  prompt_tokens: int32 [P], read-only.
  meta: JSON-serialisable task data for the reward (copied to `Sample.meta`).
  """

  prompt_id: int
  prompt_tokens: np.ndarray
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    tokens = np.array(self.prompt_tokens, dtype=np.int32).reshape(-1)
    tokens.setflags(write=False)
    object.__setattr__(self, "prompt_tokens", tokens)
    object.__setattr__(self, "prompt_id", int(self.prompt_id))
    if tokens.size == 0:
      raise ValueError(f"problem {self.prompt_id} has an empty prompt")

  def __eq__(self, other: object) -> bool:
    if not isinstance(other, Problem):
      return NotImplemented
    return (self.prompt_id == other.prompt_id
            and np.array_equal(self.prompt_tokens, other.prompt_tokens)
            and self.meta == other.meta)

  __hash__ = None  # holds an array and a dict

  def to_dict(self) -> dict[str, Any]:
    """JSON-serialisable form (for checkpoints of prompts in flight)."""
    return {"prompt_id": self.prompt_id, "prompt_tokens": self.prompt_tokens.tolist(),
            "meta": json.loads(json.dumps(self.meta))}

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Problem:
    return cls(prompt_id=d["prompt_id"], prompt_tokens=d["prompt_tokens"], meta=dict(d["meta"]))


@runtime_checkable
class Task(Protocol):
  """The interface every task implements (see `reverse.DigitReverseTask`)."""

  @property
  def tokenizer(self) -> Any:
    """Has pad_id, bos_id, eos_id, vocab_size, encode(str), decode(ids)."""

  @property
  def max_prompt_len(self) -> int:
    """Longest prompt in tokens, <bos> included."""

  @property
  def max_response_len(self) -> int:
    """Longest correct response in tokens, <eos> included."""

  def problem(self, index: int, split: str = "train") -> Problem:
    """The problem at `index` of `split`; a pure function of (task seed, split, index)."""

  def reward(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray,
             meta: dict[str, Any]) -> float:
    """Scores one response; pure Python, thread-safe."""

  def sft_example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [T], loss_mask float32 [T]) for train problem `index`: the prompt followed
    by the correct response. loss_mask[t] = 1 where token t is a target (the answer and <eos>);
    a next-token loss reads the logits at t - 1 for token t."""

  def sft_batch(self, rng: np.random.Generator, batch_size: int,
                seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [B, seq_len], loss_mask float32 [B, seq_len]) of random train problems,
    right-padded with pad_id (mask 0 on padding)."""

  def eval_set(self, n: int = 256) -> list[Problem]:
    """A fixed list of held-out problems: `problem(i, 'eval')` for i < n."""
