"""The default task: reverse a string of digits, with a long-tailed length distribution.

Prompt `<bos> d1 d2 ... dL =`, correct response `dL ... d1 <eos>`; reward 1 for exactly that.

Length: P(L = k) ∝ decay**k on [min_len, max_len]. With the defaults (1, 24, 0.75) the response
length L + 1 has median 4 and 99th percentile 17 (4.25x), so a batch of rollouts waits on a few
long samples: the imbalance that asynchronous generation is meant to hide.

Splits: a digit string belongs to 'eval' iff a keyed blake2b hash of it falls in a bucket of
`eval_fraction` of the hash range, else to 'train'; the two are disjoint as sets of strings and
the assignment does not depend on the seed. A split's problems are drawn from the distribution
above conditioned on the split, by rejection of whole (length, digits) draws with the generator
`np.random.default_rng([seed, split_code, index])`. For short lengths the eval bucket holds few
strings (with the default eval_fraction, '0' is the only eval string of length 1 and 10 of the
100 of length 2 are), so short eval problems repeat often and the per-length shares of the two
splits differ by chance there; from length 3 on they match the distribution closely.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from jaxrl_async.tasks import base, rewards
from jaxrl_async.tasks.tokenizer import CharTokenizer

_SPLIT_KEY = b"jaxrl-reverse"
_BUCKETS = 1 << 32
_MAX_DRAWS = 100_000  # rejection bound; the expected number of draws is 1 / split fraction


def in_eval_split(digits: str, eval_fraction: float) -> bool:
  """Whether the digit string belongs to the eval split (a pure function of the string)."""
  digest = hashlib.blake2b(digits.encode(), digest_size=8, key=_SPLIT_KEY).digest()
  return int.from_bytes(digest, "little") % _BUCKETS < int(eval_fraction * _BUCKETS)


class DigitReverseTask:
  """Reverse L digits; see the module docstring. Implements `base.Task`.

  Args:
    seed: problems are a pure function of (seed, split, index).
    min_len, max_len: digit string lengths, 1 <= min_len <= max_len <= 256.
    decay: P(L = k) ∝ decay**k, in (0, 1]; 1 is uniform, smaller is shorter-tailed.
    eval_fraction: share of digit strings held out for 'eval', in (0, 0.5].
    holdout_min_len: strings shorter than this belong to both splits. There are only 110
      strings of one or two digits; holding a tenth of them out would make a quarter of the
      eval set one string ('0') and measure that string, not the policy.
  """

  def __init__(self, seed: int = 0, *, min_len: int = 1, max_len: int = 24,
               decay: float = 0.75, eval_fraction: float = 0.1, holdout_min_len: int = 3,
               distractor_prob: float = 0.6):
    if not isinstance(seed, (int, np.integer)) or seed < 0:
      raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not isinstance(min_len, (int, np.integer)) or not 1 <= min_len <= 256:
      raise ValueError(f"min_len must be an int in [1, 256], got {min_len!r}")
    if not isinstance(max_len, (int, np.integer)) or not min_len <= max_len <= 256:
      raise ValueError(f"max_len must be an int in [min_len={min_len}, 256], got {max_len!r}")
    if not 0.0 < decay <= 1.0:
      raise ValueError(f"decay must be in (0, 1], got {decay!r}")
    if not 0.0 < eval_fraction <= 0.5:
      raise ValueError(f"eval_fraction must be in (0, 0.5], got {eval_fraction!r}")
    if not isinstance(holdout_min_len, (int, np.integer)) or holdout_min_len < 1:
      raise ValueError(f"holdout_min_len must be an int >= 1, got {holdout_min_len!r}")
    self.holdout_min_len = int(holdout_min_len)
    if not 0.0 <= distractor_prob < 1.0:
      raise ValueError(f"distractor_prob must be in [0, 1), got {distractor_prob!r}")
    self.distractor_prob = float(distractor_prob)
    self.seed = int(seed)
    self.min_len, self.max_len = int(min_len), int(max_len)
    self.decay = float(decay)
    self.eval_fraction = float(eval_fraction)
    self._tokenizer = CharTokenizer()
    lengths, probs = self.length_distribution()
    self._lengths = lengths
    self._length_cdf = np.cumsum(probs)
    self._length_cdf[-1] = 1.0

  def __repr__(self) -> str:
    return (f"DigitReverseTask(seed={self.seed}, min_len={self.min_len}, "
            f"max_len={self.max_len}, decay={self.decay}, eval_fraction={self.eval_fraction}, "
            f"holdout_min_len={self.holdout_min_len}, distractor_prob={self.distractor_prob})")

  # ---- sizes --------------------------------------------------------------------------------
  @property
  def tokenizer(self) -> CharTokenizer:
    return self._tokenizer

  @property
  def max_prompt_len(self) -> int:
    return self.max_len + 2  # <bos> digits =

  @property
  def max_response_len(self) -> int:
    return self.max_len + 1  # digits <eos>

  @property
  def max_sequence_len(self) -> int:
    """Longest prompt + correct response: the least `seq_len` `sft_batch` accepts."""
    return self.max_prompt_len + self.max_response_len

  def length_distribution(self) -> tuple[np.ndarray, np.ndarray]:
    """(lengths int [K], probabilities float64 [K]) of the digit count L before the split."""
    lengths = np.arange(self.min_len, self.max_len + 1)
    # Relative to min_len so that decay**k does not underflow for long strings.
    weights = self.decay ** (lengths - self.min_len).astype(np.float64)
    return lengths, weights / weights.sum()

  def response_length_quantile(self, q: float) -> int:
    """The q-quantile of the correct response length L + 1 (before the split)."""
    return int(self._lengths[np.searchsorted(self._length_cdf, q)]) + 1

  # ---- problems -----------------------------------------------------------------------------
  def _draw_digits(self, index: int, split: str) -> str:
    split_code = base.check_split(split)
    if not isinstance(index, (int, np.integer)) or index < 0:
      raise ValueError(f"problem index must be an int >= 0, got {index!r}")
    rng = np.random.default_rng([self.seed, split_code, int(index)])
    want_eval = split == "eval"
    # The length is drawn once, so both splits have the same length distribution; only the
    # digits are redrawn until the string falls in the wanted split.
    length = int(self._lengths[np.searchsorted(self._length_cdf, rng.random(), side="right")])
    for _ in range(_MAX_DRAWS):
      digits = "".join(map(str, rng.integers(0, 10, size=length).tolist()))
      if (length < self.holdout_min_len
          or in_eval_split(digits, self.eval_fraction) == want_eval):
        return digits
    raise RuntimeError(f"no {split} problem found in {_MAX_DRAWS} draws for {self!r}")

  def problem(self, index: int, split: str = "train") -> base.Problem:
    digits = self._draw_digits(index, split)
    tok = self._tokenizer
    prompt = np.concatenate([[tok.bos_id], tok.encode(digits), [tok.equals_id]])
    target = tok.encode(digits[::-1]).tolist()
    return base.Problem(prompt_id=int(index), prompt_tokens=prompt,
                        meta={"target": target, "digits": digits, "split": split})

  def eval_set(self, n: int = 256) -> list[base.Problem]:
    if n < 0:
      raise ValueError(f"eval_set size must be >= 0, got {n}")
    return [self.problem(i, "eval") for i in range(n)]

  def reference_response(self, problem: base.Problem) -> np.ndarray:
    """The correct response, int32 [L + 1]: reversed digits then <eos>."""
    return np.asarray(problem.meta["target"] + [self._tokenizer.eos_id], np.int32)

  # ---- verifier -----------------------------------------------------------------------------
  def reward(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray,
             meta: dict[str, Any]) -> float:
    """1.0 iff the response is the prompt's digits reversed followed by <eos>.

    The target is `meta['target']` when present, else it is read from the prompt.
    """
    target = meta.get("target") if meta else None
    if target is None:
      prompt = np.asarray(prompt_tokens).reshape(-1).tolist()
      digit_ids = set(self._tokenizer.digit_ids)
      target = [t for t in prompt if t in digit_ids][::-1]
    return rewards.reverse_reward(response_tokens, target, self._tokenizer.eos_id)

  # ---- supervised warm-up -------------------------------------------------------------------
  def sft_example(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Warm-start example `index`: the reference answer, or with probability
    `distractor_prob` (a pure function of seed and index) the digits copied in order.

    The distractor makes the base policy competent but unreliable, as a pretrained model is:
    it can do the task and often does something else, which RL is there to fix.
    """
    problem = self.problem(index, "train")
    response = self.reference_response(problem)
    draw = np.random.default_rng([self.seed, 7, int(index)]).random()
    if draw < self.distractor_prob:
      copied = self._tokenizer.encode(problem.meta["digits"]).tolist()
      response = np.asarray(copied + [self._tokenizer.eos_id], np.int32)
    tokens = np.concatenate([problem.prompt_tokens, response]).astype(np.int32)
    loss_mask = np.concatenate([np.zeros(len(problem.prompt_tokens), np.float32),
                                np.ones(len(response), np.float32)])
    return tokens, loss_mask

  def sft_batch(self, rng: np.random.Generator, batch_size: int,
                seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    if batch_size < 1:
      raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if seq_len < self.max_sequence_len:
      raise ValueError(f"seq_len must be >= max_sequence_len={self.max_sequence_len} "
                       f"(max_len={self.max_len}), got {seq_len}")
    tokens = np.full((batch_size, seq_len), self._tokenizer.pad_id, np.int32)
    loss_mask = np.zeros((batch_size, seq_len), np.float32)
    for row, index in enumerate(rng.integers(0, 2**31 - 1, size=batch_size).tolist()):
      example_tokens, example_mask = self.sft_example(index)
      tokens[row, :len(example_tokens)] = example_tokens
      loss_mask[row, :len(example_mask)] = example_mask
    return tokens, loss_mask
