"""Hand-off latency: how long a published version takes to reach the rollout and the learner.

For each policy version u the learner publishes, four instants on one machine's wall clock
(`time.time()`; across hosts the figures include the clocks' skew):

- published: the learner's `publish` of u began (so the intervals include the transfer);
- first work: the first decode call that drew a token of u began (`Sample.versions_began`), the
  moment the rollout side first worked under u: the hand-off of the weights proper;
- first enqueued: the first consumed sample carrying a token of u entered the buffer;
- first taken: the learner first took (consumed) such a sample.

Samples are seen as the learner consumes them, so each instant is over consumed samples (a
dropped sample of u that came earlier is not counted). `publish_to_work_s` covers the weight
transfer, the rollout side's load and its wait for a step boundary; `work_to_enqueue_s` the
generation and reward of the first sample carrying u; `enqueue_to_take_s` the wait in the buffer
(group assembly, the learner's pace). A sample without a first-work stamp (the simulator's)
leaves the first two intervals out. Plain bookkeeping: no threads, no clocks of its own; the
loop feeds it.
"""

from __future__ import annotations

import math

import numpy as np

INTERVALS = ("publish_to_work_s", "work_to_enqueue_s", "publish_to_enqueue_s",
             "enqueue_to_take_s", "publish_to_take_s")


class Handoffs:
  """The four instants per version, and the intervals between them. `published` (version ->
  when its publish began) is kept by the publisher (`LearnerRole.published_at`) and read here."""

  def __init__(self, published: dict[int, float]):
    self.published = published
    self.first_work: dict[int, float] = {}
    self.first_enqueued: dict[int, float] = {}
    self.first_taken: dict[int, float] = {}

  def observe(self, groups) -> None:
    """The samples of consumed groups (their `enqueued` and `consumed` timestamps)."""
    for group in groups:
      for sample in group:
        stamps = sample.timestamps
        if "enqueued" not in stamps or "consumed" not in stamps:
          continue
        for version, began in sample.versions_began().items():
          self.first_work[version] = min(self.first_work.get(version, math.inf), began)
        for version in set(sample.token_versions.tolist()):
          enqueued = self.first_enqueued.get(version, math.inf)
          self.first_enqueued[version] = min(enqueued, stamps["enqueued"])
          taken = self.first_taken.get(version, math.inf)
          self.first_taken[version] = min(taken, stamps["consumed"])

  def intervals(self, version: int) -> dict[str, float] | None:
    """The version's intervals (seconds), or None while its publish or first sample is unknown;
    without a first-work instant, the intervals that need it are left out."""
    if not (version in self.published and version in self.first_enqueued):
      return None
    published, enqueued = self.published[version], self.first_enqueued[version]
    taken = self.first_taken[version]
    out = {}
    if version in self.first_work:
      work = self.first_work[version]
      out = {"publish_to_work_s": work - published, "work_to_enqueue_s": enqueued - work}
    out.update({"publish_to_enqueue_s": enqueued - published, "enqueue_to_take_s": taken - enqueued,
                "publish_to_take_s": taken - published})
    return out

  def summary(self) -> dict[str, float]:
    """p50 and p99 of each interval over the versions where it is known
    (`handoff/<interval>_p50|p99`, NaN without any), and how many versions have a publish and a
    first sample (`handoff/versions`)."""
    rows = [row for row in map(self.intervals, sorted(self.published)) if row is not None]
    out: dict[str, float] = {"handoff/versions": float(len(rows))}
    for name in INTERVALS:
      values = [row[name] for row in rows if name in row]
      p50, p99 = np.percentile(values, [50, 99]) if values else (math.nan, math.nan)
      out[f"handoff/{name}_p50"], out[f"handoff/{name}_p99"] = float(p50), float(p99)
    return out
