import itertools
import json

import grain
import orbax.checkpoint as ocp
import pytest

from jaxrl_async.tasks import base
from jaxrl_async.tasks.prompts import prompt_dataset
from jaxrl_async.tasks.reverse import DigitReverseTask


@pytest.fixture(scope="module")
def task():
  return DigitReverseTask(seed=0)


def _ids(iterator, n):
  return [p.prompt_id for p in itertools.islice(iterator, n)]


def test_yields_the_tasks_problems(task):
  problems = list(itertools.islice(iter(prompt_dataset(task, seed=1, split="eval")), 5))
  assert all(isinstance(p, base.Problem) for p in problems)
  assert all(p == task.problem(p.prompt_id, "eval") for p in problems)


def test_same_seed_same_order(task):
  first = _ids(iter(prompt_dataset(task, seed=3)), 50)
  assert first == _ids(iter(prompt_dataset(task, seed=3)), 50)
  assert first != _ids(iter(prompt_dataset(task, seed=4)), 50)
  assert _ids(iter(prompt_dataset(task, seed=3, shuffle=False)), 5) == [0, 1, 2, 3, 4]


def test_epochs_are_permutations_in_new_orders(task):
  ids = _ids(iter(prompt_dataset(task, seed=0, epoch_size=20, num_epochs=3)), 100)
  assert len(ids) == 60
  epochs = [ids[0:20], ids[20:40], ids[40:60]]
  assert all(sorted(e) == list(range(20)) for e in epochs)
  assert epochs[0] != epochs[1]


@pytest.mark.parametrize("read_options", [None, grain.ReadOptions(num_threads=2,
                                                                   prefetch_buffer_size=8)])
def test_get_state_set_state_continues_exactly(task, read_options):
  dataset = prompt_dataset(task, seed=7, epoch_size=30, read_options=read_options)
  iterator = iter(dataset)
  _ids(iterator, 47)  # into the second epoch
  state = iterator.get_state()
  assert json.loads(json.dumps(state)) == state  # plain ints
  expected = [p.to_dict() for p in itertools.islice(iterator, 40)]
  resumed = iter(prompt_dataset(task, seed=7, epoch_size=30, read_options=read_options))
  resumed.set_state(state)
  assert [p.to_dict() for p in itertools.islice(resumed, 40)] == expected


def test_orbax_composite_checkpoint_continues_exactly(task, tmp_path):
  iterator = iter(prompt_dataset(task, seed=2))
  _ids(iterator, 13)
  checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
  checkpointer.save(tmp_path / "ckpt",
                    args=ocp.args.Composite(prompts=grain.checkpoint.CheckpointSave(iterator)))
  expected = _ids(iterator, 25)
  fresh = iter(prompt_dataset(task, seed=2))
  restored = checkpointer.restore(
      tmp_path / "ckpt", args=ocp.args.Composite(prompts=grain.checkpoint.CheckpointRestore(fresh)))
  assert restored["prompts"] is fresh
  assert _ids(fresh, 25) == expected


def test_checkpoint_manager_saves_the_state_at_save_time(task, tmp_path):
  iterator = iter(prompt_dataset(task, seed=5))
  _ids(iterator, 9)
  with ocp.CheckpointManager(tmp_path / "run") as manager:
    manager.save(1, args=ocp.args.Composite(prompts=grain.checkpoint.CheckpointSave(iterator)))
    expected = _ids(iterator, 20)  # consumed while the save may still be running
    manager.wait_until_finished()
    fresh = iter(prompt_dataset(task, seed=5))
    manager.restore(manager.latest_step(),
                    args=ocp.args.Composite(prompts=grain.checkpoint.CheckpointRestore(fresh)))
  assert _ids(fresh, 20) == expected


@pytest.mark.parametrize("kwargs, knob", [
    ({"seed": -1}, "seed"),
    ({"seed": 2**32}, "seed"),
    ({"seed": 0, "split": "test"}, "split"),
    ({"seed": 0, "epoch_size": 0}, "epoch_size"),
    ({"seed": 0, "num_epochs": 0}, "num_epochs"),
])
def test_bad_arguments(task, kwargs, knob):
  with pytest.raises(ValueError, match=knob):
    prompt_dataset(task, **kwargs)
