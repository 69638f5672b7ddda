"""What Ray restarts need beside the run's buffer service: who holds each rollout server's work.

`ClaimBook` sits beside a `BufferService` (in the buffer actor, or in the driver beside the
buffer it serves) and keeps, per rollout server index, the client id of its live incarnation:
a new incarnation `claim`s its predecessor's unfinished groups (revoked from the dead client)
and prompt shard, and the re-issues are counted by reason. The driver hands each server's
restore over with `set_restores`; a server that is between its claim and the end of its
constructor is `constructing` (the heartbeat does not count its silence). When the driver
changes the fleet's shape during the run (`reshape.Reshaping`), every server is `release`d (its
client revoked, its work returned to the driver) and the new fleet's shares are handed over
with `reshape`: each new actor's first claim starts from its share as dealt, admissions held.
"""

from __future__ import annotations

import threading
from typing import Any

from jaxrl_async.backends import fleet_shape

REVOKE_TIMEOUT_S = 120.0  # a dead client's calls still running in the service end by then
REISSUE_REASONS = ("actor_restarted", "server_unresponsive")


class ClaimBook:
  """Per rollout server: its live client id, where its shard started, and why it restarted."""

  def __init__(self, service, group_size: int):
    self.service = service  # the BufferService whose clients are claimed
    self.group_size = int(group_size)
    self._claims = threading.Lock()
    self._client_ids: dict[int, str] = {}  # rollout server index -> its live client id
    self._generation: dict[int, int] = {}
    self._initial: dict[int, dict] = {}  # where each server's shard started
    self._unresponsive: set[int] = set()
    self._constructing: set[int] = set()  # servers between claim and ready
    self._restarts = 0
    self._restores_given = threading.Event()
    self._restores: list = []  # where each server starts, handed over by the driver's start
    # the restores are a reshape's shares (revoked groups hold their admissions), not a
    # checkpoint's snapshots (whose admissions did not carry)
    self._dealt = False
    self._reissue_counts = {f"runtime/reissued_{kind}/{reason}": 0
                            for kind in ("groups", "samples") for reason in REISSUE_REASONS}

  def claim(self, index: int, restore: dict | None, restarted: bool) -> dict[str, Any]:
    """A client id for rollout server `index` and what it starts from: `restore` (a
    checkpoint's snapshot, or None) on its first start; after a restart, the groups its
    predecessor left unfinished (revoked from the dead client, counted) and its prompt shard."""
    from jaxrl_async.backends.rollout_server import first_start

    with self._claims:
      self._generation[index] = self._generation.get(index, 0) + 1
      client_id = f"rollout-{index}-{self._generation[index]}"
      previous = self._client_ids.get(index)
      if restarted and previous is not None:
        restore = self._take_over(index, previous)
      elif self._dealt:
        self._initial[index] = {"prompts": restore.get("prompts"),
                                "next_group_id": restore["rollout"]["next_group_id"]}
      else:
        restore, self._initial[index] = first_start(restore, index)
      rollout = restore["rollout"]
      holding = [entry for entry in rollout.get("inflight", [])
                 if entry.get("admitted") or entry["missing"] != list(range(self.group_size))]
      self.service.register(client_id, inflight=holding, prompt_state=restore.get("prompts"),
                            next_group_id=rollout.get("next_group_id"))
      self._client_ids[index] = client_id
      self._constructing.add(index)
      return {"client_id": client_id, "restore": restore}

  def _take_over(self, index: int, previous: str) -> dict[str, Any]:
    """The restore of server `index`'s new incarnation: the dead client's unfinished groups
    and prompt position (revoked, counted by why it restarted)."""
    reason = "server_unresponsive" if index in self._unresponsive else "actor_restarted"
    self._unresponsive.discard(index)
    restore = self._revoke(index, previous)
    inflight = restore["rollout"]["inflight"]
    self._reissue_counts[f"runtime/reissued_groups/{reason}"] += len(inflight)
    self._reissue_counts[f"runtime/reissued_samples/{reason}"] += sum(
        len(entry["missing"]) for entry in inflight)
    self._restarts += 1
    return restore

  def _revoke(self, index: int, client_id: str) -> dict[str, Any]:
    """Client `client_id` of server `index` revoked: its unfinished groups (admissions held)
    and prompt position, where its shard started when it left none."""
    return fleet_shape.orphan(self.service.revoke(client_id, REVOKE_TIMEOUT_S),
                              self._initial[index])

  def set_restores(self, restores: list) -> None:
    """The driver's fleet starts: what each rollout server starts from (a checkpoint's
    snapshot, or None)."""
    self._restores = list(restores)
    self._dealt = False
    self._restores_given.set()

  def release(self, index: int) -> dict[str, Any]:
    """Server `index` leaves at a change of the fleet's shape (its actor killed for good): its
    live client revoked -> `{'rollout': {'inflight', 'next_group_id'}, 'prompts'}`, its
    unfinished groups and prompt position for the driver to re-deal."""
    with self._claims:
      client_id = self._client_ids.pop(index)
      self._unresponsive.discard(index)
      self._constructing.discard(index)
      return self._revoke(index, client_id)

  def reshape(self, restores: list[dict]) -> None:
    """The fleet's new shape, every old server released: what each new server starts from (a
    share dealt by `fleet_shape.redeal`, its groups' admissions held). Ray restarts of the new
    actors claim from their first incarnation as before."""
    with self._claims:
      if self._client_ids:
        raise ValueError(f"reshape with servers {sorted(self._client_ids)} not released")
      self._initial = {}
      self._restores = list(restores)
      self._dealt = True
      self._restores_given.set()

  def restore_for(self, index: int, wait_s: float) -> tuple[bool, Any]:
    """(given, restore) of rollout server `index`, waiting at most `wait_s` for the driver."""
    if not self._restores_given.wait(wait_s):
      return False, None
    return True, self._restores[index]

  def ready(self, index: int) -> None:
    """Server `index` has finished starting (its constructor ran to the end)."""
    with self._claims:
      self._constructing.discard(index)

  def constructing(self, index: int) -> bool:
    with self._claims:
      return index in self._constructing

  def note_unresponsive(self, index: int) -> None:
    """The driver is about to kill server `index` for silence: its successor counts why."""
    with self._claims:
      self._unresponsive.add(index)

  def restarts(self) -> int:
    with self._claims:
      return self._restarts

  def reissue_counts(self) -> dict[str, int]:
    with self._claims:
      return dict(self._reissue_counts)
