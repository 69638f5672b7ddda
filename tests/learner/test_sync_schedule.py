"""`sync_schedule`: the sync baseline's stages in order, on hand-computed runs. Groups are plain
strings here: the schedule only passes them on."""

from jaxrl_async.learner.sync_schedule import (
  Admit,
  Generate,
  Publish,
  Score,
  Take,
  Train,
  advance,
  sync_schedule,
)


def trace(schedule, chunks=()):
  """The effects the schedule yields; `Take` is answered from `chunks` ([] once it runs out)."""
  chunks, effects = list(chunks), []
  effect = advance(schedule)
  while effect is not None:
    effects.append(effect)
    result = (chunks.pop(0) if chunks else []) if isinstance(effect, Take) else None
    effect = advance(schedule, result)
  return effects


def test_each_version_admits_generates_scores_trains_in_chunks_then_publishes():
  effects = trace(sync_schedule(start_version=0, num_versions=2, groups_per_update=2,
                                trigger=2),
                  chunks=[["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]])
  assert effects == [
      Admit(0, 4), Generate(0), Score(0),
      Take(0, 2), Train(["a", "b"], 0, 0), Take(0, 2), Train(["c", "d"], 0, 1),
      Publish(1, ["a", "b", "c", "d"]),
      Admit(1, 4), Generate(1), Score(1),
      Take(1, 2), Train(["e", "f"], 1, 0), Take(1, 2), Train(["g", "h"], 1, 1),
      Publish(2, ["e", "f", "g", "h"])]


def test_after_drops_a_short_chunk_trains_and_an_empty_one_ends_the_updates():
  effects = trace(sync_schedule(start_version=0, num_versions=1, groups_per_update=2,
                                trigger=3), chunks=[["a", "b"], ["c"], []])
  assert effects == [Admit(0, 6), Generate(0), Score(0),
                     Take(0, 2), Train(["a", "b"], 0, 0), Take(0, 2), Train(["c"], 0, 1),
                     Take(0, 2), Publish(1, ["a", "b", "c"])]


def test_a_version_whose_groups_were_all_dropped_still_publishes():
  effects = trace(sync_schedule(start_version=0, num_versions=1, groups_per_update=1,
                                trigger=2), chunks=[None])
  assert effects == [Admit(0, 2), Generate(0), Score(0), Take(0, 1), Publish(1, [])]


def test_a_resumed_run_starts_at_its_version_and_a_finished_one_does_nothing():
  effects = trace(sync_schedule(start_version=2, num_versions=3, groups_per_update=1,
                                trigger=1), chunks=[["a"]])
  assert effects == [Admit(2, 1), Generate(2), Score(2), Take(2, 1), Train(["a"], 2, 0),
                     Publish(3, ["a"])]
  assert trace(sync_schedule(start_version=3, num_versions=3, groups_per_update=1,
                             trigger=1)) == []
