"""RL with verifiable rewards on a reasoning model, shaped onto the built-in digit-reverse task:
response lengths with a published long tail, and a verifier that is a separate service.

Lengths: `length_quantiles` is a published response-length CDF as (quantile, tokens) points of
a run whose length cap was `source_max_response_len`; the default is the code task of
RollPacker's characterisation (Qwen2.5-14B, GRPO, 16k cap; docs/workloads.md gives every
figure and its source). The CDF is interpolated linearly in log(length) between the points
(a repeated length is a point mass, e.g. the responses cut at the cap), scaled so that the
published cap falls on this task's cap `max_len + 1` (digits and <eos>), and discretised: the
task's response length r = L + 1 has the published mass of [(r - 1/2) / s, (r + 1/2) / s] with
s = (max_len + 1) / source_max_response_len (the first length takes everything below, the cap
everything above). So the scaled median, p90, p99 and share cut at the cap are the published
ones, to within the rounding of a short response.

Verifier: `services(log)` starts the verifier service (`verifier_service.VerifierProcess`) and
yields a copy of the task whose `reward` calls it; a run enters it before anything is built, so
every rollout server on this host (threads, processes, Ray) shares one service (it listens on
127.0.0.1 only) and its concurrency limit.
Training answers (split 'train') go to the service; held-out answers (split 'eval') are
checked locally when `score_eval_locally` (the default), so evaluation measures the policy,
not the verifier's queue. A task outside `services` (a unit test, a benchmark that builds a run
by hand) checks every answer locally: the reward is the same exact check either way, only its
timing differs, and `data_metrics()['verifier/requests']` says which one a run used.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxrl_async.tasks.reverse import DigitReverseTask
from jaxrl_async.tasks.verifier_service import VerifierClient, VerifierProcess, VerifierSettings

# Response length (tokens) at each quantile of RollPacker's Figure 2a, code task, read from the
# figure's vector data (docs/workloads.md): the 16384-token cap cuts about 0.9% of responses.
ROLLPACKER_CODE_LENGTHS = ((0.0, 73), (0.25, 481), (0.5, 663), (0.75, 945), (0.9, 1667),
                           (0.95, 2815), (0.971, 4110), (0.9898, 15135), (0.9909, 16384),
                           (1.0, 16384))
ROLLPACKER_MAX_RESPONSE_LEN = 16384


def check_quantiles(quantiles: Sequence[Sequence[float]], source_max_len: int) -> np.ndarray:
  """The (quantile, length) points as float64 [K, 2], or ValueError naming what is wrong."""
  try:
    points = np.asarray(quantiles, np.float64)
  except (TypeError, ValueError):
    points = np.zeros((0,))
  if points.ndim != 2 or points.shape[1] != 2 or len(points) < 2:
    raise ValueError(f"length_quantiles must be >= 2 (quantile, tokens) pairs, got {quantiles!r}")
  q, lengths = points[:, 0], points[:, 1]
  if q[0] != 0.0 or q[-1] != 1.0 or np.any(np.diff(q) <= 0):
    raise ValueError(f"length_quantiles' quantiles must rise strictly from 0.0 to 1.0, got "
                     f"{q.tolist()}")
  if lengths[0] < 1 or np.any(np.diff(lengths) < 0) or lengths[-1] > source_max_len:
    raise ValueError(f"length_quantiles' lengths must be non-decreasing in [1, "
                     f"source_max_response_len={source_max_len}], got {lengths.tolist()}")
  return points


def source_cdf(points: np.ndarray, tokens: np.ndarray) -> np.ndarray:
  """P(length <= tokens) of the published distribution (log-linear between the points)."""
  q, lengths = points[:, 0], points[:, 1]
  tokens = np.asarray(tokens, np.float64)
  # The last point at or below each length, and the next (longer) one: interpolate between.
  i = np.clip(np.searchsorted(lengths, tokens, side="right") - 1, 0, len(lengths) - 2)
  low, high = lengths[i], lengths[i + 1]
  fraction = np.log(np.maximum(tokens, low) / low) / np.log(np.maximum(high / low, 1 + 1e-12))
  cdf = q[i] + (q[i + 1] - q[i]) * np.clip(fraction, 0.0, 1.0)
  return np.where(tokens < lengths[0], 0.0, np.where(tokens >= lengths[-1], 1.0, cdf))


def scaled_response_lengths(points: np.ndarray, source_max_len: int, min_response: int,
                            max_response: int) -> tuple[np.ndarray, np.ndarray]:
  """(response lengths int [K], probabilities float64 [K]) on [min_response, max_response]:
  the published distribution with its cap scaled onto max_response (module docstring)."""
  scale = max_response / source_max_len
  responses = np.arange(min_response, max_response + 1)
  upper = source_cdf(points, (responses + 0.5) / scale)
  upper[-1] = 1.0
  probs = np.diff(np.concatenate([[0.0], upper]))
  return responses, probs / probs.sum()


class RLVRReverseTask(DigitReverseTask):
  """The digit-reverse task with published reasoning-RL response lengths and a verifier
  service; see the module docstring. Implements `base.Task` (and `services`, `data_metrics`).

  Args:
    seed, min_len, max_len, eval_fraction, holdout_min_len, distractor_prob: as in
      `DigitReverseTask`; the response cap max_len + 1 is where the published cap falls.
    length_quantiles: the published response-length CDF, (quantile, tokens) pairs from
      quantile 0.0 to 1.0.
    source_max_response_len: the published run's length cap, in its tokens.
    verifier: the verifier service's settings (`verifier_service.VerifierSettings`).
    score_eval_locally: check held-out answers here rather than in the service.
  """

  def __init__(self, seed: int = 0, *, min_len: int = 1, max_len: int = 95,
               length_quantiles: Sequence[Sequence[float]] = ROLLPACKER_CODE_LENGTHS,
               source_max_response_len: int = ROLLPACKER_MAX_RESPONSE_LEN,
               verifier: VerifierSettings = VerifierSettings(), score_eval_locally: bool = True,
               eval_fraction: float = 0.1, holdout_min_len: int = 3,
               distractor_prob: float = 0.6):
    if (not isinstance(source_max_response_len, (int, np.integer))
        or source_max_response_len < 1):
      raise ValueError(f"source_max_response_len must be an int >= 1, got "
                       f"{source_max_response_len!r}")
    if not isinstance(verifier, VerifierSettings):
      raise TypeError(f"verifier must be a VerifierSettings, got {verifier!r}")
    slowest = verifier.latency_max_s * verifier.time_scale
    if verifier.call_timeout_s <= slowest:
      raise ValueError(
          f"VerifierSettings.call_timeout_s={verifier.call_timeout_s} must exceed the slowest "
          f"request, latency_max_s * time_scale = {verifier.latency_max_s} * "
          f"{verifier.time_scale} = {slowest:.3g} s: every timed-out request would fail")
    points = check_quantiles(length_quantiles, int(source_max_response_len))
    self.length_quantiles = tuple((float(q), float(n)) for q, n in points)
    self.source_max_response_len = int(source_max_response_len)
    self._points = points
    self.verifier = verifier
    self.score_eval_locally = bool(score_eval_locally)
    self._client: VerifierClient | None = None
    # DigitReverseTask checks the sizes and builds its length table from length_distribution().
    super().__init__(seed, min_len=min_len, max_len=max_len, eval_fraction=eval_fraction,
                     holdout_min_len=holdout_min_len, distractor_prob=distractor_prob)

  def __repr__(self) -> str:
    # The warm start's cache key: what shapes the problems, not where the verifier runs.
    return (f"RLVRReverseTask(seed={self.seed}, min_len={self.min_len}, max_len={self.max_len}, "
            f"length_quantiles={self.length_quantiles}, source_max_response_len="
            f"{self.source_max_response_len}, eval_fraction={self.eval_fraction}, "
            f"holdout_min_len={self.holdout_min_len}, distractor_prob={self.distractor_prob})")

  def length_distribution(self) -> tuple[np.ndarray, np.ndarray]:
    """(digit counts L int [K], probabilities float64 [K]): the response L + 1 follows the
    scaled published distribution."""
    responses, probs = scaled_response_lengths(self._points, self.source_max_response_len,
                                               self.min_len + 1, self.max_len + 1)
    return responses - 1, probs

  # ---- the verifier service -----------------------------------------------------------------
  @property
  def client(self) -> VerifierClient | None:
    """The service this copy calls (None: every answer is checked locally)."""
    return self._client

  def with_client(self, client: VerifierClient | None) -> RLVRReverseTask:
    """A copy of the task whose training rewards go to `client`'s service."""
    task = copy.copy(self)
    task._client = client
    return task

  @contextlib.contextmanager
  def services(self, log=print) -> Iterator[RLVRReverseTask]:
    """Starts the verifier service, yields the task to run with, stops the service on exit."""
    process = VerifierProcess.start(self.verifier)
    try:
      client = process.client()
      settings = self.verifier
      log(f"verifier: serving on {client.where} (pid {process.process.pid}), concurrency "
          f"{settings.concurrency}, median latency "
          f"{settings.latency_median_s * settings.time_scale * 1e3:.2f} ms, "
          f"{settings.timeout_fraction:.0%} at "
          f"{settings.latency_max_s * settings.time_scale * 1e3:.0f} ms")
      yield self.with_client(client)
      with contextlib.suppress(RuntimeError):
        stats = self.with_client(client).data_metrics()
        log(f"verifier: {stats['verifier/requests']:.0f} requests, at most "
            f"{stats['verifier/max_active']:.0f} at once, mean queue wait "
            f"{stats['verifier/queue_s_mean'] * 1e3:.2f} ms")
    finally:
      process.stop()

  def reward(self, prompt_tokens: np.ndarray, response_tokens: np.ndarray,
             meta: dict[str, Any]) -> float:
    """1.0 iff the response is the prompt's digits reversed and then <eos>: from the service
    for training answers once `services` is entered, else checked here (module docstring).
    Raises verifier_service.VerifierError (VerifierTimeout for no answer in time) when the
    service cannot answer; the reward pool counts those and never trains on them."""
    if self._client is None or (self.score_eval_locally and (meta or {}).get("split") == "eval"):
      return super().reward(prompt_tokens, response_tokens, meta)
    return self._client.verify(request_id(prompt_tokens, response_tokens), prompt_tokens,
                               response_tokens).reward

  def data_metrics(self) -> dict[str, float]:
    """The verifier service's counters for a run's summary (all zero without the service)."""
    if self._client is None:
      return {"verifier/requests": 0.0}
    stats = self._client.stats()
    done = max(stats["completed"] + stats["errors"], 1)
    return {"verifier/requests": float(stats["requests"]),
            "verifier/completed": float(stats["completed"]),
            "verifier/errors": float(stats["errors"]),
            "verifier/concurrency": float(stats["concurrency"]),
            "verifier/max_active": float(stats["max_active"]),
            "verifier/queue_s_mean": stats["queue_s"] / done,
            "verifier/queue_s_max": float(stats["max_queue_s"]),
            "verifier/service_s_mean": stats["service_s"] / done}


def request_id(prompt_tokens, response_tokens) -> int:
  """A 63-bit id of (prompt, response): the same answer takes the same time in the verifier,
  as the same program does in a sandbox."""
  digest = hashlib.blake2b(digest_size=8)
  for tokens in (prompt_tokens, response_tokens):
    digest.update(np.asarray(tokens, np.int64).reshape(-1).tobytes() + b"|")
  return int.from_bytes(digest.digest(), "little") >> 1
