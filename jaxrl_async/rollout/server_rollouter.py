"""The Rollouter role against a `BufferClient` that may be in another process.

Same loop and semantics as `rollout/rollouter.py`; what changes is how it meets the buffer:
- the samples finished by one step go in one `put_many` call (one call per batch);
- admission asks once per turn for as many groups as the slots have room for, naming the groups
  it would start (`starts`), so the buffer records the admitted ones in the same call. Prompts
  drawn for groups that were not admitted wait in `_peeked` for the next turn;
- group ids advance by `group_id_stride` (server k of K: k, k + K, ...);
- after a weight swap the new version reaches the buffer with the next admission ask
  (`holding_version`), in the same round trip; only a turn that asks nothing publishes it alone;
- once the buffer has admitted fewer groups than asked, the window is spent: the server asks
  again only under a new version (a new window) or after `poll_s` (a drop may have refunded a
  slot), not at every decode step. Each ask is a round trip to the learner's process, which
  cost the loop about a fifth of its time when it asked at every step.
"""

from __future__ import annotations

import time
from typing import Any

from jaxrl_async.buffer import BufferClosed
from jaxrl_async.buffer.client import as_buffer_client
from jaxrl_async.rollout.decisions import admission_room
from jaxrl_async.rollout.rollouter import Rollouter


class ServerRollouter(Rollouter):

  def __init__(self, *, group_id_stride: int = 1, **kwargs):
    super().__init__(**kwargs)
    if not isinstance(group_id_stride, int) or group_id_stride < 1:
      raise ValueError(f"group_id_stride must be an int >= 1, got {group_id_stride!r}")
    self.buffer = as_buffer_client(self.buffer)
    self.group_id_stride = group_id_stride
    self._peeked: list[dict[str, Any]] = []  # drawn, not admitted yet (no admission held)
    self._spent: tuple[int, float] | None = None  # (version, when) the window ran out
    self._unannounced: int | None = None  # swapped to, not yet told to the buffer
    self.counts["unstarted_shutdown"] = 0  # drawn prompts never admitted, at the stop

  def _holds_admission(self, entry: dict) -> bool:
    return bool(entry.get("admitted")) or entry["missing"] != list(range(self.group_size))

  def _draw(self) -> dict[str, Any]:
    problem = next(self.prompts)
    entry = {"problem": problem.to_dict(), "group_id": self.next_group_id,
             "missing": list(range(self.group_size))}
    self.next_group_id += self.group_id_stride
    entry["prompt_state"] = self.prompts.get_state()
    entry["next_group_id"] = self.next_group_id
    return entry

  def _hold_version(self, version: int) -> None:
    self._unannounced = version  # goes with this turn's admission ask (`_admit`)

  def _admit(self) -> None:
    self._admit_groups()
    if self._unannounced is not None:  # no ask this turn: the buffer must still learn it
      version, self._unannounced = self._unannounced, None
      self.buffer.publish_version(version)

  def _admit_groups(self) -> None:
    if self._draining:
      return
    limit = admission_room(self.batcher.engine.max_concurrent_decodes, self.group_size)
    load = self.batcher.num_active + self.batcher.num_pending
    waiting = []
    for entry in self._reissue:  # groups that already hold an admission start at once
      if load < limit and self._holds_admission(entry):
        self._start_group(entry)
        load += len(entry["missing"])
      else:
        waiting.append(entry)
    self._reissue = waiting
    candidates, peeked = [], 0
    for entry in self._reissue:
      if load >= limit:
        break
      candidates.append(entry)
      load += len(entry["missing"])
    while load < limit:
      if peeked == len(self._peeked):
        self._peeked.append(self._draw())
      candidates.append(self._peeked[peeked])
      peeked += 1
      load += self.group_size
    if not candidates or self._window_spent():
      return
    count = self.buffer.acquire_group_slots(len(candidates), 0, starts=candidates,
                                            holding_version=self.batcher.version)
    self._unannounced = None  # published by that call
    self._spent = ((self.batcher.version, time.monotonic()) if count < len(candidates)
                   else None)
    for entry in candidates[:count]:
      if self._reissue and entry is self._reissue[0]:
        self._reissue.pop(0)
      else:
        self._peeked.pop(0)
      self._start_group(entry)

  def _window_spent(self) -> bool:
    """The buffer refused a group under this version less than poll_s ago."""
    if self._spent is None:
      return False
    version, when = self._spent
    if version == self.batcher.version and time.monotonic() - when < self.poll_s:
      return True
    self._spent = None
    return False

  def _wait_for_work(self) -> None:
    """Nothing to generate and no admission: wait for a new version, at most poll_s."""
    self.channel.wait_for_version(self.batcher.version, timeout=self.poll_s)

  def snapshot(self) -> dict[str, Any]:
    """As the Rollouter's, with the drawn but unadmitted prompts as groups to re-issue (the
    prompt iterator is past them)."""
    snapshot = super().snapshot()
    drawn = [{"problem": e["problem"], "group_id": e["group_id"], "missing": e["missing"]}
             for e in self._peeked]
    inflight = [{k: v for k, v in entry.items() if k != "admitted"}
                for entry in snapshot["inflight"]]
    return {"next_group_id": self.next_group_id, "inflight": inflight + drawn}

  # ---- hand-off: one call per batch ----------------------------------------------------------
  def _put_scored(self, samples) -> None:
    """One `put_many` call for the whole batch."""
    put = len(samples)
    try:
      self.buffer.put_many(samples, timeout=self.put_timeout_s)
    except BufferClosed as error:
      put = getattr(error, "num_put", 0)
      self._count_shutdown(samples[put:])
    except BaseException as error:  # a full buffer past its timeout, a revoked server
      put = getattr(error, "num_put", 0)
      self._fail(error)
    with self._lock:
      for sample in samples[:put]:
        entry = self._inflight.get(sample.group_id)
        if entry is not None:
          entry["missing"].discard(int(sample.meta["index_in_group"]))
          if not entry["missing"]:
            del self._inflight[sample.group_id]

  def _shutdown_accounting(self) -> None:
    """As the Rollouter's, and the prompts drawn for groups the buffer had not admitted yet:
    their group ids are taken (the prompt iterator is past them), so they end as 'shutdown'
    drops too, counted apart (`unstarted_shutdown`) from the started samples the stop aborted.
    A checkpoint after the stop re-issues them instead (`snapshot`)."""
    super()._shutdown_accounting()
    uids = [(entry["group_id"], index) for entry in self._peeked for index in entry["missing"]]
    with self._lock:
      self.counts["unstarted_shutdown"] += len(uids)
      if uids:
        self._drop_log.append(("shutdown", uids))
