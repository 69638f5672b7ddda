"""The 'ray' fleet's change of shape, without Ray: the old actors' work dealt to the new shape
(`fleet_shape.new_shape`), and the claim book releasing a server and starting the new shape's
servers from their shares, admissions held, with Ray restarts claiming as before."""

import pytest

from jaxrl_async.backends import fleet_shape
from jaxrl_async.backends.fleet_shape import new_shape, reissue_counts
from jaxrl_async.backends.ray.claims import ClaimBook

GROUP_SIZE = 2


def orphan(next_group_id, inflight, prompts=None):
  return {"rollout": {"inflight": inflight, "next_group_id": next_group_id}, "prompts": prompts}


def entry(group_id, missing=(0, 1)):
  return {"problem": {"id": group_id}, "group_id": group_id, "missing": list(missing),
          "admitted": True}


def test_two_actors_dealt_to_three_number_new_groups_above_every_drawn_id():
  # actor 0 drew 0, 2, 4 (4 unfinished), actor 1 drew 1, 3 (3 unfinished, one sample missing)
  orphans = [orphan(6, [entry(4)]), orphan(5, [entry(3, missing=[1])])]
  shape = new_shape(orphans, [1], [], [0, 1], 3)
  assert shape.group_starts == [6, 7, 8]
  assert fleet_shape.group_ids(shape.closed_segments) == [0, 1, 2, 3, 4]
  dealt = [[e["group_id"] for e in r["rollout"]["inflight"]] for r in shape.restores]
  assert dealt == [[3], [4], []]  # each unfinished group to exactly one new actor
  assert [r["rollout"]["next_group_id"] for r in shape.restores] == [6, 7, 8]
  assert shape.reissued == {"runtime/reissued_groups/server_retired": 1,
                            "runtime/reissued_samples/server_retired": 1,
                            "runtime/reissued_groups/fleet_resized": 1,
                            "runtime/reissued_samples/fleet_resized": 2}


def test_no_unfinished_group_still_reports_every_count():
  assert set(reissue_counts([orphan(0, [])], [])) == {
      f"runtime/reissued_{kind}/{reason}" for kind in ("groups", "samples")
      for reason in ("server_retired", "fleet_resized")}


class FakeService:
  """The buffer service's register / revoke bookkeeping (what a `ClaimBook` calls)."""

  def __init__(self):
    self.clients = {}

  def register(self, client_id, *, inflight, prompt_state, next_group_id):
    self.clients[client_id] = {"inflight": list(inflight), "prompt_state": prompt_state,
                               "next_group_id": next_group_id}

  def revoke(self, client_id, timeout):
    del timeout
    return self.clients.pop(client_id)


def test_the_claim_book_releases_and_starts_the_new_shape():
  service = FakeService()
  book = ClaimBook(service, GROUP_SIZE)
  book.set_restores([None, None])
  first = [book.claim(index, None, restarted=False)["client_id"] for index in range(2)]
  assert first == ["rollout-0-1", "rollout-1-1"]
  service.clients["rollout-0-1"].update(inflight=[entry(2)], next_group_id=4)  # drew 0, 2
  service.clients["rollout-1-1"]["next_group_id"] = 3  # drew 1
  released = [book.release(index) for index in range(2)]
  assert released[0]["rollout"]["inflight"] == [entry(2)] and not service.clients
  with pytest.raises(KeyError):
    book.release(0)  # released once
  shape = new_shape(released, [], [], [0, 1], 3)
  book.reshape(shape.restores)
  claims = [book.claim(index, book.restore_for(index, 0)[1], restarted=False)
            for index in range(3)]
  # new client ids; the dealt group keeps its admission (not stripped as a checkpoint's are)
  assert [c["client_id"] for c in claims] == ["rollout-0-2", "rollout-1-2", "rollout-2-1"]
  assert claims[0]["restore"]["rollout"]["inflight"] == [entry(2)]
  assert service.clients["rollout-0-2"]["inflight"] == [entry(2)]
  # a Ray restart of a new actor claims its first incarnation's work, counted as a restart
  again = book.claim(0, None, restarted=True)
  assert again["restore"]["rollout"]["inflight"] == [entry(2)]
  assert again["restore"]["rollout"]["next_group_id"] == shape.group_starts[0]
  assert book.restarts() == 1
  assert book.reissue_counts()["runtime/reissued_groups/actor_restarted"] == 1
