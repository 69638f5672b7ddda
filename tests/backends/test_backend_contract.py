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


def tiny_config(backend: str, num_versions: int = 4, **overrides) -> RunConfig:
  # precompile_updates off: a tiny run meets few of the row counts it would compile ahead
  settings = dict(task=DigitReverseTask(0, max_len=8), precompile_updates=False,
                  warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=GROUP_SIZE,
                  mini_batch_size=2, max_concurrent_decodes=8, eval_size=16,
                  eval_every_versions=2, checkpoint_every_versions=2, backend=backend,
                  heartbeat_timeout_s=10.0, ray_rollout_cpus=0.5)
  settings.update(overrides)
  groups_per_version = (settings["mini_batch_size"]
                        * settings.get("trigger_parameter_sync_step", 1))
  return RunConfig(total_samples=num_versions * groups_per_version * GROUP_SIZE, **settings)


def run_mode(config: RunConfig, run_dir) -> tuple[dict, list[dict]]:
  """Runs to the end (a role error would raise RoleFailed here); returns the summary and the
  per-version records."""
  summary = api.run(config, str(run_dir), progress=False, log=quiet)
  records = read_jsonl(os.path.join(str(run_dir), "metrics.jsonl"))
  return summary, [r for r in records if "algo/version_gap_max" in r]


def check_run(config: RunConfig, summary: dict, records: list[dict], run_dir) -> None:
  """What every async run must show on every backend: all versions trained, one record per
  version, every sample the rollout side started accounted for exactly once, and checkpoints
  that name the backend."""
  assert summary["backend"] == config.backend and summary["mode"] == config.mode
  assert summary["policy_version"] == config.num_versions
  assert summary["learner_step"] == config.num_versions * config.trigger_parameter_sync_step
  assert [r["policy_version"] for r in records] == list(range(1, config.num_versions + 1))
  assert [r["learner_step"] for r in records] == [
      v * config.trigger_parameter_sync_step for v in range(1, config.num_versions + 1)]
  # The buffer: put == consumed + dropped (any reason) + queued; what was queued at the end is
  # dropped as 'shutdown'.
  dropped = sum(v for k, v in summary.items() if k.startswith("queue/dropped/"))
  assert summary["queue/depth"] == 0
  assert summary["queue/put"] == summary["queue/consumed"] + dropped
  assert summary["queue/dropped/shutdown"] == summary["queue/discarded_at_end"]
  assert summary["queue/consumed"] == summary["consumed_samples"] == config.total_samples
  # The rollout side: every sample it started was put into the buffer or aborted at shutdown.
  started = summary["rollout/groups_started"] * config.group_size
  assert started == summary["queue/put"] + summary["rollout/shutdown"]
  assert summary["rollout/swaps"] >= 1
  # Hand-off latency: the rollout side works under each version after its publish began, that
  # version's samples reach the buffer after that, and the learner after the buffer.
  assert summary["handoff/versions"] >= 1
  for name in ("publish_to_work_s", "work_to_enqueue_s", "publish_to_enqueue_s",
               "enqueue_to_take_s", "publish_to_take_s"):
    assert 0.0 <= summary[f"handoff/{name}_p50"] <= summary[f"handoff/{name}_p99"], name
  # The ledger over the whole run, and the evaluation records (no version evaluated twice).
  run_lives.check_books(run_lives.books(run_dir), config.num_versions)
  assert checkpoint_run_state(run_dir, config.num_versions)["rollout"]["backend"] == (
      config.backend)


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
@pytest.mark.parametrize("mode, overrides", [
    ("on_policy", dict()),
    ("stream_off_policy", dict(trigger_parameter_sync_step=2)),
], ids=["on_policy", "stream_off_policy"])
def test_on_policy_modes_consume_only_gap_zero_tokens(backend, tmp_path, mode, overrides):
  config = tiny_config(backend, mode=mode, staleness_threshold=0.0, **overrides)
  assert config.debug_checks  # the learner also asserts gap 0 on every batch
  summary, records = run_mode(config, tmp_path)
  check_run(config, summary, records, tmp_path)
  for record in records:
    assert record["algo/version_gap_max"] == 0, record["policy_version"]
    assert record["algo/stale_ratio"] == 0
    assert record["algo/partial_ratio"] == 0
  assert summary["queue/dropped/stale"] == 0
  assert summary["rollout/interrupted"] == 0


@pytest.mark.slow
def test_async_stale_consumes_stale_tokens_within_the_bound(backend, tmp_path):
  config = tiny_config(backend, mode="async_stale", staleness_threshold=1.0, max_version_gap=1)
  summary, records = run_mode(config, tmp_path)
  check_run(config, summary, records, tmp_path)
  assert all(r["algo/version_gap_max"] <= 1 for r in records), [
      r["algo/version_gap_max"] for r in records]
  if backend == "threads":  # the rollout runs ahead while the first update compiles
    assert any(r["algo/stale_ratio"] > 0 for r in records)
  assert all(r["algo/partial_ratio"] == 0 for r in records)  # partial rollout is off
  assert summary["rollout/interrupted"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["reprefill", "keep_kv"])
def test_async_partial_resumes_interrupted_samples(backend, tmp_path, strategy):
  # Few slots and longer strings, so that samples are in flight at weight syncs. The first
  # versions carry no partial sample (while the first update compiles, the rollouter finishes
  # its whole budget), so 6 versions give interrupted groups several chances to be consumed
  # within max_version_gap before the run ends. Evaluation and checkpoints (which pause the
  # rollouter) only at the end, to keep the run short.
  config = tiny_config(backend, 6, mode="async_partial", task=DigitReverseTask(0, max_len=16),
                       staleness_threshold=1.0, max_version_gap=2, partial_rollout=True,
                       partial_strategy=strategy, max_concurrent_decodes=4,
                       eval_every_versions=6, checkpoint_every_versions=6)
  summary, records = run_mode(config, tmp_path)
  check_run(config, summary, records, tmp_path)
  assert all(r["algo/version_gap_max"] <= 2 for r in records), [
      r["algo/version_gap_max"] for r in records]
  # Interruptions depend on where the syncs fall: on threads the roles share the cores and
  # some always land mid-generation; elsewhere, when more than one swap's worth (the 4 slots)
  # were interrupted, at least one swap came before the last, and its samples show in the
  # records (the last swap's resumed samples may belong to no update of the run).
  if backend == "threads":
    assert summary["rollout/interrupted"] > 0
  if backend == "threads" or summary["rollout/interrupted"] > config.max_concurrent_decodes:
    assert any(r["algo/partial_ratio"] > 0 for r in records)
    assert max(r["algo/max_partial_span"] for r in records) >= 1


@pytest.mark.slow
def test_resume_skips_a_corrupted_newest_checkpoint_and_evaluates_once(backend, tmp_path):
  run_dir = tmp_path / "run"
  first = tiny_config(backend, num_versions=4, mode="async_stale", staleness_threshold=1.0, max_version_gap=2)
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
  longer = tiny_config(backend, num_versions=6, mode="async_stale", staleness_threshold=1.0, max_version_gap=2)
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
  config = tiny_config("threads", num_versions=1, mode="async_stale", staleness_threshold=1.0, max_version_gap=2)
  summary = api.run(config, str(tmp_path / "run"), resume=True, progress=False,
                    log=logs.append)
  assert summary["policy_version"] == 1
  assert any("no checkpoint under" in line and "starting from scratch" in line
             for line in logs), logs


@pytest.mark.parametrize("name", ["processes", "ray"])
def test_a_rollout_mesh_is_refused_where_servers_live_in_other_processes(name, tmp_path):
  config = tiny_config(name, rollout_mesh=MeshShape(data=1, fsdp=4, tensor=1),
                       learner_mesh=MeshShape(data=1, fsdp=4, tensor=1), mode="async_stale", staleness_threshold=1.0, max_version_gap=2)
  with pytest.raises(ValueError, match=f"rollout_mesh=.*the {name} backend"):
    api.run(config, str(tmp_path / "run"), progress=False, log=quiet)
  assert not (tmp_path / "run").exists()  # refused before anything was built or written


@pytest.mark.slow
def test_a_whole_run_publishes_through_the_weight_store(backend, tmp_path):
  """`sync_backend='store'` (the channel that crosses hosts through a shared directory) on
  every backend, with delta publishes of bf16 rollout weights: the rollout side loads each
  version from <run_dir>/weights, and every load's digest is the one the learner published for
  that version (the CRC-32 of every leaf of the full bf16 weights), so the rollout weights equal
  a full publish's at every version it loaded."""
  config = tiny_config(backend, mode="async_stale", staleness_threshold=1.0, max_version_gap=2,
                       sync_backend="store", sync_delta=True, sync_full_every=3,
                       rollout_param_dtype="bfloat16")
  summary, records = run_mode(config, tmp_path)
  check_run(config, summary, records, tmp_path)
  versions = sorted(int(name) for name in os.listdir(tmp_path / "weights") if name.isdigit())
  assert versions and versions[-1] == config.num_versions  # the last publish is kept
  assert summary["rollout/swaps"] >= 2  # the servers loaded versions after the first
  lines = read_jsonl(tmp_path / "weights" / "published.jsonl")
  assert [line["kind"] for line in lines] == ["full", "delta", "delta", "full", "delta"]
  assert summary["sync/bytes"] < summary["sync/full_bytes"]
  assert 0 < summary["sync/delta_density_mean"] < 1 and summary["sync/delta_fallbacks"] == 0
  published = {line["version"]: line["digest"] for line in lines}
  loads = [load for name in os.listdir(tmp_path / "weights" / "loads")
           for load in read_jsonl(tmp_path / "weights" / "loads" / name)]
  assert len(loads) == summary["sync/loads"] >= 3
  assert all(load["digest"] == published[load["version"]] for load in loads)
