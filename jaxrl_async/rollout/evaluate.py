"""Held-out evaluation: one sampled response per held-out problem, mean reward = accuracy.

Accuracy is measured under the policy as it samples (the rollout temperature), i.e. pass@1 with
sampling, with a fixed key per problem so two evaluations of the same weights agree exactly.
"""

from __future__ import annotations

import numpy as np

from jaxrl_async.rollout.generation import ContinuousBatcher, GenerationRequest, sample_key
from jaxrl_async.types import Sample

EVAL_SEED_OFFSET = 1_000_003  # keeps evaluation keys apart from training keys


def evaluate(batcher: ContinuousBatcher, task, problems, *, seed: int = 0) -> dict[str, float]:
  """Generate one response per problem with the batcher's current params; returns metrics."""
  requests = []
  for i, problem in enumerate(problems):
    sample = Sample(prompt_id=problem.prompt_id, group_id=i, group_size=1,
                    prompt_tokens=problem.prompt_tokens, meta=dict(problem.meta))
    requests.append(GenerationRequest(sample, sample_key(seed + EVAL_SEED_OFFSET, i, 0)))
  done = batcher.run_to_completion(requests)
  rewards, failed = [], 0
  for sample in done:
    try:
      value = float(task.reward(sample.prompt_tokens, sample.response_tokens, sample.meta))
    except Exception:  # a verifier error on a held-out problem scores 0 and is counted
      value = float("nan")
    if not np.isfinite(value):
      failed, value = failed + 1, 0.0
    rewards.append(value)
  rewards = np.asarray(rewards)
  lengths = np.asarray([s.num_response_tokens for s in done])
  return {
      "eval/accuracy": float(np.mean(rewards == 1.0)),
      "eval/reward_mean": float(np.mean(rewards)),
      "eval/response_len_mean": float(lengths.mean()),
      "eval/response_len_p50": float(np.percentile(lengths, 50)),
      "eval/response_len_p99": float(np.percentile(lengths, 99)),
      "eval/num_problems": float(len(done)),
      "eval/reward_failed": float(failed),
  }
