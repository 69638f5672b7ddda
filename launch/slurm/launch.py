"""Submit a multi-node job to SLURM: one task per node, `jax.distributed` set up in each.

    python -m launch.slurm.launch --nodes 4 --gpus_per_node 8 --partition gpu --dry_run
    python -m launch.slurm.launch --nodes 2 -- python -m launch.learner_check --mesh 1,-1,2

The command (default: `python -m launch.train` with the multi-process learner's mesh,
`launch/cluster.py`'s DEFAULT_COMMAND; the learner check `python -m launch.learner_check` on
request) runs once on every node. `--dry_run` prints the sbatch script, the sbatch command line and, for each task, the
`jax.distributed` settings and role it resolves to from SLURM's variables (with `--nodelist`
naming the nodes, e.g. 'gpu[01-04]'); without it the script is written to `--script` and
submitted with sbatch.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import subprocess
import sys

from jaxrl_async import distributed
from launch import cluster

TEMPLATE = pathlib.Path(__file__).with_name("job.sbatch")
REPO = pathlib.Path(__file__).resolve().parents[2]


def parse_args(argv=None):
  parser = argparse.ArgumentParser(prog="python -m launch.slurm.launch", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--nodes", type=int, required=True, help="nodes = JAX processes")
  parser.add_argument("--gpus_per_node", type=int, default=0)
  parser.add_argument("--partition", default=None)
  parser.add_argument("--account", default=None)
  parser.add_argument("--time", default="01:00:00", help="wall-clock limit (HH:MM:SS)")
  parser.add_argument("--job_name", default="jaxrl-async")
  parser.add_argument("--port", type=int, default=distributed.DEFAULT_COORDINATOR_PORT)
  parser.add_argument("--workdir", default=str(REPO), help="directory the tasks run in")
  parser.add_argument("--output", default="slurm-%j.out")
  parser.add_argument("--env", action="append", default=[], help="NAME=value for every task")
  parser.add_argument("--nodelist", default=None,
                      help="the nodes, for --dry_run's per-task table (e.g. 'gpu[01-04]')")
  parser.add_argument("--script", default="jaxrl-async.sbatch", help="where to write the job")
  parser.add_argument("--dry_run", action="store_true", help="print, do not submit")
  parser.add_argument("--submit_timeout_s", type=float, default=60.0)
  parser.add_argument("command", nargs=argparse.REMAINDER,
                      help="-- COMMAND ... (default: jaxrl-async train, multi-process)")
  args = parser.parse_args(argv)
  args.command = tuple(args.command[1:] if args.command[:1] == ["--"] else args.command)
  return args


def render(args) -> str:
  if args.nodes < 1:
    raise ValueError(f"--nodes must be >= 1, got {args.nodes}")
  if args.gpus_per_node < 0:
    raise ValueError(f"--gpus_per_node must be >= 0, got {args.gpus_per_node}")
  directives = [f"#SBATCH --gpus-per-node={args.gpus_per_node}"] if args.gpus_per_node else []
  directives += [f"#SBATCH --partition={args.partition}"] if args.partition else []
  directives += [f"#SBATCH --account={args.account}"] if args.account else []
  exports = "\n".join(f"export {name}={shlex.quote(value)}"
                      for name, value in cluster.parse_env(args.env).items())
  return TEMPLATE.read_text().format(
      job_name=args.job_name, nodes=args.nodes, time=args.time, output=args.output,
      extra_directives="\n".join(directives), port=args.port, exports=exports,
      workdir=shlex.quote(args.workdir), controller_role=cluster.CONTROLLER_ROLE,
      learner_role=cluster.LEARNER_ROLE,
      command=shlex.join(args.command or cluster.DEFAULT_COMMAND))


def task_table(args) -> list[str]:
  """What each task resolves to from SLURM's variables (as `distributed.cluster_spec` does)."""
  lines = []
  for task in range(args.nodes):
    env = {"SLURM_PROCID": str(task), "SLURM_NTASKS": str(args.nodes),
           "SLURM_JOB_NODELIST": args.nodelist, "JAXRL_COORDINATOR_PORT": str(args.port)}
    spec = distributed.cluster_spec(env=env)
    resolved = {**spec.env(), "JAXRL_ROLE": cluster.role_of(spec.process_id)}
    lines.append(f"task {task}: " + " ".join(f"{k}={v}" for k, v in resolved.items()))
  return lines


def main(argv=None) -> int:
  args = parse_args(argv)
  try:
    script = render(args)
    table = task_table(args) if args.nodelist else []
  except ValueError as error:
    print(f"launch.slurm: configuration error: {error}", file=sys.stderr)
    return 2
  submit = ["sbatch", args.script]
  if args.dry_run:
    print(f"# {args.script}\n{script}")
    print("# submit: " + shlex.join(submit))
    for line in table:
      print(line)
    return 0
  with open(args.script, "w", encoding="utf-8") as f:
    f.write(script)
  os.chmod(args.script, 0o755)
  try:
    result = subprocess.run(submit, timeout=args.submit_timeout_s, check=False)
  except FileNotFoundError:
    print("launch.slurm: sbatch not found: run this on a SLURM login node", file=sys.stderr)
    return 2
  return result.returncode


if __name__ == "__main__":
  sys.exit(main())
