"""A task read from dataset files: prompts from JSONL or Parquet rows, rendered with a Hugging
Face tokenizer's chat template, scored by a text reward (math answers by default).

The training split is `data_path`; the held-out split is `eval_path`, or else a fixed
`holdout_fraction` of `data_path`'s good rows (chosen by a permutation seeded with `seed`, and
never trained on). A problem is a pure function of (files, settings, split, index), so prompts in
flight re-create from their index, and the pipeline (`prompt_dataset`) is checkpointable by
position; each rollout server takes its shard of the rows (`shard_index` of `shard_count`).

The prompt: with a chat template, [system_prompt], then the user message written by
`Fields.template`, rendered with the generation prompt (the template writes its own bos);
without one, `system_prompt + '\\n\\n' + message` after bos. The reward decodes the response up
to its first stop id, skipping special tokens, and calls `reward_fn(text, answer)`.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from jaxrl_async.tasks import base, datasets, math_rewards
from jaxrl_async.tasks.hf_tokenizer import HFTokenizer

logger = logging.getLogger(__name__)
TextReward = Callable[[str, str], float]  # (response text, reference answer) -> reward


def _digest(path: str | os.PathLike) -> str:
  if not os.path.isfile(path):
    raise FileNotFoundError(f"dataset file {str(path)!r} does not exist")
  sha = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      sha.update(block)
  return sha.hexdigest()[:16]


class _ProblemAt:
  """index -> task.problem(index, split); picklable for grain's worker processes."""

  def __init__(self, task: TextTask, split: str):
    self.task, self.split = task, split

  def __call__(self, index) -> base.Problem:
    return self.task.problem(int(index), self.split)


class TextTask:
  """Implements `base.Task` over dataset files; see the module docstring.

  Args:
    data_path: the training file (.jsonl or .parquet).
    tokenizer: a model directory with tokenizer.json (or an HFTokenizer).
    eval_path: the held-out file; None holds out `holdout_fraction` of data_path.
    fields: which fields make the prompt and the answer (datasets.Fields).
    max_prompt_len: longer prompts are counted as 'too_long' bad rows.
    max_response_len: the most tokens a response may have (the engine's limit).
    reward_fn: (response text, answer) -> float; default MathReward().
    use_chat_template: render with the tokenizer's chat template (it must have one).
    holdout_fraction: share of data_path held out when there is no eval_path, in (0, 0.5].
    seed: the holdout's permutation.
    shard_index, shard_count: this rollout server's shard of the training rows.
  """

  def __init__(self, data_path: str | os.PathLike, tokenizer: str | os.PathLike | HFTokenizer, *,
               eval_path: str | os.PathLike | None = None,
               fields: datasets.Fields = datasets.Fields(), max_prompt_len: int = 512,
               max_response_len: int = 512, reward_fn: TextReward | None = None,
               use_chat_template: bool = True, holdout_fraction: float = 0.05, seed: int = 0,
               shard_index: int = 0, shard_count: int = 1):
    if not isinstance(max_response_len, int) or max_response_len < 1:
      raise ValueError(f"max_response_len must be an int >= 1, got {max_response_len!r}")
    if not 0.0 < holdout_fraction <= 0.5:
      raise ValueError(f"holdout_fraction must be in (0, 0.5], got {holdout_fraction!r}")
    datasets.check_shard(shard_index, shard_count)
    self._tokenizer = (tokenizer if isinstance(tokenizer, HFTokenizer)
                       else HFTokenizer.from_dir(tokenizer))
    if use_chat_template and not self._tokenizer.has_chat_template:
      raise ValueError("use_chat_template=True but the tokenizer has no chat template; set "
                       "TextTask.use_chat_template = False to write prompts as plain text")
    self.data_path, self.eval_path = str(data_path), eval_path and str(eval_path)
    self.fields, self.use_chat_template = fields, bool(use_chat_template)
    self._max_prompt_len, self._max_response_len = int(max_prompt_len), int(max_response_len)
    self.reward_fn = reward_fn if reward_fn is not None else math_rewards.MathReward()
    self.holdout_fraction, self.seed = float(holdout_fraction), int(seed)
    self.shard_index, self.shard_count = shard_index, shard_count
    self._digests = [_digest(data_path)]
    self.data = datasets.load_prompt_set(data_path, fields, self.render_prompt, max_prompt_len)
    if eval_path is not None:
      self._digests.append(_digest(eval_path))
      self.eval_data = datasets.load_prompt_set(eval_path, fields, self.render_prompt,
                                                max_prompt_len)
      self._rows = {"train": list(self.data.rows), "eval": list(self.eval_data.rows)}
    else:
      if len(self.data) < 2:
        raise ValueError(f"{data_path} has {len(self.data)} good row(s): too few to hold out "
                         f"an eval split; give TextTask.eval_path")
      self.eval_data = None
      order = np.random.default_rng([self.seed, 11]).permutation(len(self.data))
      held = set(order[:max(1, round(self.holdout_fraction * len(self.data)))].tolist())
      self._rows = {"train": [r for i, r in enumerate(self.data.rows) if i not in held],
                    "eval": [r for i, r in enumerate(self.data.rows) if i in held]}
    for prompt_set in (self.data, self.eval_data):
      if prompt_set is not None and prompt_set.num_bad:
        logger.warning("%s", prompt_set.report())

  def __repr__(self) -> str:
    return (f"TextTask({self.data_path!r}, eval_path={self.eval_path!r}, files={self._digests}, "
            f"tokenizer={self._tokenizer!r}, fields={self.fields!r}, "
            f"max_prompt_len={self._max_prompt_len}, max_response_len={self._max_response_len}, "
            f"reward_fn={self.reward_fn!r}, use_chat_template={self.use_chat_template}, "
            f"holdout_fraction={self.holdout_fraction}, seed={self.seed})")

  # ---- sizes --------------------------------------------------------------------------------
  @property
  def tokenizer(self) -> HFTokenizer:
    return self._tokenizer

  @property
  def max_prompt_len(self) -> int:
    return self._max_prompt_len

  @property
  def max_response_len(self) -> int:
    return self._max_response_len

  @property
  def max_sequence_len(self) -> int:
    return self._max_prompt_len + self._max_response_len

  def num_problems(self, split: str = "train") -> int:
    base.check_split(split)
    return len(self._rows[split])

  def data_metrics(self) -> dict[str, float]:
    """Counts of good and bad rows per file (`data/...` and `data_eval/...`)."""
    metrics = self.data.metrics("data")
    if self.eval_data is not None:
      metrics.update(self.eval_data.metrics("data_eval"))
    return metrics

  # ---- prompts ------------------------------------------------------------------------------
  def render_prompt(self, message: str) -> np.ndarray:
    """The user message as prompt token ids (see the module docstring)."""
    tok, system = self._tokenizer, self.fields.system_prompt
    if self.use_chat_template:
      chat = ([{"role": "system", "content": system}] if system else []) + [
          {"role": "user", "content": message}]
      return tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
    text = f"{system}\n\n{message}" if system else message
    return tok.encode(text, add_bos=tok.bos_id is not None)

  def problem(self, index: int, split: str = "train") -> base.Problem:
    base.check_split(split)
    rows = self._rows[split]
    if not isinstance(index, (int, np.integer)) or not 0 <= index < len(rows):
      raise ValueError(f"problem index must be an int in [0, {len(rows)}) for split "
                       f"{split!r}, got {index!r}")
    row = rows[int(index)]
    meta = {"answer": row.answer, "row": row.row, "split": split}
    return base.Problem(prompt_id=int(index), prompt_tokens=row.prompt_tokens, meta=meta)

  def eval_set(self, n: int = 256) -> list[base.Problem]:
    """The first min(n, eval rows) held-out problems."""
    if n < 0:
      raise ValueError(f"eval_set size must be >= 0, got {n}")
    return [self.problem(i, "eval") for i in range(min(n, len(self._rows["eval"])))]

  def prompt_dataset(self, *, seed: int, split: str = "train", shuffle: bool = True,
                     num_epochs: int | None = None,
                     read_options: grain.ReadOptions | None = None) -> grain.IterDataset:
    """This shard's problems of `split`, shuffled per epoch (datasets.row_pipeline)."""
    base.check_split(split)
    shard = (self.shard_index, self.shard_count) if split == "train" else (0, 1)
    return datasets.row_pipeline(len(self._rows[split]), _ProblemAt(self, split), seed=seed,
                                 shuffle=shuffle, shard_index=shard[0], shard_count=shard[1],
                                 num_epochs=num_epochs, read_options=read_options)

  # ---- verifier -----------------------------------------------------------------------------
  def response_text(self, response_tokens: np.ndarray) -> str:
    return self._tokenizer.decode(response_tokens, stop_at_eos=True, skip_special=True)

  def reward(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray,
             meta: dict[str, Any]) -> float:
    """reward_fn(decoded response, meta['answer']); needs Fields.answer."""
    del prompt_tokens
    answer = meta.get("answer") if meta else None
    if answer is None:
      raise ValueError("the problem has no reference answer (Fields.answer is None); give a "
                       "reward_fn that needs none or name the answer field")
    return float(self.reward_fn(self.response_text(response_tokens), answer))

  # ---- supervised warm-up -------------------------------------------------------------------
  def sft_example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """The prompt followed by the answer field's text and eos (GSM8K's answers are worked
    solutions ending in '#### n'); the loss mask covers the answer and eos."""
    problem = self.problem(index, "train")
    if problem.meta["answer"] is None:
      raise ValueError("sft_example needs Fields.answer")
    response = np.concatenate([self._tokenizer.encode(problem.meta["answer"]),
                               [self._tokenizer.eos_id]]).astype(np.int32)
    tokens = np.concatenate([problem.prompt_tokens, response]).astype(np.int32)
    mask = np.concatenate([np.zeros(len(problem.prompt_tokens), np.float32),
                           np.ones(len(response), np.float32)])
    return tokens, mask

  def sft_batch(self, rng: np.random.Generator, batch_size: int,
                seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Random train examples, right-padded with pad_id; an example longer than seq_len is cut
    (its mask with it)."""
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seq_len < self._max_prompt_len + 1:
      raise ValueError(f"seq_len must be > max_prompt_len={self._max_prompt_len}, got {seq_len}")
    tokens = np.full((batch_size, seq_len), self._tokenizer.pad_id, np.int32)
    loss_mask = np.zeros((batch_size, seq_len), np.float32)
    count = len(self._rows["train"])
    for row, index in enumerate(rng.integers(0, count, size=batch_size).tolist()):
      example_tokens, example_mask = self.sft_example(index)
      length = min(len(example_tokens), seq_len)
      tokens[row, :length], loss_mask[row, :length] = (example_tokens[:length],
                                                      example_mask[:length])
    return tokens, loss_mask

