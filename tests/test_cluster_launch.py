"""Cluster launch scripts: `--dry_run` prints the processes' jax.distributed settings and roles;
the rendered sbatch job runs for real on localhost under a stand-in `srun` that starts its tasks
with SLURM's variables (SLURM itself is not installed here)."""

import json
import os
import re
import stat
import subprocess
import sys

import pytest

from launch import cluster
from launch.slurm import launch as slurm
from launch.tpu import launch as tpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_puts_the_controller_on_process_0():
  launches = cluster.plan(["a", "b", "c"], ("run",), port=999, extra_env={"X": "1"})
  assert [launch.process_id for launch in launches] == [0, 1, 2]
  assert [launch.role for launch in launches] == ["controller,learner", "learner", "learner"]
  for launch in launches:
    assert launch.env == {"JAX_COORDINATOR_ADDRESS": "a:999", "JAX_NUM_PROCESSES": "3",
                          "JAX_PROCESS_ID": str(launch.process_id), "JAXRL_ROLE": launch.role,
                          "X": "1"}
  assert launches[1].shell("/w d") == (
      "cd '/w d' && JAX_COORDINATOR_ADDRESS=a:999 JAX_NUM_PROCESSES=3 JAX_PROCESS_ID=1 "
      "JAXRL_ROLE=learner X=1 run")


@pytest.mark.parametrize("hosts, port, named", [
    ([], 1, "hosts"), (["a", "a"], 1, "distinct"), (["a"], 0, "port")])
def test_bad_plans_name_the_setting(hosts, port, named):
  with pytest.raises(ValueError, match=named):
    cluster.plan(hosts, port=port)


def test_slurm_dry_run(capsys):
  assert slurm.main(["--nodes", "4", "--gpus_per_node", "8", "--partition", "gpu",
                     "--port", "12400", "--nodelist", "gpu[01-04]", "--env", "A=b c",
                     "--dry_run", "--", "python", "-m", "launch.learner_check"]) == 0
  out = capsys.readouterr().out
  for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
               "#SBATCH --partition=gpu", "export JAXRL_COORDINATOR_PORT=12400",
               "export A='b c'", "# submit: sbatch jaxrl-async.sbatch"):
    assert line in out.splitlines(), line
  assert "task python -m launch.learner_check" in out
  tasks = re.findall(r"^task (\d+): (.*)$", out, re.M)
  assert [int(t) for t, _ in tasks] == [0, 1, 2, 3]
  for task, env in tasks:
    role = "controller,learner" if task == "0" else "learner"
    assert env == (f"JAX_COORDINATOR_ADDRESS=gpu01:12400 JAX_NUM_PROCESSES=4 "
                   f"JAX_PROCESS_ID={task} JAXRL_ROLE={role}")
  assert not os.path.exists("jaxrl-async.sbatch")  # a dry run writes nothing


def test_tpu_dry_run_prints_one_command_per_host(capsys):
  assert tpu.main(["--tpu", "slice", "--zone", "us-west4-a", "--project", "p",
                   "--hosts", "10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5", "--dry_run"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 4
  for worker, line in enumerate(lines):
    assert line.startswith("gcloud compute tpus tpu-vm ssh slice --zone=us-west4-a --project=p "
                           f"--worker={worker} ")
    role = "controller,learner" if worker == 0 else "learner"
    # The default command: `train` with every host's devices in one learner mesh.
    assert (f"cd ~/jaxrl_async && JAX_COORDINATOR_ADDRESS=10.0.0.2:12355 JAX_NUM_PROCESSES=4 "
            f"JAX_PROCESS_ID={worker} JAXRL_ROLE={role} python -m launch.train --gin_file "
            "gin/modes/async_partial.gin --gin_file gin/placement/multihost.gin") in line


@pytest.mark.parametrize("launcher, args", [
    (slurm, ["--nodes", "0", "--dry_run"]),
    (slurm, ["--nodes", "2", "--env", "no_equals", "--dry_run"]),
    (tpu, ["--tpu", "t", "--zone", "z", "--hosts", "h0,h0", "--dry_run"]),
    (tpu, ["--tpu", "t", "--zone", "z", "--hosts", "h0", "--port", "70000", "--dry_run"]),
], ids=["no_nodes", "bad_env", "duplicate_hosts", "bad_port"])
def test_bad_launch_settings_exit_2(launcher, args, capsys):
  assert launcher.main(args) == 2
  assert "configuration error" in capsys.readouterr().err


FAKE_SRUN = """#!/bin/bash
# Stand-in for srun on one machine: starts $NTASKS copies of the command with SLURM's variables.
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_NTASKS=$NTASKS SLURM_JOB_NODELIST=127.0.0.1 "$@" > "$LOGS/task$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.slow
def test_sbatch_job_runs_the_learner_check_on_two_tasks(tmp_path):
  from tests.backends.test_distributed import _free_port
  script = tmp_path / "job.sbatch"
  args = slurm.parse_args(["--nodes", "2", "--port", str(_free_port()), "--workdir", REPO,
                           "--", *cluster.LEARNER_CHECK_COMMAND])
  script.write_text(slurm.render(args))  # what `launch.slurm.launch` hands to sbatch
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text(FAKE_SRUN)
  (bin_dir / "srun").chmod(stat.S_IRWXU)
  path = os.pathsep.join([str(bin_dir), os.path.dirname(sys.executable), os.environ["PATH"]])
  env = {**os.environ, "PATH": path, "NTASKS": "2",
         "LOGS": str(tmp_path), "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
         "PYTHONPATH": REPO}
  for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(name, None)
  result = subprocess.run(["bash", str(script)], env=env, timeout=400, capture_output=True,
                          text=True, check=False)
  logs = [(tmp_path / f"task{i}.log").read_text() for i in range(2)]
  assert result.returncode == 0, result.stderr + "\n".join(log[-2000:] for log in logs)
  reports = [json.loads(log.strip().splitlines()[-1]) for log in logs]
  assert [r["process_id"] for r in reports] == [0, 1]
  assert [r["role"] for r in reports] == ["controller,learner", "learner"]
  for report in reports:
    assert (report["num_processes"], report["global_devices"], report["source"]) == (
        2, 4, "slurm")
  assert reports[0]["loss"] == reports[1]["loss"]

