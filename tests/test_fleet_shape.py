"""Re-dealing prompts and group ids when the number of rollout servers changes: every position
of the prompt stream and every group id is drawn once, whatever the counts."""

import random

import pytest

from jaxrl_async.backends import fleet_shape
from jaxrl_async.tasks import prompt_stream


class _Task:
  """A task whose problem is its index (the stream's order is what is checked)."""

  def problem(self, index, split):
    assert split == "train"
    return index


def _draw(shard, n):
  return [next(shard) for _ in range(n)]


def test_a_fresh_share_of_k_servers_is_every_kth_position_of_the_single_stream():
  single = prompt_stream.StreamShard(_Task(), seed=3, index=0, count=1, epoch_size=10)
  whole = _draw(single, 30)  # three epochs, each a new permutation of 0..9
  assert sorted(whole[:10]) == list(range(10)) and whole[10:20] != whole[:10]
  for k in range(3):
    shard = prompt_stream.StreamShard(_Task(), seed=3, index=k, count=3, epoch_size=10)
    assert _draw(shard, 10) == whole[k::3]


def test_a_grain_iterator_state_reads_as_the_tail_of_its_shard():
  assert prompt_stream.share_state({"next_index": 4}, 1, 3) == {
      "first": 1, "stride": 3, "next_index": 4, "holes": []}
  with pytest.raises(ValueError, match="lacks"):
    prompt_stream.share_state({"stride": 2}, 0, 1)


@pytest.mark.parametrize("old,new", [(2, 1), (2, 3), (3, 2), (1, 4)])
def test_redeal_draws_every_position_once(old, new):
  rng = random.Random(old * 10 + new)
  epoch = _draw(prompt_stream.StreamShard(_Task(), seed=1, index=0, count=1, epoch_size=500),
                500)
  position_of = {value: p for p, value in enumerate(epoch)}
  states, count, drawn = [None] * old, old, []
  for life in range(3):  # old -> new -> old servers, each drawing a random number of prompts
    shards = []
    for k, state in enumerate(states):
      shard = prompt_stream.StreamShard(_Task(), seed=1, index=k, count=count, epoch_size=500)
      if state is not None:
        shard.set_state(state)
      drawn.extend(position_of[v] for v in _draw(shard, rng.randrange(0, 15)))
      shards.append(shard)
    count = new if life % 2 == 0 else old
    states = prompt_stream.redeal_prompts([s.get_state() for s in shards], count)
  assert len(drawn) == len(set(drawn)) and drawn, "a position was drawn twice"
  frontier = min(state["first"] for state in states)
  assert [state["first"] for state in states] == list(range(frontier, frontier + count))
  holes = [p for state in states for p in state["holes"]]
  assert sorted(drawn + holes) == list(range(frontier)), "a position was skipped"


def test_group_ids_of_a_resized_fleet_never_collide():
  # two servers drew 0, 2, 4 and 1, 3; three servers then start at 6, 7, 8
  closed = fleet_shape.close([], [0, 1], [6, 5])
  assert closed == [[0, 2, 6], [1, 2, 5]] and fleet_shape.id_base(closed) == 6
  later = fleet_shape.close(closed, [6, 7, 8], [12, 10, 8])
  assert fleet_shape.group_ids(later) == [0, 1, 2, 3, 4, 6, 7, 9]
  # a resumed life of the same shape extends its segments instead of adding new ones
  assert fleet_shape.close(closed, [6, 5], [8, 7]) == [[0, 2, 8], [1, 2, 7]]
  with pytest.raises(ValueError, match="below its start"):
    fleet_shape.close([], [4], [2])


def test_redeal_deals_unfinished_groups_once_and_refuses_them_twice():
  servers = [{"rollout": {"inflight": [{"group_id": 2, "missing": [0]},
                                       {"group_id": 4, "missing": [1]}]},
              "prompts": {"next_index": 3}},
             {"rollout": {"inflight": [{"group_id": 3, "missing": [0, 1]}]},
              "prompts": {"next_index": 2}}]
  restores = fleet_shape.redeal(servers, 2, 6)
  dealt = [[e["group_id"] for e in r["rollout"]["inflight"]] for r in restores]
  assert dealt == [[2, 4], [3]]
  assert [r["rollout"]["next_group_id"] for r in restores] == [6, 7]
  servers[1]["rollout"]["inflight"].append({"group_id": 2, "missing": [1]})
  with pytest.raises(ValueError, match="held by two servers"):
    fleet_shape.redeal(servers, 2, 6)
  with pytest.raises(ValueError, match="at or above"):
    fleet_shape.redeal(servers[:1], 1, 3)


def test_redeal_refuses_shares_that_do_not_tile_the_stream():
  with pytest.raises(ValueError, match="do not tile"):
    same = {"first": 0, "stride": 2, "next_index": 1, "holes": []}
    prompt_stream.redeal_prompts([same, same], 1)
  with pytest.raises(ValueError, match="at least one rollout server"):
    prompt_stream.redeal_prompts([None], 0)
