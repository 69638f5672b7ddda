"""Start a command on every host of a multi-host Cloud TPU VM slice, `jax.distributed` set up.

    python -m launch.tpu.launch --tpu my-v5e-32 --zone us-west4-a \
        --hosts 10.0.0.2,10.0.0.3,10.0.0.4,10.0.0.5 --dry_run
    python -m launch.tpu.launch --tpu my-v5e-32 --zone us-west4-a --hosts ... -- \
        python -m launch.learner_check --mesh 1,-1,4

`--hosts` lists the workers' internal addresses in worker order (e.g. from
`gcloud compute tpus tpu-vm describe NAME --zone ZONE --format='value(networkEndpoints[].ipAddress)'`);
worker 0 is the coordinator and the controller. One `gcloud compute tpus tpu-vm ssh --worker=i`
command per host sets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID and JAXRL_ROLE
and runs the command (default: `python -m launch.train` with the multi-process learner's mesh;
`python -m launch.learner_check` on request) in `--workdir`. `--dry_run` prints the
commands; without it they run at once, one per host, and are waited for (`--timeout_s`).
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time

from jaxrl_async import distributed
from launch import cluster


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="python -m launch.tpu.launch", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tpu", required=True, help="the TPU VM's name")
  parser.add_argument("--zone", required=True)
  parser.add_argument("--project", default=None)
  parser.add_argument("--hosts", required=True, help="workers' internal addresses, in order")
  parser.add_argument("--port", type=int, default=distributed.DEFAULT_COORDINATOR_PORT)
  parser.add_argument("--workdir", default="~/jaxrl_async", help="checkout on every host")
  parser.add_argument("--env", action="append", default=[], help="NAME=value for every host")
  parser.add_argument("--dry_run", action="store_true", help="print, do not run")
  parser.add_argument("--timeout_s", type=float, default=24 * 3600.0)
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="-- COMMAND ... (default: jaxrl-async train, multi-process)")
  args = parser.parse_args(argv)
  args.command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
  return args


def ssh_commands(args) -> list[list[str]]:
  hosts = [host.strip() for host in args.hosts.split(",") if host.strip()]
  launches = cluster.plan(hosts, args.command or cluster.DEFAULT_COMMAND, port=args.port,
                          extra_env=cluster.parse_env(args.env))
  base = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.tpu, f"--zone={args.zone}"]
  if args.project:
    base.append(f"--project={args.project}")
  # The workdir is left unquoted so that a leading ~ expands on the host.
  return [base + [f"--worker={launch.process_id}",
                  f"--command=cd {args.workdir} && {launch.shell()}"] for launch in launches]


def run_all(commands, timeout_s: float) -> int:
  procs = [subprocess.Popen(command) for command in commands]
  deadline = time.monotonic() + timeout_s
  codes = []
  try:
    for proc in procs:
      codes.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.0)))
  except subprocess.TimeoutExpired:
    print(f"launch.tpu: hosts still running after --timeout_s={timeout_s}; stopping them",
          file=sys.stderr)
    return 124
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
  return max(codes, default=0)


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    commands = ssh_commands(args)
  except ValueError as error:
    print(f"launch.tpu: configuration error: {error}", file=sys.stderr)
    return 2
  if args.dry_run:
    for command in commands:
      print(shlex.join(command))
    return 0
  try:
    return run_all(commands, args.timeout_s)
  except FileNotFoundError:
    print("launch.tpu: gcloud not found: install the Google Cloud CLI", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
