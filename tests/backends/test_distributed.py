"""jax.distributed: where the cluster settings come from, and a real 2-process learner update on
localhost (4 CPU devices each, one global mesh of 8) that equals the one-process update."""

import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxrl_async import distributed, sharding
from launch import learner_check
from tests import run_lives

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- settings --------------------------------------------------------------------------------
def test_arguments_win_over_the_environment():
  env = {"JAX_NUM_PROCESSES": "8", "JAX_PROCESS_ID": "3", "SLURM_PROCID": "1"}
  spec = distributed.cluster_spec("10.0.0.1:1234", 2, 1, env=env)
  assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == (
      "10.0.0.1:1234", 2, 1, "arguments")


def test_jax_variables():
  env = {"JAX_COORDINATOR_ADDRESS": "h0:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "2",
         "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "x"}
  spec = distributed.cluster_spec(env=env)
  assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == (
      "h0:99", 4, 2, "jax_env")
  assert spec.env() == {"JAX_COORDINATOR_ADDRESS": "h0:99", "JAX_NUM_PROCESSES": "4",
                        "JAX_PROCESS_ID": "2"}


@pytest.mark.parametrize("nodelist, host", [
    ("gpu[003-004,7],cpu1", "gpu003"), ("node12", "node12"), ("a-b[10,12]", "a-b10"),
    ("n[1-2]", "n1")])
def test_slurm(nodelist, host):
  env = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": nodelist,
         "SLURM_JOB_NODELIST": "other"}
  spec = distributed.cluster_spec(env=env, coordinator_port=777)
  assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == (
      f"{host}:777", 4, 3, "slurm")


def test_tpu_slice():
  env = {"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "t-w-0,t-w-1,t-w-2,t-w-3"}
  spec = distributed.cluster_spec(env=env)
  assert (spec.coordinator_address, spec.num_processes, spec.process_id, spec.source) == (
      f"t-w-0:{distributed.DEFAULT_COORDINATOR_PORT}", 4, 1, "tpu")


def test_single_process_without_settings():
  spec = distributed.cluster_spec(env={})
  assert (spec.num_processes, spec.process_id, spec.source, spec.is_distributed) == (
      1, 0, "single", False)
  distributed.initialize(spec)  # nothing to do, no error


@pytest.mark.parametrize("kwargs, env, named", [
    (dict(num_processes=2, process_id=2, coordinator_address="h:1"), {}, "process_id"),
    (dict(num_processes=0, process_id=0), {}, "num_processes"),
    (dict(num_processes=2, process_id=0), {}, "coordinator_address"),
    (dict(num_processes=2, process_id=0, coordinator_address="h"), {}, "coordinator_address"),
    (dict(process_id=0), {}, "num_processes"),
    ({}, {"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES"),
    ({}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, "SLURM_JOB_NODELIST"),
])
def test_bad_settings_name_the_setting(kwargs, env, named):
  with pytest.raises(ValueError, match=named):
    distributed.cluster_spec(env=env, **kwargs)


def test_global_mesh_in_one_process_spans_the_devices():
  mesh = distributed.global_mesh(sharding.MeshShape(data=2, fsdp=-1, tensor=2))
  assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
  assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())


# ---- two real processes ----------------------------------------------------------------------
def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start_processes(tmp_path, num_processes, mesh, local_devices):
  port = _free_port()
  procs = []
  for process_id in range(num_processes):
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={local_devices}",
           "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
           "JAX_NUM_PROCESSES": str(num_processes), "JAX_PROCESS_ID": str(process_id)}
    log = open(tmp_path / f"process{process_id}.log", "w")  # noqa: SIM115 (closed below)
    procs.append((subprocess.Popen(
        [sys.executable, "-m", "launch.learner_check", "--mesh", mesh, "--init_timeout_s", "120",
         "--out", str(tmp_path / f"params{process_id}.npz")],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  return procs


@pytest.mark.slow
def test_two_process_update_equals_one_process_update(tmp_path):
  procs = _start_processes(tmp_path, 2, "1,-1,2", local_devices=4)
  codes = run_lives.reap(procs, timeout_s=300)
  logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
  assert codes == [0, 0], "\n---\n".join(log[-3000:] for log in logs)
  reports = [json.loads(log.strip().splitlines()[-1]) for log in logs]
  for process_id, report in enumerate(reports):
    assert report["process_id"] == process_id
    assert (report["num_processes"], report["global_devices"], report["local_devices"]) == (
        2, 8, 4)
    assert report["mesh"] == {"data": 1, "fsdp": 4, "tensor": 2}
  assert not (tmp_path / "params1.npz").exists()  # only process 0 writes

  one_device = sharding.make_mesh(sharding.MeshShape(1, 1, 1), jax.devices()[:1])
  expected_params, expected_loss = learner_check.run_update(one_device)
  expected = learner_check.flatten(expected_params)
  joint = dict(np.load(tmp_path / "params0.npz"))
  assert reports[0]["loss"] == reports[1]["loss"]
  np.testing.assert_allclose(joint.pop("loss"), expected_loss, rtol=1e-5)
  assert sorted(joint) == sorted(expected)
  initial = learner_check.flatten(learner_check.initial_params(seed=0)[1])
  moved = 0.0
  for name, value in expected.items():
    np.testing.assert_allclose(joint[name], value, atol=5e-5, err_msg=name)
    moved = max(moved, float(np.abs(value - initial[name]).max()))
  assert moved > 1e-4  # the update changed the params (lr 3e-4): the comparison means something


def test_a_missing_process_fails_with_an_error_not_a_hang(tmp_path):
  """One of two processes starts: the coordinator gives up after its timeout, exit != 0."""
  port = _free_port()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "",
         "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
         "JAX_PROCESS_ID": "0"}
  log = open(tmp_path / "alone.log", "w")  # noqa: SIM115 (closed by run_lives.reap)
  proc = subprocess.Popen([sys.executable, "-m", "launch.learner_check", "--init_timeout_s", "5"],
                          cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
  codes = run_lives.reap([(proc, log)], timeout_s=120)
  assert codes[0] != 0
