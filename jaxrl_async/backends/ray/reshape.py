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

from typing import Any

from jaxrl_async.backends import fleet_control
from jaxrl_async.backends.fleet_shape import new_shape, zero_counts
from jaxrl_async.backends.ray.actor import RESTART_WAIT_S


class Reshaping:
  """`RayFleet`'s changes of shape (module docstring). The fleet provides `actors`, `book`,
  `ray`, `_lock`, `_call`, `_each`, `_take_answer`, `_resize` and `_new_actor`. Pauses,
  resumes and snapshots hold the fleet's lock, so that a change of shape never meets a
  checkpoint or an evaluation."""

  def _init_reshaping(self, control_path: str | None) -> None:
    self.control_path = control_path  # fleet_control.py: 'add' / 'retire K' lines
    self._paused = False
    self._reshape_counts = zero_counts()

  def _apply_control(self) -> None:
    """The control file's commands; while paused (a checkpoint or an evaluation is being made
    from the actors' state) the file waits for the next heartbeat."""
    with self._lock:
      if self._paused or self.control_path is None:
        return
      adds, retires = fleet_control.read(self.control_path, self.num_servers, self.log)
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
      self.keep_leaving(health)
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
