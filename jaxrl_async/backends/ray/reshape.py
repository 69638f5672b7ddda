"""Rollout actors added and retired during a 'ray' run, through `<run_dir>/fleet_control`.

The driver's heartbeat (`RayFleet.check`) reads the control file (`backends.fleet_control`:
`add` / `retire K` lines), never while the fleet is paused for a checkpoint or an evaluation.
A change of shape restarts every actor, as the 'processes' fleet restarts every server: each
actor pauses at a decode-step boundary (every rewarded sample in the buffer), answers a last
health (its counts, drops and reward counts stay in the run's totals), is killed for good
(`no_restart`) and its buffer client revoked through the claim book (`ClaimBook.release`). The
prompts no actor drew and the unfinished groups are re-dealt to the new fleet
(`backends.fleet_shape`), whose group ids start above every id drawn so far; the claim book gets
the new shares (`ClaimBook.reshape`) and new actors, placed as `RayFleet.launch` places them,
start from them. Each unfinished group is re-issued exactly once, counted under
`runtime/reissued_groups/server_retired` (a retired actor's) or `.../fleet_resized` (the
others'), with their `runtime/reissued_samples/` twins. A new actor killed later is restarted by
Ray and claims its first incarnation's work as before. Metrics: `fleet/size` (the loop's),
`fleet/adds`, `fleet/retires`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxrl_async.backends import fleet_control, fleet_shape
from jaxrl_async.backends.ray.actor import RESTART_WAIT_S

RESHAPE_REASONS = ("server_retired", "fleet_resized")


@dataclasses.dataclass(frozen=True)
class NewShape:
  """A fleet shape dealt from the old actors' work: each new actor's restore, the group-id
  segments of the shapes that ended, the new actors' first group ids, the re-issues counted."""

  restores: list[dict]
  closed_segments: list
  group_starts: list[int]
  reissued: dict[str, int]


def zero_counts() -> dict[str, int]:
  """The elastic fleet's counts before any change of shape (reported from the start)."""
  counts = {f"runtime/reissued_{kind}/{reason}": 0
            for kind in ("groups", "samples") for reason in RESHAPE_REASONS}
  return {**counts, "fleet/adds": 0, "fleet/retires": 0}


def reissue_counts(orphans: list[dict], retires: list[int]) -> dict[str, int]:
  """The groups and samples the old actors left unfinished (`orphans`, in old actor order), by
  reason: 'server_retired' for the actors in `retires`, 'fleet_resized' for the others."""
  counts = {key: value for key, value in zero_counts().items() if key.startswith("runtime/")}
  for index, orphan in enumerate(orphans):
    reason = "server_retired" if index in retires else "fleet_resized"
    inflight = orphan["rollout"]["inflight"]
    counts[f"runtime/reissued_groups/{reason}"] += len(inflight)
    counts[f"runtime/reissued_samples/{reason}"] += sum(len(e["missing"]) for e in inflight)
  return counts


def new_shape(orphans: list[dict], retires: list[int], closed: list, starts: list[int],
              count: int) -> NewShape:
  """`count` actors' shape from the old ones' `orphans` (`ClaimBook.release`: unfinished
  groups, next group id, prompt position; old actor order), the segments of shapes that ended
  (`closed`) and where the old actors' ids started (`starts`)."""
  nexts = [int(orphan["rollout"]["next_group_id"]) for orphan in orphans]
  segments = fleet_shape.close(closed, starts, nexts)
  base = fleet_shape.id_base(segments)
  return NewShape(restores=fleet_shape.redeal(orphans, count, base), closed_segments=segments,
                  group_starts=[base + k for k in range(count)],
                  reissued=reissue_counts(orphans, retires))


class Reshaping:
  """`RayFleet`'s changes of shape (module docstring). The fleet provides `actors`, `book`,
  `ray`, `_lock`, `_call`, `_each`, `_take_answer`, `_resize` and `_new_actor`. Pauses,
  resumes and snapshots hold the fleet's lock, so that a change of shape never meets a
  checkpoint or an evaluation."""

  def _init_reshaping(self, control_path: str | None) -> None:
    self.control_path = control_path  # fleet_control.py: 'add' / 'retire K' lines
    self._paused = False
    self._reshape_counts = zero_counts()
    self._retired_drops: list = []  # drops of actors that left at a reshape
    self._retired_rewards: dict[str, int] = {}  # their reward pools' counts

  def _apply_control(self) -> None:
    """The control file's commands; while paused (a checkpoint or an evaluation is being made
    from the actors' state) the file waits for the next heartbeat."""
    with self._lock:
      if self._paused or self.control_path is None:
        return
      text = fleet_control.take(self.control_path)
      if text is None:
        return
      adds, retires, problems = fleet_control.parse(text, self.num_servers)
      for problem in problems:
        self.log(f"{fleet_control.CONTROL_FILE}: ignored {problem}")
      if adds or retires:
        self.reshape(adds, retires)

  def reshape(self, adds: int, retires: list[int]) -> None:
    """Adds `adds` actors and retires actors `retires` (module docstring)."""
    with self._lock:
      count = self.num_servers + adds - len(retires)
      if count < 1:
        raise ValueError(f"reshape: retiring {retires} would leave no rollout actor")
      pause_s = max(3 * self.heartbeat_timeout_s, 30.0)
      for index in range(self.num_servers):
        self._call(index, "pause", pause_s)
      orphans = [self._take_down(index) for index in range(self.num_servers)]
      shape = new_shape(orphans, retires, self.closed_segments, self.group_starts, count)
      for key, value in shape.reissued.items():
        self._reshape_counts[key] += value
      self._reshape_counts["fleet/adds"] += adds
      self._reshape_counts["fleet/retires"] += len(retires)
      self.log(f"rollout fleet: {self.num_servers} -> {count} actors (added {adds}, retired "
               f"{sorted(retires)}); {sum(len(o['rollout']['inflight']) for o in orphans)} "
               "groups re-issued")
      self.book.reshape(shape.restores)
      self.closed_segments, self.group_starts = shape.closed_segments, shape.group_starts
      self._resize(count)
      for index in range(count):  # their processes start together
        self._new_actor(index)
      for index in range(count):
        self._call(index, "start", RESTART_WAIT_S)

  def _take_down(self, index: int) -> dict[str, Any]:
    """Actor `index`, paused: its last health kept (counts, drops, reward counts), then killed
    for good and its client revoked -> its unfinished groups and prompt position."""
    try:
      health = self._call(index, "health", self.heartbeat_timeout_s)
      self._take_answer(index, health)
      self._retired_drops.extend(tuple(entry) for entry in health.get("drops", []))
      for name, count in health.get("reward_counts", {}).items():
        self._retired_rewards[name] = self._retired_rewards.get(name, 0) + int(count)
    except Exception as error:  # its counts since the last heartbeat are lost: reported
      self.log(f"rollout actor {index} gave no last health before leaving ({error!r})")
    self.ray.kill(self.actors[index], no_restart=True)
    self.retire(index)
    return self.book.release(index)

  def pause(self, timeout: float | None = None) -> None:
    """Pauses every actor. Under the fleet's lock: a change of shape under way ends first, and
    none starts until `resume`."""
    with self._lock:
      self._each("pause", max(3 * self.heartbeat_timeout_s, 30.0) if timeout is None
                 else timeout)
      self._paused = True

  def resume(self, timeout: float = 30.0) -> None:
    with self._lock:
      self._paused = False
      self._each("resume", timeout)

  def snapshots(self, timeout: float = 30.0) -> list[dict]:
    """While paused: every actor's snapshot (groups in flight, next group id, prompts)."""
    with self._lock:
      return self._each("snapshot", timeout)

  def reward_counts(self) -> dict[str, int]:
    """As `Fleet.reward_counts`, with the reward pools of actors that left at a reshape."""
    totals = super().reward_counts()
    for name, count in self._retired_rewards.items():
      totals[f"reward/{name}"] = totals.get(f"reward/{name}", 0) + count
    return totals

  def drop_log(self) -> list:
    """As `Fleet.drop_log`, with the drops of actors that left at a reshape."""
    return self._retired_drops + super().drop_log()
