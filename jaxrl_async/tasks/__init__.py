"""Prompt sources (grain) and verifiers: the built-in digit-reverse task, dataset files with
Hugging Face tokenizers, math and code rewards.

Names are imported on first use, so a process that needs one module (a reward worker importing
`tasks.math_rewards`, say) does not import grain and numpy-heavy modules with it.
"""

import importlib

_EXPORTS = {
    "SPLITS": "base", "Problem": "base", "Task": "base",
    "DEFAULT_EPOCH_SIZE": "prompts", "prompt_dataset": "prompts",
    "DigitReverseTask": "reverse", "in_eval_split": "reverse",
    "FlakyReward": "rewards", "RewardFn": "rewards", "accuracy": "rewards",
    "reverse_reward": "rewards",
    "CharTokenizer": "tokenizer",
    "HFTokenizer": "hf_tokenizer",
    "Fields": "datasets",
    "TextTask": "text_task",
    "MathReward": "math_rewards",
    "SubprocessReward": "subprocess_reward",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jaxrl_async.tasks' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"jaxrl_async.tasks.{_EXPORTS[name]}"), name)
  globals()[name] = value
  return value


def __dir__():
  return sorted(set(globals()) | set(_EXPORTS))
