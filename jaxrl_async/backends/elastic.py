"""A rollout fleet whose shape changes during a run: the part every backend's fleet shares.

The controller's heartbeat applies `<run_dir>/fleet_control` (`fleet_control.read`: `add` /
`retire K` lines), never while the fleet is paused for a checkpoint or an evaluation. A change
of shape restarts every server: each one pauses at a decode-step boundary (every rewarded
sample in the buffer), gives a last answer whose drops and reward counts stay in the run's
totals (`Fleet.keep_leaving`), and leaves; the prompts none of them drew and their unfinished
groups are re-dealt to the new fleet (`fleet_shape.new_shape`), each group re-issued exactly
once under `runtime/reissued_groups/server_retired` (a retired server's) or `.../fleet_resized`
(the others'), and the new servers' group ids start above every id drawn so far. Counted:
`fleet/adds`, `fleet/retires` (the loop reports `fleet/size`).

Pauses, resumes and snapshots hold the fleet's lock, so that a change of shape never meets a
checkpoint or an evaluation. A backend's fleet provides `_lock`, `num_servers`,
`closed_segments`, `group_starts`, `log`, `heartbeat_timeout_s`, `_each(method, timeout)` (a
call to every server) and two steps: `_take_down(index)` (a paused server leaves -> its orphan
as `fleet_shape.new_shape` takes it) and `_start_shape(restores)` (the new servers, one per
restore, started).
"""

from __future__ import annotations

from jaxrl_async.backends import fleet_control, fleet_shape


class Elastic:
  """Adds and retires servers of a running fleet (module docstring)."""

  control_path: str | None = None  # fleet_control.py: 'add' / 'retire K' lines

  def _init_elastic(self, control_path: str | None) -> None:
    self.control_path = control_path
    self.elastic_counts = fleet_shape.zero_counts()
    self._paused = False

  def pause(self, timeout: float | None = None) -> None:
    """Pauses every server (default timeout: 3 heartbeat timeouts, at least 30 s); a change of
    shape under way ends first, and none starts until `resume`."""
    timeout = self._pause_timeout() if timeout is None else timeout
    with self._lock:
      self._each("pause", timeout)
      self._paused = True

  def resume(self, timeout: float = 30.0) -> None:
    with self._lock:
      self._paused = False
      self._each("resume", timeout)

  def snapshots(self, timeout: float = 30.0) -> list[dict]:
    """While paused: every server's snapshot (groups in flight, next group id, prompts)."""
    with self._lock:
      return self._each("snapshot", timeout)

  def _pause_timeout(self) -> float:
    return max(3 * self.heartbeat_timeout_s, 30.0)

  def _apply_control(self) -> None:
    """The control file's commands; while paused (a checkpoint or an evaluation is being made
    from the servers' state) the file waits for the next heartbeat."""
    with self._lock:
      if self._paused:
        return
      adds, retires = fleet_control.read(self.control_path, self.num_servers, self.log)
      if adds or retires:
        self.reshape(adds, retires)

  def reshape(self, adds: int, retires: list[int]) -> None:
    """Adds `adds` servers and retires servers `retires` (module docstring)."""
    with self._lock:
      count = self.num_servers + adds - len(retires)
      if count < 1:
        raise ValueError(f"reshape: retiring {retires} would leave no rollout server")
      self._each("pause", self._pause_timeout())
      orphans = [self._take_down(index) for index in range(self.num_servers)]
      shape = fleet_shape.new_shape(orphans, retires, self.closed_segments, self.group_starts,
                                    count)
      for key, value in shape.reissued.items():
        self.elastic_counts[key] += value
      self.elastic_counts["fleet/adds"] += adds
      self.elastic_counts["fleet/retires"] += len(retires)
      self.log(f"rollout fleet: {self.num_servers} -> {count} servers (added {adds}, retired "
               f"{sorted(retires)}); {sum(len(o['rollout']['inflight']) for o in orphans)} "
               "groups re-issued")
      self.closed_segments, self.group_starts = shape.closed_segments, shape.group_starts
      self._start_shape(shape.restores)
