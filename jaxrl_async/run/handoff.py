"""Hand-off latency: how long a published version takes to reach the learner again as data.

For each policy version u the learner publishes, three instants on one machine's wall clock
(`time.time()`; across hosts the figures include the clocks' skew):

- published: the learner's `publish` of u began (so the interval includes the transfer);
- first enqueued: the first consumed sample carrying a token of u entered the buffer;
- first taken: the learner first took (consumed) such a sample.

Samples are seen as the learner consumes them, so "first enqueued" is over consumed samples
(a dropped sample of u that came earlier is not counted). `publish_to_enqueue_s` covers the
rollout side's load, admission, generation and reward; `enqueue_to_take_s` the wait in the
buffer (group assembly, the learner's pace). Plain bookkeeping: no threads, no clocks of its
own; the loop feeds it.
"""

from __future__ import annotations

import math

import numpy as np

INTERVALS = ("publish_to_enqueue_s", "enqueue_to_take_s", "publish_to_take_s")


class Handoffs:
  """The three instants per version, and the intervals between them. `published` (version ->
  when its publish began) is kept by the publisher (`LearnerRole.published_at`) and read here."""

  def __init__(self, published: dict[int, float]):
    self.published = published
    self.first_enqueued: dict[int, float] = {}
    self.first_taken: dict[int, float] = {}

  def observe(self, groups) -> None:
    """The samples of consumed groups (their `enqueued` and `consumed` timestamps)."""
    for group in groups:
      for sample in group:
        stamps = sample.timestamps
        if "enqueued" not in stamps or "consumed" not in stamps:
          continue
        for version in set(sample.token_versions.tolist()):
          enqueued = self.first_enqueued.get(version, math.inf)
          self.first_enqueued[version] = min(enqueued, stamps["enqueued"])
          taken = self.first_taken.get(version, math.inf)
          self.first_taken[version] = min(taken, stamps["consumed"])

  def intervals(self, version: int) -> dict[str, float] | None:
    """The version's three intervals (seconds), or None while one of its instants is unknown."""
    if not (version in self.published and version in self.first_enqueued):
      return None
    published, enqueued = self.published[version], self.first_enqueued[version]
    taken = self.first_taken[version]
    return {"publish_to_enqueue_s": enqueued - published, "enqueue_to_take_s": taken - enqueued,
            "publish_to_take_s": taken - published}

  def summary(self) -> dict[str, float]:
    """p50 and p99 of each interval over the versions whose instants are all known
    (`handoff/<interval>_p50|p99`, NaN without any), and how many versions that is."""
    rows = [row for row in map(self.intervals, sorted(self.published)) if row is not None]
    out: dict[str, float] = {"handoff/versions": float(len(rows))}
    for name in INTERVALS:
      values = [row[name] for row in rows]
      p50, p99 = np.percentile(values, [50, 99]) if values else (math.nan, math.nan)
      out[f"handoff/{name}_p50"], out[f"handoff/{name}_p99"] = float(p50), float(p99)
    return out
