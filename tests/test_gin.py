"""Every gin file parses into a valid RunConfig and documents its command and expectation."""

import glob
import os

import pytest

import gin
from jaxrl_async import config as config_lib
from launch import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODE_FILES = sorted(glob.glob(os.path.join(ROOT, "gin", "modes", "*.gin")))


def test_every_mode_has_a_gin_file():
  names = {os.path.splitext(os.path.basename(f))[0] for f in MODE_FILES}
  assert names == set(config_lib.MODES)


@pytest.mark.parametrize("path", MODE_FILES, ids=os.path.basename)
def test_mode_file_builds_its_mode(path):
  train.load_config([path], [])
  config = gin.get_configurable(config_lib.RunConfig)()
  assert config.mode == os.path.splitext(os.path.basename(path))[0]
  if config.mode in ("sync", "on_policy", "stream_off_policy"):
    assert config.staleness_threshold == 0
  else:
    assert config.staleness_threshold > 0 and config.max_version_gap is not None
  assert config.partial_rollout == (config.mode == "async_partial")
  if config.mode == "stream_off_policy":
    assert config.trigger_parameter_sync_step > 1


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "gin", "**", "*.gin"),
                                        recursive=True)), ids=os.path.basename)
def test_gin_file_opens_with_a_comment(path):
  with open(path, encoding="utf-8") as f:
    first = f.readline()
  assert first.startswith("#"), f"{path} must open with a comment (command, time, result)"


def test_short_binding_names_are_qualified():
  train.load_config(["gin/modes/sync.gin"], ["RunConfig.group_size = 4",
                                             "LearnerConfig.learning_rate = 0.01"])
  config = gin.get_configurable(config_lib.RunConfig)()
  assert config.group_size == 4
  assert config.learner.learning_rate == 0.01


def test_default_gin_file_is_an_async_mode():
  train.load_config([train.DEFAULT_GIN], [])
  assert gin.get_configurable(config_lib.RunConfig)().mode != "sync"


RECIPE_FILES = sorted(glob.glob(os.path.join(ROOT, "gin", "recipes", "*.gin")))


def _config(path):
  train.load_config([path], [])
  try:
    return gin.get_configurable(config_lib.RunConfig)()
  finally:
    gin.clear_config()


@pytest.mark.parametrize("path", RECIPE_FILES, ids=os.path.basename)
def test_a_recipe_takes_as_many_samples_per_update_as_sync(path):
  recipe, sync = _config(path), _config(os.path.join(ROOT, "gin", "modes", "sync.gin"))
  assert (recipe.groups_per_update * recipe.group_size
          == sync.groups_per_update * sync.group_size)
  assert recipe.total_samples == sync.total_samples


@pytest.mark.parametrize("path", MODE_FILES + RECIPE_FILES, ids=os.path.basename)
def test_a_file_whose_roles_take_turns_says_so(path):
  """A file with s > 0 whose admission room is less than one update says the roles take turns;
  one with room says they overlap."""
  config = _config(path)
  with open(path, encoding="utf-8") as f:
    comment = " ".join(line for line in f if line.startswith("#"))
  if config.staleness_threshold == 0:
    return  # strictly on-policy: the waits are the mode's definition
  if config.overlap_room < 1:
    assert "take turns" in comment, f"{path}: overlap_room {config.overlap_room:.3g} < 1"
  else:
    assert "take turns" not in comment and "overlap" in comment


def test_overlap_room_is_the_admitted_surplus_over_one_update():
  def make(**kw):
    return config_lib.RunConfig(**{"mode": "async_partial", "partial_rollout": True,
                                   "max_version_gap": 2, **kw})

  assert make(staleness_threshold=0.5).overlap_room == 0.5  # 8 groups: 4 ahead of 8
  room = make(staleness_threshold=0.5, mini_batch_size=2, require_batches=4,
              trigger_parameter_sync_step=4).overlap_room
  assert room == 2.0  # N = 32: 16 ahead of 8
  assert make(staleness_threshold=0.1, trigger_parameter_sync_step=4).overlap_room == 3 / 8
