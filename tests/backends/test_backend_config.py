"""Backend settings fail at start with the setting's name; the pieces a processes run is made
of: core shares, child environments, disjoint prompt shards."""

import itertools

import pytest

import gin
from jaxrl_async import config as config_lib
from jaxrl_async.backends.processes import child
from jaxrl_async.config import RunConfig
from jaxrl_async.tasks import prompts as prompts_lib
from jaxrl_async.tasks.prompts import shard_prompt_dataset
from jaxrl_async.tasks.reverse import DigitReverseTask
from launch import train

ASYNC = dict(mode="async_stale", staleness_threshold=1.0)


@pytest.mark.parametrize("overrides, match", [
    (dict(backend="mpi", **ASYNC), "backend must be one of"),
    (dict(backend="processes"), "mode='sync'"),
    (dict(num_rollout_servers=2, **ASYNC), "num_rollout_servers=2 needs backend"),
    (dict(backend="processes", num_rollout_servers=0, **ASYNC), "num_rollout_servers"),
    (dict(backend="processes", heartbeat_timeout_s=0.0, **ASYNC), "heartbeat_timeout_s"),
])
def test_bad_backend_settings_name_the_setting(overrides, match):
  with pytest.raises(ValueError, match=match):
    RunConfig(**overrides)


def test_the_readme_binding_selects_the_processes_backend():
  train.load_config(["gin/modes/async_partial.gin"], ["RunConfig.backend = 'processes'",
                                                      "RunConfig.num_rollout_servers = 2"])
  try:
    config = gin.get_configurable(config_lib.RunConfig)()
  finally:
    gin.clear_config()
  assert (config.backend, config.num_rollout_servers) == ("processes", 2)


@pytest.mark.parametrize("children, cores, parent, shares", [
    (1, [0, 1], [0], [[1]]),
    (2, [0, 1], [0], [[1], [0]]),
    (1, [0, 1, 2, 3, 4], [0, 1], [[2, 3, 4]]),
    (3, [0, 1, 2, 3, 4, 5, 6, 7], [0, 1], [[2, 3], [4, 5], [6, 7]]),
])
def test_core_shares(children, cores, parent, shares):
  assert child.core_shares(children, cores) == (parent, shares)


def test_a_one_core_child_gets_one_thread_everywhere(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 "
                     "--xla_cpu_multi_thread_eigen=true")
  env = child.child_env([3])
  assert env["OMP_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "1"
  flags = env["XLA_FLAGS"].split()
  assert "--xla_force_host_platform_device_count=8" in flags
  assert "--xla_cpu_multi_thread_eigen=false" in flags
  assert "--xla_cpu_multi_thread_eigen=true" not in flags
  assert child.child_env([0, 1])["OMP_NUM_THREADS"] == "2"


def test_prompt_shards_are_disjoint_and_cover_the_stream():
  task = DigitReverseTask(0, max_len=8)
  take = 60
  shards = [[p.prompt_id for p in itertools.islice(iter(shard_prompt_dataset(
      task, seed=3, shard_index=k, shard_count=3, epoch_size=1000)), take // 3)]
      for k in range(3)]
  everything = [p.prompt_id for p in itertools.islice(iter(prompts_lib.prompt_dataset(
      task, seed=3, epoch_size=1000)), take)]
  assert sorted(itertools.chain(*shards)) == sorted(everything)
  assert [everything[k::3] for k in range(3)] == shards
  single = [p.prompt_id for p in itertools.islice(iter(shard_prompt_dataset(
      task, seed=3, shard_index=0, shard_count=1)), 5)]
  assert single == [p.prompt_id for p in itertools.islice(iter(prompts_lib.prompt_dataset(
      task, seed=3)), 5)]
  with pytest.raises(ValueError, match="shard_index"):
    shard_prompt_dataset(task, seed=3, shard_index=3, shard_count=3)
