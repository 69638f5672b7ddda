"""Rollout actors added and retired during a 'ray' run, through `<run_dir>/fleet_control`.

The steps every elastic fleet shares are `backends.elastic.Elastic`'s (read at the driver's
heartbeat, `RayFleet.check`). On Ray a leaving actor, once paused and answered, is killed for
good (`no_restart`) and released from the claim book (`ClaimBook.release`: its buffer client
revoked, its unfinished groups and prompt position returned); the claim book then gets the new
shares (`ClaimBook.reshape`) and new actors, placed as `RayFleet.launch` places them, start from
them. A new actor killed later is restarted by Ray and claims its first incarnation's work as
before.
"""

from __future__ import annotations

from typing import Any

from jaxrl_async.backends.elastic import Elastic
from jaxrl_async.backends.ray.actor import RESTART_WAIT_S


class Reshaping(Elastic):
  """`RayFleet`'s changes of shape (module docstring). The fleet provides `actors`, `book`,
  `ray`, `_call`, `_take_answer`, `_resize` and `_new_actor`, besides what `Elastic` asks."""

  def _start_shape(self, restores: list[dict]) -> None:
    """Actors for the new shape, started from `restores` through the claim book
    (`Elastic.reshape`)."""
    self.book.reshape(restores)
    self._resize(len(restores))
    for index in range(len(restores)):  # their processes start together
      self._new_actor(index)
    for index in range(len(restores)):
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
