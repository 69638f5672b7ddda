"""The backend contract: every registered backend runs every async mode through the one loop
with the same guarantees. A new backend passes this module with no change to the loop.

For each backend (threads, processes, ray) and each async mode (on_policy, stream_off_policy,
async_stale, async_partial with 'reprefill' and with 'keep_kv'), a tiny run must
- reach its last version, with every version recorded once and evaluated at most once;
- keep the mode's staleness bound on every consumed batch (gap 0 where s = 0);
- account for every sample it drew: consumed once or dropped once under a reason;
- write checkpoints whose run state names the backend.
Resume is part of the contract: from the newest checkpoint that reads back whole (a corrupted
newest one is skipped), with no second evaluation of a version already evaluated.
"""

from __future__ import annotations

import json
import os

import pytest

from jaxrl_async.backends import REGISTRY, get_backend
from jaxrl_async.backends.base import Backend
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from jaxrl_async.sharding import MeshShape
from jaxrl_async.tasks.reverse import DigitReverseTask
from tests import run_lives

GROUP_SIZE = 4
NUM_VERSIONS = 4
MODES = {  # name -> RunConfig settings (the gin mode files' meaning, at tiny size)
    "on_policy": dict(mode="on_policy", staleness_threshold=0.0),
    "stream_off_policy": dict(mode="stream_off_policy", staleness_threshold=0.0,
                              trigger_parameter_sync_step=2),
    "async_stale": dict(mode="async_stale", staleness_threshold=1.0, max_version_gap=2),
    "async_partial": dict(mode="async_partial", staleness_threshold=1.0, max_version_gap=2,
                          partial_rollout=True, partial_strategy="reprefill"),
    "async_partial_keep_kv": dict(mode="async_partial", staleness_threshold=1.0,
                                  max_version_gap=2, partial_rollout=True,
                                  partial_strategy="keep_kv"),
}


def quiet(*args, **kwargs):
  del args, kwargs


def have_ray() -> bool:
  try:
    import ray  # noqa: F401
  except ImportError:
    return False
  return True


@pytest.fixture(scope="module")
def ray_cluster():
  """One local Ray cluster on the loopback interface for this module's ray runs."""
  if not have_ray():
    pytest.skip("ray is not installed")
  from jaxrl_async.backends.ray import placement
  cluster = placement.start_local_cluster([{"num_cpus": 2}])
  yield cluster
  placement.stop_local_cluster(cluster)


@pytest.fixture(params=sorted(REGISTRY))
def backend(request) -> str:
  if request.param == "ray":
    request.getfixturevalue("ray_cluster")
  return request.param


def tiny_config(backend: str, num_versions: int = NUM_VERSIONS, **overrides) -> RunConfig:
  settings = dict(task=DigitReverseTask(0, max_len=8),
                  warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=GROUP_SIZE,
                  mini_batch_size=2, max_concurrent_decodes=8, eval_size=16,
                  eval_every_versions=2, checkpoint_every_versions=2, backend=backend,
                  heartbeat_timeout_s=10.0, ray_rollout_cpus=0.5)
  settings.update(overrides)
  groups_per_version = (settings["mini_batch_size"]
                        * settings.get("trigger_parameter_sync_step", 1))
  return RunConfig(total_samples=num_versions * groups_per_version * GROUP_SIZE, **settings)


def checkpoint_run_state(run_dir, step: int) -> dict:
  path = os.path.join(run_dir, "checkpoints", str(step), "run", "metadata")  # orbax JsonSave
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def test_the_registry_names_a_backend_class_for_every_allowed_setting():
  from jaxrl_async import config as config_lib
  assert set(REGISTRY) == set(config_lib.BACKENDS)
  for name in REGISTRY:
    backend = get_backend(name)
    assert isinstance(backend, Backend) and backend.name == name
  with pytest.raises(ValueError, match="'slurm' is not a registered backend"):
    get_backend("slurm")


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_async_mode_keeps_its_guarantees(backend, mode, tmp_path):
  settings = MODES[mode]
  config = tiny_config(backend, **settings)
  run_dir = tmp_path / "run"
  summary = api.run(config, str(run_dir), progress=False, log=quiet)
  assert summary["backend"] == backend and summary["mode"] == settings["mode"]
  assert summary["policy_version"] == config.num_versions
  records = read_jsonl(run_dir / "metrics.jsonl")
  versions = [r for r in records if "algo/version_gap_max" in r]
  assert [r["policy_version"] for r in versions] == list(range(1, config.num_versions + 1))
  bound = 0 if config.staleness_threshold == 0 else config.max_version_gap
  assert max(r["algo/version_gap_max"] for r in versions) <= bound
  run_lives.check_books(run_lives.books(run_dir), config.num_versions)
  assert checkpoint_run_state(run_dir, 2)["rollout"]["backend"] == backend


@pytest.mark.slow
def test_resume_skips_a_corrupted_newest_checkpoint_and_evaluates_once(backend, tmp_path):
  run_dir = tmp_path / "run"
  first = tiny_config(backend, num_versions=4, **MODES["async_stale"])
  api.run(first, str(run_dir), progress=False, log=quiet)
  # The newest checkpoint (version 4) is corrupted: its state files are truncated.
  state_dir = run_dir / "checkpoints" / "4" / "state"
  corrupted = 0
  for root, _, files in os.walk(state_dir):
    for name in files:
      with open(os.path.join(root, name), "r+b") as f:
        f.truncate(0)
      corrupted += 1
  assert corrupted > 0
  logs: list[str] = []
  longer = tiny_config(backend, num_versions=6, **MODES["async_stale"])
  summary = api.run(longer, str(run_dir), resume=True, progress=False, log=logs.append)
  assert any("unreadable" in line for line in logs), logs
  assert any("at policy_version 2" in line for line in logs), logs
  assert summary["policy_version"] == 6
  report = run_lives.books(run_dir)
  run_lives.check_books(report, 6)
  # Evaluated at 0, 2, 4 and 6, each once, though version 2 was also the resume point.
  assert sorted(report["eval_records"]) == [0, 2, 4, 6]


def test_resume_without_a_checkpoint_says_it_starts_from_scratch(tmp_path):
  logs: list[str] = []
  config = tiny_config("threads", num_versions=1, **MODES["async_stale"])
  summary = api.run(config, str(tmp_path / "run"), resume=True, progress=False,
                    log=logs.append)
  assert summary["policy_version"] == 1
  assert any("no checkpoint under" in line and "starting from scratch" in line
             for line in logs), logs


@pytest.mark.parametrize("name", ["processes", "ray"])
def test_a_rollout_mesh_is_refused_where_servers_live_in_other_processes(name, tmp_path):
  config = tiny_config(name, rollout_mesh=MeshShape(data=1, fsdp=4, tensor=1),
                       learner_mesh=MeshShape(data=1, fsdp=4, tensor=1), **MODES["async_stale"])
  with pytest.raises(ValueError, match=f"rollout_mesh=.*the {name} backend"):
    api.run(config, str(tmp_path / "run"), progress=False, log=quiet)
  assert not (tmp_path / "run").exists()  # refused before anything was built or written
