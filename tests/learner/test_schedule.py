"""`learner_schedule`: the learner's effects in order, on hand-computed runs. Groups are plain
strings here: the schedule only passes them on."""

import dataclasses

import pytest

from jaxrl_async.learner.schedule import (
  Publish,
  Take,
  TakeReady,
  Trained,
  Update,
  VersionDone,
  drive,
  learner_schedule,
)


def trace(schedule, takes=(), ready=()):
  """The effects the schedule yields; `Take` is answered from `takes`, `TakeReady` from `ready`
  (None once a list runs out: a stop for `Take`, nothing queued for `TakeReady`)."""
  takes, ready, effects = list(takes), list(ready), []

  def perform(effect):
    effects.append(effect)
    if isinstance(effect, Take):
      return takes.pop(0) if takes else None
    if isinstance(effect, TakeReady):
      return ready.pop(0) if ready else None
    return None

  drive(schedule, perform)
  return effects


def test_trigger_two_takes_twice_then_publishes_once():
  effects = trace(learner_schedule(start_version=0, num_versions=1, trigger=2),
                  takes=[["a"], ["b"]])
  assert effects == [Publish(0, start=True),
                     Take(0), Update(["a"], 0, 0), Take(0), Update(["b"], 0, 1),
                     Trained(1), Publish(1), VersionDone(1, ["a", "b"])]


def test_queued_groups_are_taken_before_the_publish_and_trained_first():
  effects = trace(learner_schedule(start_version=0, num_versions=2, trigger=2),
                  takes=[["a"], ["b"], ["d"]], ready=[["c"]])
  assert effects == [Publish(0, start=True),
                     Take(0), Update(["a"], 0, 0), Take(0), Update(["b"], 0, 1),
                     Trained(1), TakeReady(1), Publish(1), VersionDone(1, ["a", "b"]),
                     Update(["c"], 1, 0), Take(1), Update(["d"], 1, 1),
                     Trained(2), Publish(2), VersionDone(2, ["c", "d"])]


def test_nothing_queued_at_the_publish_means_the_next_version_waits_for_its_groups():
  effects = trace(learner_schedule(start_version=0, num_versions=2, trigger=1, published=0),
                  takes=[["a"], ["b"]])
  assert effects == [Take(0), Update(["a"], 0, 0), Trained(1), TakeReady(1), Publish(1),
                     VersionDone(1, ["a"]),
                     Take(1), Update(["b"], 1, 0), Trained(2), Publish(2), VersionDone(2, ["b"])]


def test_a_run_started_with_taken_groups_trains_them_first():
  """A restored run: version 3 is in the channel already, its first groups were taken."""
  effects = trace(learner_schedule(start_version=3, num_versions=4, trigger=2, taken=["t"],
                                   published=3), takes=[["u"]])
  assert effects == [Update(["t"], 3, 0), Take(3), Update(["u"], 3, 1),
                     Trained(4), Publish(4), VersionDone(4, ["t", "u"])]


def test_taken_groups_are_trained_even_when_the_role_stops():
  """A stop answers `Take` with None: the groups in hand are trained, then the schedule ends
  without publishing the unfinished window."""
  effects = trace(learner_schedule(start_version=0, num_versions=5, trigger=2, taken=["t"],
                                   published=0))
  assert effects == [Update(["t"], 0, 0), Take(0)]


def test_groups_taken_at_a_publish_are_trained_and_published_before_a_stop_ends_it():
  effects = trace(learner_schedule(start_version=0, num_versions=5, trigger=1, published=0),
                  takes=[["a"]], ready=[["b"]])
  assert effects == [Take(0), Update(["a"], 0, 0), Trained(1), TakeReady(1), Publish(1),
                     VersionDone(1, ["a"]),
                     Update(["b"], 1, 0), Trained(2), TakeReady(2), Publish(2),
                     VersionDone(2, ["b"]), Take(2)]


@pytest.mark.parametrize("published, expected", [(-1, [Publish(4, start=True)]), (4, [])])
def test_a_run_at_its_last_version_only_publishes_it_if_the_channel_lacks_it(published,
                                                                              expected):
  assert trace(learner_schedule(start_version=4, num_versions=4, trigger=3,
                                published=published)) == expected


def test_the_last_version_takes_no_groups_for_a_next_one():
  effects = trace(learner_schedule(start_version=1, num_versions=3, trigger=1, published=1),
                  takes=[["a"], ["b"]])
  assert [e for e in effects if isinstance(e, TakeReady)] == [TakeReady(2)]
  assert [e.version for e in effects if isinstance(e, VersionDone)] == [2, 3]


def test_effects_are_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    Take(0).version = 1
