"""What a cluster launch starts: one process per host, `jax.distributed` settings and a role each.

Role placement: every process joins the learner's global mesh (one SPMD program,
`jaxrl_async.distributed`); process 0 is also the controller, the one process that
writes results (metrics, checkpoints, the learner check's output). `JAXRL_ROLE` tells each
process which it is ('controller,learner' or 'learner').

The SLURM and Cloud TPU launchers (`launch/slurm`, `launch/tpu`) turn a plan into an sbatch job
or into one ssh command per TPU host.
"""

from __future__ import annotations

import dataclasses
import shlex

from jaxrl_async.distributed import DEFAULT_COORDINATOR_PORT, ClusterSpec

DEFAULT_COMMAND = ("python", "-m", "launch.train", "--gin_file", "gin/modes/async_partial.gin",
                   "--gin_file", "gin/placement/multihost.gin", "--no_progress")
LEARNER_CHECK_COMMAND = ("python", "-m", "launch.learner_check", "--mesh", "1,-1,1")
CONTROLLER_ROLE = "controller,learner"
LEARNER_ROLE = "learner"


@dataclasses.dataclass(frozen=True)
class ProcessLaunch:
  process_id: int
  host: str
  env: dict[str, str]
  command: tuple[str, ...]

  @property
  def role(self) -> str:
    return self.env["JAXRL_ROLE"]

  def shell(self, workdir: str | None = None) -> str:
    """The command line a host runs: cd, the environment, the command."""
    env = " ".join(f"{name}={shlex.quote(value)}" for name, value in self.env.items())
    line = f"{env} {shlex.join(self.command)}"
    return f"cd {shlex.quote(workdir)} && {line}" if workdir else line


def role_of(process_id: int) -> str:
  return CONTROLLER_ROLE if process_id == 0 else LEARNER_ROLE


def plan(hosts: list[str], command=DEFAULT_COMMAND, *, port: int = DEFAULT_COORDINATOR_PORT,
         extra_env: dict[str, str] | None = None) -> list[ProcessLaunch]:
  """One process per host; host 0 is the coordinator (and the controller)."""
  if not hosts:
    raise ValueError("hosts must name at least one host")
  if len(set(hosts)) != len(hosts):
    raise ValueError(f"hosts must be distinct (one process per host), got {hosts}")
  if not 0 < port < 65536:
    raise ValueError(f"port must be in [1, 65535], got {port}")
  if not command:
    raise ValueError("command must not be empty")
  coordinator = f"{hosts[0]}:{port}"
  launches = []
  for process_id, host in enumerate(hosts):
    spec = ClusterSpec(coordinator, len(hosts), process_id, "arguments")
    env = {**spec.env(), "JAXRL_ROLE": role_of(process_id), **(extra_env or {})}
    launches.append(ProcessLaunch(process_id, host, env, tuple(command)))
  return launches


def parse_env(pairs) -> dict[str, str]:
  """['NAME=value', ...] -> dict, with a clear error for a malformed entry."""
  env = {}
  for pair in pairs or ():
    name, sep, value = pair.partition("=")
    if not sep or not name.isidentifier():
      raise ValueError(f"--env entries must be NAME=value, got {pair!r}")
    env[name] = value
  return env
