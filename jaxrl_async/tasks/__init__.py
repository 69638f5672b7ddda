"""Prompt sources (grain) and verifiers; the built-in digit-reverse task."""

from jaxrl_async.tasks.base import SPLITS, Problem, Task
from jaxrl_async.tasks.prompts import DEFAULT_EPOCH_SIZE, prompt_dataset
from jaxrl_async.tasks.reverse import DigitReverseTask, in_eval_split
from jaxrl_async.tasks.rewards import FlakyReward, RewardFn, accuracy, reverse_reward
from jaxrl_async.tasks.tokenizer import CharTokenizer

__all__ = [
    "DEFAULT_EPOCH_SIZE",
    "SPLITS",
    "CharTokenizer",
    "DigitReverseTask",
    "FlakyReward",
    "Problem",
    "RewardFn",
    "Task",
    "accuracy",
    "in_eval_split",
    "prompt_dataset",
    "reverse_reward",
]
