"""Ctrl-C (SIGINT) in an async run, on every backend: the command stops within seconds with exit
code 130 and a checkpoint, and `--resume` continues from it to the end with clean books."""

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxrl_async.metrics import read_jsonl
from tests import run_lives

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_VERSION = 2 * 4  # mini_batch_size x group_size
BINDINGS = run_lives.TINY_BINDINGS + (
    "RunConfig.eval_every_versions = 1000",
    "RunConfig.checkpoint_every_versions = 100000",
    # Each life makes a few versions and meets few of the row counts precompiling would trace
    # ahead (each trace is redone in every process); those it meets compile when first met.
    "RunConfig.precompile_updates = False",
)
STOP_WITHIN_S = 15.0


BACKENDS = {
    "threads": (),
    "processes": ("RunConfig.backend = 'processes'", "RunConfig.heartbeat_timeout_s = 10.0"),
    "ray": ("RunConfig.backend = 'ray'", "RunConfig.ray_rollout_cpus = 0.5",
            "RunConfig.heartbeat_timeout_s = 10.0"),
}


@pytest.fixture(scope="module")
def ray_address():
  """A local Ray cluster on the loopback interface, for the runs of the 'ray' case."""
  pytest.importorskip("ray")
  from jaxrl_async.backends.ray import placement
  cluster = placement.start_local_cluster([{"num_cpus": 2}])
  yield cluster.address
  placement.stop_local_cluster(cluster)


def _command(run_dir, total_samples, *extra, backend="threads"):
  command = [sys.executable, "-m", "launch.train", "--gin_file", "gin/modes/async_partial.gin",
             "--run_dir", str(run_dir), "--no_progress", *extra]
  for binding in (*BINDINGS, *BACKENDS[backend], f"RunConfig.total_samples = {total_samples}"):
    command += ["--gin_bindings", binding]
  return command


def _ignore_sigint():
  signal.signal(signal.SIGINT, signal.SIG_IGN)


def _versions(run_dir):
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  try:
    return [r["policy_version"] for r in read_jsonl(path) if "algo/version_gap_max" in r]
  except ValueError:  # a line being written
    return []


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sigint_stops_an_async_run_with_a_checkpoint_that_resumes(backend, tmp_path, request):
  # The session's base policy; a tiny run's programs compiled as the other tiny runs' are
  # (run_lives.TINY_ENV: without XLA's optimisation passes), so they share cache entries.
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", **run_lives.TINY_ENV}
  if backend == "ray":
    env.update(RAY_ADDRESS=request.getfixturevalue("ray_address"),
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
  run_dir = tmp_path / "run"
  # Started with SIGINT ignored, as a background job of a non-interactive shell starts it
  # (a CI runner's, a `nohup ... &`): the run must stop on SIGINT all the same.
  process = subprocess.Popen(_command(run_dir, 10_000_000, backend=backend), cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=_ignore_sigint)
  try:
    deadline = time.monotonic() + 240
    while len(_versions(run_dir)) < 3:
      assert process.poll() is None, process.communicate()
      assert time.monotonic() < deadline, "the run did not reach version 3 in time"
      time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    began = time.monotonic()
    try:
      out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      process.send_signal(signal.SIGUSR1)  # every thread's stack, to say where it is stuck
      time.sleep(2.0)
      process.kill()
      out, err = process.communicate(timeout=30)
      raise AssertionError(f"no exit within 60 s of SIGINT; its threads:\n{err[-12000:]}") from None
    stopped_after = time.monotonic() - began
  finally:
    if process.poll() is None:
      process.kill()
  assert process.returncode == 130, (out, err)
  assert stopped_after < STOP_WITHIN_S, stopped_after
  assert "interrupted; resume with --resume" in err, err
  steps = sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit())
  assert len(steps) == 1 and steps[0] >= 3, steps  # only the interrupt wrote a checkpoint
  saved = steps[0]

  # Resume with a budget two versions past the checkpoint: it finishes there.
  resumed = subprocess.run(_command(run_dir, (saved + 2) * PER_VERSION, "--resume",
                                    backend=backend), cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
  assert resumed.returncode == 0, resumed.stderr
  versions = _versions(run_dir)
  assert versions[-2:] == [saved + 1, saved + 2], versions
  assert sorted(set(versions)) == list(range(1, saved + 3))  # no version missing
  # Every sample of both lives consumed once or dropped once under its reason.
  run_lives.check_books(run_lives.books(run_dir), saved + 2)
