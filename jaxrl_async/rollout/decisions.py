"""The rollouter's decisions as pure functions, shared by `Rollouter`, `ServerRollouter` and the
simulator's rollouter, so all three swap weights, drain and admit groups by the same rules:

- a newer version in the weight channel: with `partial_rollout` off the rollouter stops starting
  samples and lets the ones in flight finish on the old weights (drains), then swaps; with it on
  it swaps at the next decode-step boundary and resumes the interrupted samples by
  `partial_strategy`;
- it admits new groups while it is not draining and its slots have room; right after a swap
  with samples in flight it steps before it asks;
- it runs a decode step while samples are in flight, or pending ones may start.
"""

from __future__ import annotations

KEEP = "keep"  # no newer version: keep the weights
DRAIN = "drain"  # a newer version, samples in flight, no partial rollouts: finish them first
SWAP = "swap"  # take the newer version now


def on_new_version(latest: int, held: int, *, partial_rollout: bool, in_flight: bool) -> str:
  """KEEP, DRAIN or SWAP, given the newest published version and the one the engine holds.

  Without partial rollouts a sample must be drawn by one version, so the swap waits until no
  sample is in flight (`in_flight`); with them the samples are interrupted and resumed."""
  if latest <= held:
    return KEEP
  if not partial_rollout and in_flight:
    return DRAIN
  return SWAP


def resume_strategy(partial_rollout: bool, partial_strategy: str) -> str | None:
  """How a swap resumes interrupted samples; None: nothing is interrupted (without partial
  rollouts a swap happens only once the slots are empty)."""
  return partial_strategy if partial_rollout else None


def admission_room(slots: int, group_size: int) -> int:
  """The most samples active plus pending: the slots and one whole group more, so the slots
  refill at the next step without waiting for an admission."""
  return slots + group_size


def may_admit(*, draining: bool, load: int, slots: int, group_size: int) -> bool:
  """Whether one more group may be started (the buffer's admission has the final word)."""
  return not draining and load < admission_room(slots, group_size)


def admit_first(*, swapped: bool, active: int) -> bool:
  """Ask for admission before this turn's decode step. Right after a swap with samples in flight
  the step comes first: their next tokens, the first work under the new version, wait for no
  admission round trip (on the processes and Ray backends one to the learner's process); the
  ask follows at the next turn."""
  return not (swapped and active > 0)


def should_step(*, active: int, pending: int, draining: bool) -> bool:
  """Run a decode step: samples are in flight, or pending ones may start (not while draining:
  a drain starts nothing new)."""
  return active > 0 or (pending > 0 and not draining)
