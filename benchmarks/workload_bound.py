"""The bound a workload's own work sets on any schedule: each role alone, at its fastest.

No schedule of the roles makes samples faster than its slowest role makes them when that role
never waits. Measured one role at a time, laid out on the cores as `--backend` lays out a run:

- `rollout`: generation with every decode slot full (requests queued beyond the slots, timed
  until as many samples finished as were asked for, before the queue ever runs dry), no learner
  and no reward running; on the processes backend in one child per rollout server, each
  pinned to its server's cores with its XLA threads (`backends.processes.child`; the servers'
  rates added), on the threads backend in this process;
- `reward`: the samples just generated scored by the run's reward pool with at least as many
  callers as the verifier has slots, so the service (the task's `services`, e.g. the RLVR
  workload's verifier process) verifies at its concurrency limit; the callers sit where the
  run's reward pool sits (the rollout server); a task without a service scores in-process;
- `learner`: updates on the recorded samples' groups (`groups_per_update` groups a batch, the
  window's anchors as the run computes them), no rollout running, in this process on every
  core, as the learner runs.

Each role's figure is seconds per sample; the roles' bound is the largest of them.

The roles share the machine's cores in a run, so a second bound holds beside it: no schedule
makes samples faster than the cores can do the roles' work. Each role's work is its core-seconds
per sample (`work_s_per_sample`): the rollout's and the reward's CPU time in their process (the
reward's with the verifier process's), and the learner's wall time on one core (a child pinned
to one core with one XLA thread: the CPU time of a multi-threaded update counts its threads'
spin-waits too). The cores' bound is their sum over the cores the run has (`cores_bound`); the
bound is the larger of the two, and `slowest_role` names the role, or 'cores'.
Against a sync run measured on the same machine, `ceiling_speedup(sync_samples_per_s, bound)`
is the most an async schedule can gain, and `fraction_of_ceiling(samples_per_s, bound)` how
much of the bound's rate a run reached (1.0: the slowest role never waited). Weight publishing
and evaluation are not counted (they are work on top of the three roles).

    python benchmarks/workload_bound.py --gin_file gin/recipes/verl_fully_async.gin \
        --gin_file gin/tasks/rlvr.gin --backend processes
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import common, learner_alone
from benchmarks.common import emit_json_line

ROLES = ("rollout", "reward", "learner")
BARRIER_TIMEOUT_S = 600.0  # the rollout servers' children meet before each phase


# ---- the figures (pure) --------------------------------------------------------------------
def _check_figures(figures: dict[str, float], what: str) -> None:
  for role, value in figures.items():
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
      raise ValueError(f"role {role!r}: {what} must be positive and finite, got {value!r}")
  if not figures:
    raise ValueError("no role measured")


def bound_figures(seconds_per_sample: dict[str, float],
                  work_s_per_sample: dict[str, float] | None = None, cores: int = 1) -> dict:
  """{'slowest_role', 'bound_s_per_sample', 'bound_samples_per_s', 'roles_bound_s_per_sample'}
  from each role's seconds per sample alone; with each role's core-seconds of work per sample
  and the run's `cores`, also 'cores_bound_s_per_sample' = sum(work) / cores, and the bound is
  the larger of the two ('cores' the slowest role when the cores' bound is). ValueError for a
  figure that is not positive and finite."""
  _check_figures(seconds_per_sample, "seconds per sample")
  slowest = max(seconds_per_sample, key=seconds_per_sample.get)
  roles_bound = bound = seconds_per_sample[slowest]
  out = {"roles_bound_s_per_sample": roles_bound}
  if work_s_per_sample is not None:
    _check_figures(work_s_per_sample, "work per sample")
    if not isinstance(cores, int) or cores < 1:
      raise ValueError(f"cores must be an int >= 1, got {cores!r}")
    cores_bound = sum(work_s_per_sample.values()) / cores
    out.update(cores=cores, cores_bound_s_per_sample=cores_bound)
    if cores_bound > roles_bound:
      slowest, bound = "cores", cores_bound
  return {"slowest_role": slowest, "bound_s_per_sample": bound,
          "bound_samples_per_s": 1.0 / bound, **out}


def ceiling_speedup(sync_samples_per_s: float, bound_s_per_sample: float) -> float:
  """The most an async schedule can gain over sync: sync's seconds per sample over the bound."""
  return (1.0 / sync_samples_per_s) / bound_s_per_sample


def fraction_of_ceiling(samples_per_s: float, bound_s_per_sample: float) -> float:
  """A run's samples/s as a fraction of the bound's rate (its speedup over sync as a fraction of
  the ceiling speedup: the two are the same number)."""
  return samples_per_s * bound_s_per_sample


# ---- the roles -----------------------------------------------------------------------------
def load_run_config(gin_files, bindings):
  """The RunConfig of `gin_files` (in order) with `bindings` on top, as `jaxrl-async train`
  reads it."""
  import gin
  from jaxrl_async.config import RunConfig
  from launch.train import load_config
  load_config(list(gin_files), list(bindings))
  try:
    return gin.get_configurable(RunConfig)()
  finally:
    gin.clear_config()


def _base_params(config, spec):
  from jaxrl_async import sharding
  from jaxrl_async.learner.sft import cached_base_policy
  mesh = sharding.place_roles(config.learner_mesh).learner
  return cached_base_policy(spec.task, spec.model_config, config.warm_start, mesh,
                            log=lambda *a: None)


def rollout_at_full_slots(config):
  """(rollout side, its batcher on the base policy, `requests(count)`, reward callers): the
  run's rollout side with max(reward_workers, verifier slots) reward callers, its prefill and
  decode compiled on one batch of requests before any clock starts."""
  from jaxrl_async.run import build as build_lib
  verifier = getattr(config.task, "verifier", None)
  callers = max(config.reward_workers, getattr(verifier, "concurrency", 0))
  config = dataclasses.replace(config, reward_workers=callers)
  side = build_lib.build_rollout_side(config)
  batcher = side.new_batcher()
  batcher.set_params(side.engine.load_params(_base_params(config, side.spec)), 0)
  groups = iter(range(1_000_000_000))

  def requests(count: int) -> list:
    out = []
    while len(out) < count:
      out += side.make_requests(next(side.prompts), next(groups), None)
    return out

  batcher.run_to_completion(requests(config.max_concurrent_decodes))
  return side, batcher, requests, callers


def measure_rollout_and_reward(config, samples: int, repeats: int = 3, *, score: bool = True,
                               barrier=None) -> dict:
  """In the process that generates: `samples` samples at full slots, timed; then those samples
  scored by a reward pool with max(reward_workers, verifier slots) callers, timed; each
  `repeats` times, the fastest pass kept (a role that never waits runs at its fastest).
  `score=False` only generates; `barrier` (shared with the other servers' children) is waited
  on before the rollout's passes and before the reward's, so the servers generate together and
  the reward is timed with no generation running.
  -> {'rollout': {...}, 'reward': {...} (with `score`), 'samples': the scored samples}."""
  side, batcher, requests, callers = rollout_at_full_slots(config)
  slots = config.max_concurrent_decodes
  max_steps = (samples + slots) * (side.task.max_response_len + 1)  # every sample is capped
  if barrier is not None:
    barrier.wait()
  passes, done = [], []
  for _ in range(repeats):
    batcher.submit(requests(samples + slots))  # the queue outlasts the timed samples
    done, steps = [], 0
    began, cpu_began = time.perf_counter(), time.process_time()
    while len(done) < samples:
      done += batcher.step()
      steps += 1
      if steps > max_steps:
        raise RuntimeError(f"{steps} decode steps made {len(done)} of {samples} samples")
    passes.append((time.perf_counter() - began, steps, time.process_time() - cpu_began))
    batcher.take_pending()
    batcher.abort_active()
  done = done[:samples]
  if barrier is not None:
    barrier.wait()
  lengths = [len(s.response_tokens) for s in done]
  rollout_s, steps, rollout_cpu_s = min(passes)
  rollout = {"samples": len(done), "s": rollout_s, "slots": slots, "steps": steps,
             "s_per_sample": rollout_s / len(done), "passes_s": [p for p, _, _ in passes],
             "cpu_s": rollout_cpu_s, "work_s_per_sample": rollout_cpu_s / len(done),
             "response_len_mean": sum(lengths) / len(lengths)}
  if not score:
    side.rewards.close()
    return {"rollout": rollout}
  reward_passes = []
  verifiers = verifier_processes()
  for _ in range(repeats):  # the same answers each pass: the same drawn latencies
    cpu_began = time.process_time() + processes_cpu_s(verifiers)
    began = time.perf_counter()
    scored = side.rewards.score_all(done)
    reward_passes.append((time.perf_counter() - began,
                          time.process_time() + processes_cpu_s(verifiers) - cpu_began))
  side.rewards.close()
  data = side.task.data_metrics() if hasattr(side.task, "data_metrics") else {}
  reward_s, reward_cpu_s = min(reward_passes)
  return {
      "rollout": rollout,
      "reward": {"samples": len(scored), "s": reward_s, "callers": callers,
                 "s_per_sample": reward_s / len(scored),
                 "passes_s": [p for p, _ in reward_passes], "cpu_s": reward_cpu_s,
                 "work_s_per_sample": reward_cpu_s / len(scored),
                 "verifier_processes": len(verifiers),
                 **{key.split("/", 1)[1]: value for key, value in data.items()
                    if key.startswith("verifier/")}},
      "samples": scored}


def verifier_processes() -> list:
  """The task's verifier service processes (children of this process or of its parent, the
  run's main process), whose CPU the reward's work includes."""
  import psutil
  found = []
  for parent in {os.getpid(), os.getppid()}:
    with contextlib.suppress(psutil.Error):
      for process in psutil.Process(parent).children():
        with contextlib.suppress(psutil.Error):
          if "jaxrl_async.tasks.verifier_server" in " ".join(process.cmdline()):
            found.append(process)
  return found


def processes_cpu_s(processes) -> float:
  """User + system CPU seconds of `processes` so far (0 for one that ended)."""
  import psutil
  total = 0.0
  for process in processes:
    with contextlib.suppress(psutil.Error):
      times = process.cpu_times()
      total += times.user + times.system
  return total


def rollout_child(config, samples: int, repeats: int, result_path: str, score: bool = True,
                  barrier=None) -> None:
  """In a rollout server's place (a spawned, pinned child): `measure_rollout_and_reward`, its
  result pickled to `result_path`."""
  from jaxrl_async import compilation_cache
  compilation_cache.enable()
  result = measure_rollout_and_reward(config, samples, repeats, score=score, barrier=barrier)
  with open(result_path, "wb") as f:
    pickle.dump(result, f)


def _rollout_in_children(config, samples: int, repeats: int) -> dict:
  """`measure_rollout_and_reward` in one spawned child per rollout server, each on the server's
  cores (`child.core_shares`), generating at once (`samples` samples each): the rollout's rate
  is the servers' rates added. Only the first server then scores, alone (its callers keep the
  shared verifier at its limit; more callers would only queue)."""
  from jaxrl_async.backends.processes import child
  servers = config.num_rollout_servers
  _, shares = child.core_shares(servers)
  context = mp.get_context("spawn")
  with tempfile.TemporaryDirectory() as root, context.Manager() as manager:
    barrier = manager.Barrier(servers, timeout=BARRIER_TIMEOUT_S) if servers > 1 else None
    paths = [os.path.join(root, f"rollout-{i}.pkl") for i in range(servers)]
    processes = [child.spawn("benchmarks.workload_bound:rollout_child",
                             (config, samples, repeats, path, i == 0, barrier),
                             name=f"bound-rollout-{i}", cores=cores, env=child.child_env(cores))
                 for i, (path, cores) in enumerate(zip(paths, shares, strict=True))]
    results = common.collect_children(processes, paths, 1800, "a rollout measurement's child")
  result = results[0]
  if servers > 1:
    rate = sum(1.0 / r["rollout"]["s_per_sample"] for r in results)
    result["rollout"] = {**result["rollout"], "servers": servers, "s_per_sample": 1.0 / rate,
                         "per_server_s_per_sample": [r["rollout"]["s_per_sample"]
                                                     for r in results]}
  result["rollout"]["cores"] = shares
  return result


def bound(backend: str, gin_files, bindings=(), *, samples: int = 2048,
          updates: int = 100, repeats: int = 3, together_s: float = 0.0) -> dict:
  """Each role of the run `gin_files` + `bindings` describes, alone, laid out as `backend`
  ('threads': one process; 'processes' or 'ray': generation and reward in a child on the
  rollout server's cores), and the bound they imply (`bound_figures`); with `together_s`,
  also every role at once in `repeats` windows of that many seconds (`together`,
  `workload_together.measure_together`)."""
  from benchmarks import workload_together  # here: it builds on this module
  from jaxrl_async import compilation_cache
  from jaxrl_async.run.services import task_services
  if backend not in ("threads", "processes", "ray"):
    raise ValueError(f"backend must be 'threads', 'processes' or 'ray', got {backend!r}")
  if min(samples, updates, repeats) < 1:
    raise ValueError(f"samples, updates and repeats must be >= 1, got {samples}, {updates} "
                     f"and {repeats}")
  compilation_cache.enable()
  config = load_run_config(gin_files, bindings)
  if backend != "threads" and config.mode != "sync":  # as the run is configured (its servers)
    config = load_run_config(gin_files, [*bindings, f"RunConfig.backend = '{backend}'"])
  with task_services(config, log=lambda *a: None) as run_config:
    if backend == "threads":
      measured = measure_rollout_and_reward(run_config, samples, repeats)
    else:
      measured = _rollout_in_children(run_config, samples, repeats)
    scored = measured.pop("samples")
    learner = learner_alone.measure_learner(run_config, scored, updates, repeats)
    one_core = learner_alone.measure_learner_on_one_core(run_config, scored, updates, repeats)
    together = None if not together_s else workload_together.measure_together(
        run_config, scored, backend, seconds=together_s, passes=repeats)
  learner.update(one_core_s_per_sample=one_core["s_per_sample"],
                 work_s_per_sample=one_core["s_per_sample"])
  roles = {**measured, "learner": learner}
  cores = len(os.sched_getaffinity(0))
  return {"kind": "workload_bound", "layout": "threads" if backend == "threads" else
          "processes", "gin_files": list(gin_files), "gin_bindings": list(bindings),
          "roles": roles, **({} if together is None else {"together": together}),
          **bound_figures({role: roles[role]["s_per_sample"] for role in ROLES},
                                          {role: roles[role]["work_s_per_sample"]
                                           for role in ROLES}, cores)}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gin_file", action="append", default=None,
                      help="the run's gin files in order (default: gin/modes/sync.gin and "
                           "gin/tasks/rlvr.gin)")
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--backend", choices=("threads", "processes", "ray"), default="processes")
  parser.add_argument("--samples", type=int, default=2048, help="samples generated and scored")
  parser.add_argument("--updates", type=int, default=100, help="learner updates timed")
  parser.add_argument("--repeats", type=int, default=3,
                      help="passes per role; the fastest is kept")
  parser.add_argument("--together_s", type=float, default=0.0,
                      help="also every role at once, in --repeats windows of this many "
                           "seconds (benchmarks/workload_together.py); 0 skips it")
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if min(args.samples, args.updates, args.repeats) < 1:
    parser.error(f"--samples, --updates and --repeats must be >= 1, got {args.samples}, "
                 f"{args.updates} and {args.repeats}")
  if args.together_s < 0:
    parser.error(f"--together_s must be >= 0, got {args.together_s}")
  os.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  files = args.gin_file or ["gin/modes/sync.gin", "gin/tasks/rlvr.gin"]
  record = bound(args.backend, files, args.gin_bindings, samples=args.samples,
                 updates=args.updates, repeats=args.repeats, together_s=args.together_s)
  emit_json_line({"benchmark": "workload_bound", "cpu_count": os.cpu_count(),
                  "load_average": os.getloadavg(), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
                  **record}, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
