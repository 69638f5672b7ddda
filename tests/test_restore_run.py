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
    prompts.states = self.run_state.get("prompts", [])
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


def test_a_different_number_of_rollout_servers_is_re_dealt_and_says_so():
  servers = [{"next_group_id": 6, "inflight": [{"group_id": 4, "problem": {}, "missing": [1]}]},
             {"next_group_id": 5, "inflight": []}]
  checkpointer = _Checkpointer({"rollout": {"backend": "processes", "servers": servers},
                                "prompts": [{"next_index": 3}, {"next_index": 2}]})
  said = []
  _, _, restores, (closed, starts) = restore_run(checkpointer, _parts(3), log=said.append)
  assert "saved by 2 rollout servers (processes backend)" in said[0] and "to 3" in said[0]
  assert closed == [[0, 2, 6], [1, 2, 5]] and starts == [6, 7, 8]
  assert [r["rollout"]["next_group_id"] for r in restores] == starts
  assert [len(r["rollout"]["inflight"]) for r in restores] == [1, 0, 0]
  # shard 0 drew positions 0, 2, 4 and shard 1 drew 1, 3: the new tails start at 6
  assert [r["prompts"]["first"] for r in restores] == [6, 7, 8]
  assert [r["prompts"]["holes"] for r in restores] == [[5], [], []]


def test_prompt_states_that_do_not_match_the_servers_are_refused():
  checkpointer = _Checkpointer({"rollout": {"backend": "processes", "servers": [
      {"next_group_id": 0, "inflight": []}]}, "prompts": []})
  with pytest.raises(ValueError, match="1 servers' rollout states but 0 prompt states"):
    restore_run(checkpointer, _parts(1), log=lambda *a: None)


def test_no_checkpoint_starts_from_scratch_and_says_so():
  class Empty(_Checkpointer):
    def restore_latest(self, state, prompts):
      return None

  said = []
  assert restore_run(Empty({}), _parts(1), log=said.append) is None
  assert said and "starting from scratch" in said[0]
