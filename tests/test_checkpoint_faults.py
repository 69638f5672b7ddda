"""Checkpoints under bad disks: a corrupted or truncated newest checkpoint is passed over for
the newest one that reads back whole; none readable, a full or a read-only disk, each gives a
clear error, and nothing half-read is trained from."""

import errno
import os

import grain
import jax
import numpy as np
import optax
import pytest

from jaxrl_async import faults, sharding
from jaxrl_async.checkpoint import CheckpointError, RunCheckpointer
from jaxrl_async.learner import step as step_lib


@pytest.fixture(autouse=True)
def no_plan_after():
  yield
  faults.configure(None)


def _state(value: float):
  mesh = sharding.make_mesh(sharding.MeshShape(), jax.devices()[:1])
  params = {"w": np.full((4, 3), value, np.float32)}
  return step_lib.init_train_state(params, optax.sgd(0.1), mesh, {"w": ("embed", "mlp")})


def _prompts():
  return iter(grain.MapDataset.range(1000).to_iter_dataset())


def _save_two(directory, log=None):
  checkpointer = RunCheckpointer(directory, log=log or (lambda *_: None))
  prompts = _prompts()
  for step in (1, 2):
    next(prompts)
    checkpointer.save(step, _state(float(step)), prompts, {"policy_version": step})
  checkpointer.close()


def _files(directory):
  return [os.path.join(root, name) for root, _, names in os.walk(directory) for name in names]


def _corrupt_state(step_dir):
  for path in _files(os.path.join(step_dir, "state")):
    with open(path, "r+b") as f:
      size = os.path.getsize(path)
      f.truncate(size // 2)


def _restore(directory, logs):
  checkpointer = RunCheckpointer(directory, log=logs.append)
  prompts = _prompts()
  try:
    return checkpointer.restore_latest(_state(0.0), prompts), prompts
  finally:
    checkpointer.close()


@pytest.mark.parametrize("damage", ["truncated_state", "corrupted_run_json"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
  directory = tmp_path / "checkpoints"
  _save_two(directory)
  if damage == "truncated_state":
    _corrupt_state(directory / "2")
  else:
    for path in _files(directory / "2" / "run"):
      with open(path, "w") as f:
        f.write('{"policy_version": 2, "trunc')
  logs = []
  (state, run_state, step), prompts = _restore(directory, logs)
  assert step == 1 and run_state["policy_version"] == 1
  np.testing.assert_array_equal(np.asarray(state.params["w"]), np.full((4, 3), 1.0))
  assert next(prompts) == 1  # the prompt iterator is checkpoint 1's, not a half-read 2
  assert any("checkpoint 2" in line and "unreadable" in line for line in logs)
  assert any("resuming from checkpoint 1" in line for line in logs)


def test_no_readable_checkpoint_is_a_clear_error(tmp_path):
  directory = tmp_path / "checkpoints"
  _save_two(directory)
  _corrupt_state(directory / "1")
  _corrupt_state(directory / "2")
  with pytest.raises(CheckpointError, match="no checkpoint under .* reads back whole: 2: .*1: "):
    _restore(directory, [])


def test_no_checkpoint_at_all_restores_nothing(tmp_path):
  (restored, _) = _restore(tmp_path / "checkpoints", [])
  assert restored is None


@pytest.mark.parametrize("code", ["ENOSPC", "EROFS"])
def test_a_full_or_read_only_disk_stops_the_save_and_keeps_older_checkpoints(tmp_path, code):
  directory = tmp_path / "checkpoints"
  checkpointer = RunCheckpointer(directory, log=lambda *_: None)
  prompts = _prompts()
  checkpointer.save(1, _state(1.0), prompts, {"policy_version": 1})
  faults.configure(f"checkpoint.before_write=raise:{code}")
  with pytest.raises(CheckpointError, match=os.strerror(getattr(errno, code))) as caught:
    checkpointer.save(2, _state(2.0), prompts, {"policy_version": 2})
  assert "newest complete checkpoint is 1" in str(caught.value)
  checkpointer.close()
  (state, _, step), _ = _restore(directory, [])
  assert step == 1
  np.testing.assert_array_equal(np.asarray(state.params["w"]), np.full((4, 3), 1.0))


def test_an_unwritable_directory_fails_at_start(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("not a directory")
  with pytest.raises(CheckpointError, match="not writable"):
    RunCheckpointer(blocker / "checkpoints")


def test_the_run_state_must_name_its_version(tmp_path):
  directory = tmp_path / "checkpoints"
  checkpointer = RunCheckpointer(directory, log=lambda *_: None)
  checkpointer.save(3, _state(1.0), _prompts(), {"policy_version": 2})
  checkpointer.close()
  with pytest.raises(CheckpointError, match="does not name policy_version 3"):
    _restore(directory, [])
