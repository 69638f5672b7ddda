"""`restore_run` refuses a checkpoint it cannot resume from, naming why (no silent fallback)."""

import types

import pytest

from jaxrl_async.run.loop import restore_run


class _Checkpointer:
  """Stands in for RunCheckpointer: returns one stored (state, run_state, extra)."""

  directory = "/runs/r/checkpoints"

  def __init__(self, run_state):
    self.run_state = run_state

  def restore_latest(self, state, prompts):
    del prompts
    return state, self.run_state, None


def _parts(num_rollout_servers: int):
  return types.SimpleNamespace(
      config=types.SimpleNamespace(num_rollout_servers=num_rollout_servers),
      learner=types.SimpleNamespace(initial_state="state"))


def test_a_run_state_without_per_server_rollout_state_is_refused_as_an_older_layout():
  checkpointer = _Checkpointer({"rollout": {"backend": "threads"}})
  with pytest.raises(ValueError, match="older run-state layout") as error:
    restore_run(checkpointer, _parts(1), log=lambda *a: None)
  assert "/runs/r/checkpoints" in str(error.value)


def test_a_different_number_of_rollout_servers_is_refused_naming_both():
  checkpointer = _Checkpointer({"rollout": {"backend": "processes", "servers": [{}, {}]}})
  with pytest.raises(ValueError, match="num_rollout_servers=1") as error:
    restore_run(checkpointer, _parts(1), log=lambda *a: None)
  assert "2 rollout servers (processes backend)" in str(error.value)


def test_no_checkpoint_starts_from_scratch_and_says_so():
  class Empty(_Checkpointer):
    def restore_latest(self, state, prompts):
      return None

  said = []
  assert restore_run(Empty({}), _parts(1), log=said.append) is None
  assert said and "starting from scratch" in said[0]
