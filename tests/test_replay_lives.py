"""A recorded run on another backend, killed (SIGKILL) and resumed once, still replays: its
schedule files are cut back to the checkpoint it resumed from, the learner replay equals every
checkpoint bit for bit and the full replay draws the same tokens. Runs and replays are
subprocesses (`python -m launch.train`, `python -m launch.replay`) with one environment, so
both compile for the same host.

Backends: 'processes' (rollout servers as child processes) and 'ray' (rollout servers as Ray
actors of a one-node cluster on the loopback interface; each life is a driver that joins it, and
the SIGKILLed driver's actors end with it). A Ray actor is started by the cluster's raylet, not
by the driver: it compiles as the driver does only because the driver hands it its JAX compile
settings (`ray/placement.py: COMPILE_ENV`); without them its logprobs differ from the replay's
in the last bits and no checkpoint replays bit for bit.

The Ray case is a soak (`pytest -m soak`): 38 to 42 CPU-s on two cores, after the processes
case has cached the base policy (Ray's own processes, three actor processes a life that each
import JAX, two driver lives, the replay). `test_ray_actors_compile_as_their_driver` keeps its
premise in the default run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxrl_async.run.schedule_read import read_schedule
from jaxrl_async.run.schedule_record import recorded_ends
from tests import run_lives

NUM_VERSIONS = 6
BINDINGS = run_lives.TINY_BINDINGS + (
    f"RunConfig.total_samples = {NUM_VERSIONS * 8}",
    "RunConfig.staleness_threshold = 1.0",
    "RunConfig.checkpoint_every_versions = 2",
    "RunConfig.eval_every_versions = 2",
    "RunConfig.heartbeat_timeout_s = 10.0",
)


@pytest.fixture(scope="module")
def ray_cluster():
  """A one-node Ray cluster on the loopback interface, for the Ray case's lives to join
  (RAY_ADDRESS): a killed driver's actors end with it, the cluster stays."""
  os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # read by Ray at import
  pytest.importorskip("ray")
  from jaxrl_async.backends.ray import placement
  cluster = placement.start_local_cluster([{"num_cpus": 1}])
  yield cluster
  placement.stop_local_cluster(cluster)


def backend_env(request, backend: str) -> dict:
  """More environment for a life on `backend`: the Ray case joins the module's cluster."""
  if backend != "ray":
    return {}
  cluster = request.getfixturevalue("ray_cluster")
  return {"RAY_ADDRESS": cluster.address, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def replay_cli(run_dir, *args, timeout_s=300) -> dict:
  out = os.path.join(str(run_dir), "replay-report.json")
  result = subprocess.run([sys.executable, "-m", "launch.replay", str(run_dir), *args,
                           "--out", out], cwd=run_lives.ROOT,
                          env=run_lives.environment(tiny=True),  # compiled as the run was
                          capture_output=True, text=True, timeout=timeout_s, check=False)
  assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
  with open(out, encoding="utf-8") as f:
    return json.load(f)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["processes", pytest.param("ray", marks=pytest.mark.soak)])
def test_a_killed_and_resumed_run_replays_bit_for_bit(tmp_path, request, backend):
  """The 'ray' case is marked soak (about 40 CPU-s: measured in docs/replay.md)."""
  bindings = BINDINGS + (f"RunConfig.backend = '{backend}'",)
  env = backend_env(request, backend)
  gin_file = "gin/modes/async_partial.gin"
  # The kill lands in the second checkpoint's write: its schedule file (version 4) is written,
  # the checkpoint is not, so the resumed run starts from 2 and must cut the file back.
  first = run_lives.start(tmp_path, gin_file, bindings,
                          faults_plan="checkpoint.before_write=kill@2", env=env)
  code, out, err, _ = run_lives.finish(first, 600)
  assert code == -9, f"{code}\n{out[-2000:]}\n{err[-4000:]}"
  assert recorded_ends(tmp_path) == [2, 4]
  written_before_the_kill = os.stat(os.path.join(tmp_path, "schedule", "00000004.npz"))
  second = run_lives.start(tmp_path, gin_file, bindings, resume=True, env=env)
  code, out, err, _ = run_lives.finish(second, 600)
  assert code == 0, f"{out[-2000:]}\n{err[-4000:]}"
  assert "resumed from" in out and "at policy_version 2" in out
  rewritten = os.stat(os.path.join(tmp_path, "schedule", "00000004.npz"))
  assert rewritten.st_mtime_ns > written_before_the_kill.st_mtime_ns
  intervals = read_schedule(tmp_path)
  assert [(i.start_version, i.end_version) for i in intervals] == [(0, 2), (2, 4), (4, 6)]
  assert {i.header["backend"] for i in intervals} == {backend}
  report = replay_cli(tmp_path, "--level", "full")
  assert [c["version"] for c in report["checkpoints"]] == [2, 4, 6]
  assert report["bitwise_equal"], report["checkpoints"]
  assert report["tokens"]["identical_tokens"] == report["tokens"]["samples"] == (
      NUM_VERSIONS * 8)
  # The regenerated batches are the recorded ones: the learner replay's inputs, bit for bit.
  assert report["tokens"]["behaviour_logprob_max_abs_diff"] == 0.0
  assert report["schedule"]["samples"] == NUM_VERSIONS * 8


def test_ray_actors_compile_as_their_driver(monkeypatch):
  """A Ray actor's process is started by its node's raylet, with the environment of whoever
  started the cluster: the driver hands each rollout actor the settings that decide how JAX
  compiles, so that the actor draws the logprobs its driver's replay draws again."""
  from jaxrl_async.backends.ray import placement  # imports no Ray
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  monkeypatch.setenv("JAX_DEFAULT_MATMUL_PRECISION", "highest")
  monkeypatch.delenv("JAX_ENABLE_X64", raising=False)
  env = placement.thread_env(2)
  assert env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
  assert env["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"
  assert env["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
  assert "JAX_ENABLE_X64" not in env  # unset in the driver: the actor's own default
