"""How much can running the roles concurrently gain on this machine? One JSON line of ratios.

The async modes gain over sync only by running generation and training at the same time, so
their speedup is bounded by how much two concurrent computations get done compared with running
them one after the other. Measured side by side in one invocation:

- `python_processes`: pure-Python work, 2 processes at once vs one after the other;
- `xla_processes`: a jitted matmul chain (float32, n x n), 2 processes vs one after the other;
- `xla_threads`: the same chain in 2 threads of one process (how the roles run);
- `roles`: the default run's learner update loop and rollout loop (generation + reward) on
  their own, then both at once in two threads: the ceiling of async samples/s over sync
  samples/s for this workload (threads backend), before any pipeline coupling between the roles;
  also the learner on half batches, and from it `learner_fixed_fraction`, the share of an
  update's time that does not grow with its tokens (the simulator's per-update cost);
- `roles_processes`: the same two loops in two processes laid out as the processes backend
  lays out a run (the rollout process pinned to its cores, one XLA thread per core): each
  alone, then both at once; `speedup_over_one_process` is the processes backend's ceiling
  over sync (the two loops one after the other in one process on every core).

A speedup of 2.0 means two computations cost the time of one; 1.0 means no gain at all.

    python benchmarks/concurrency_ceiling.py [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import emit_json_line


def _python_work(_=None) -> None:
  total = 0
  for i in range(15_000_000):
    total += i


def _xla_chain(n: int):
  import jax
  import jax.numpy as jnp

  @jax.jit
  def chain(x):
    for _ in range(4):
      x = jnp.tanh(x @ x)
    return x

  x = jnp.full((n, n), 0.01, jnp.float32)
  chain(x).block_until_ready()
  return chain, x


def _xla_work(n: int, calls: int = 300):
  chain, x = _xla_chain(n)  # compiled before the clock starts

  def work():
    y = x
    for _ in range(calls):
      y = chain(y)
    y.block_until_ready()
  return work


def _worker(kind: str, arg, barrier) -> tuple[float, float]:
  """Prepare, wait for the other workers, then run the work: (start, end) wall-clock times."""
  work = _xla_work(arg) if kind == "xla" else _python_work
  barrier.wait()
  began = time.time()
  work()
  return began, time.time()


def _two_processes(kind: str, arg) -> dict:
  context = mp.get_context("spawn")
  spans = {}
  with context.Manager() as manager:
    for workers in (1, 2):
      barrier = manager.Barrier(workers)
      with context.Pool(workers) as pool:
        results = pool.starmap(_worker, [(kind, arg, barrier)] * workers)
      spans[workers] = max(end for _, end in results) - min(start for start, _ in results)
  return {"one_s": spans[1], "two_at_once_s": spans[2], "speedup": 2 * spans[1] / spans[2]}


def _in_threads(*fns) -> float:
  """Seconds to run the functions at once, one thread each."""
  threads = [threading.Thread(target=fn) for fn in fns]
  began = time.perf_counter()
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  return time.perf_counter() - began


def _two_threads(fn) -> dict:
  alone, both = _in_threads(fn), _in_threads(fn, fn)
  return {"one_s": alone, "two_at_once_s": both, "speedup": 2 * alone / both}


DATA_BATCHES = 16  # rollout batches the learner loop cycles through


def _role_loops(bindings=(), data_batches: int = DATA_BATCHES):
  """The default run's learner update loop and rollout loop (generation + reward), compiled:
  (learn(n, marks=None, half=False), roll(n, marks=None), close(), compile_half()); `marks`
  gets each batch's end time; `half` updates on the first half of each batch's groups; the
  learner cycles through `data_batches` recorded batches."""
  import jax

  import gin
  from jaxrl_async import compilation_cache
  from jaxrl_async.config import RunConfig
  from jaxrl_async.run import build as build_lib
  from launch.train import DEFAULT_GIN, load_config
  compilation_cache.enable()
  load_config([DEFAULT_GIN], list(bindings))
  parts = build_lib.build(gin.get_configurable(RunConfig)(), log=lambda *a: None)
  cfg = parts.config
  batcher = parts.rollout.new_batcher()
  params = build_lib.copy_params(parts.learner.initial_state.params)
  batcher.set_params(parts.rollout.engine.load_params(params), 0)
  next_group = [0]

  def rollout_batch():
    requests = []
    for _ in range(cfg.groups_per_update):
      requests += build_lib.make_group_requests(next(parts.rollout.prompts), next_group[0],
                                                 cfg.group_size, cfg.seed)
      next_group[0] += 1
    samples = parts.rollout.rewards.score_all(batcher.run_to_completion(requests))
    return build_lib.assemble_groups(parts.config, samples)

  data = [rollout_batch() for _ in range(data_batches)]
  state = [parts.learner.initial_state]

  def learn(n, marks=None, half=False):
    for i in range(n):
      groups = data[i % len(data)]
      groups = groups[:max(1, len(groups) // 2)] if half else groups
      state[0], metrics = build_lib.learner_update(parts.learner, state[0], groups, None, 0, 0)
      jax.device_get(metrics)
      if marks is not None:
        marks.append(time.time())

  def roll(n, marks=None):
    for _ in range(n):
      rollout_batch()
      if marks is not None:
        marks.append(time.time())

  def compile_half():
    learn(3 * len(data), half=True)  # the half batches' shapes compiled

  learn(3 * len(data))  # every packed shape of the data compiled
  roll(4)
  return learn, roll, parts.rollout.rewards.close, compile_half


def _roles(batches: int, bindings=(), data_batches: int = DATA_BATCHES) -> dict:
  """The learner loop and the rollout loop of the default run: alone, then in two threads."""
  from jaxrl_async.roles import GIL_SWITCH_INTERVAL_S
  learn, roll, close, compile_half = _role_loops(bindings, data_batches)
  roll(batches // 4)
  learner_s = _in_threads(lambda: learn(batches))
  compile_half()
  half_s = _in_threads(lambda: learn(batches, half=True))
  rollout_s = _in_threads(lambda: roll(batches))
  previous = sys.getswitchinterval()
  sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # as in async runs
  both_s = _in_threads(lambda: learn(batches), lambda: roll(batches))
  sys.setswitchinterval(previous)
  close()
  return {"batches": batches, "learner_ms_per_batch": 1e3 * learner_s / batches,
          "learner_half_ms_per_batch": 1e3 * half_s / batches,
          "learner_fixed_fraction": fixed_fraction(learner_s, half_s),
          "rollout_ms_per_batch": 1e3 * rollout_s / batches,
          "both_in_threads_ms_per_batch": 1e3 * both_s / batches,
          "speedup": (learner_s + rollout_s) / both_s}


def fixed_fraction(full_s: float, half_s: float) -> float:
  """The share of an update's time that does not grow with its tokens, from updates on whole
  and on half batches (t = a + b T: a = 2 t(T / 2) - t(T)), clipped to [0, 0.95]."""
  return min(max((2.0 * half_s - full_s) / full_s, 0.0), 0.95)


def role_process(role: str, batches: int, bindings, barrier, results,
                 data_batches: int = DATA_BATCHES) -> None:
  """In a child: one role's loop, compiled, then run `batches` times after the barrier."""
  learn, roll, close, _ = _role_loops(bindings, data_batches)
  loop = learn if role == "learner" else roll
  barrier.wait()
  began, marks = time.time(), []
  loop(batches, marks)
  results[role] = (began, time.time(), marks)
  close()


def beside_ms_per_batch(times: dict, role: str) -> tuple[float | None, int]:
  """Mean ms of `role`'s batches that began and ended while every role was running (their
  loops overlap in [latest start, earliest end]), and how many there were."""
  start = max(began for began, _, _ in times.values())
  end = min(ended for _, ended, _ in times.values())
  began, _, marks = times[role]
  durations = [b - a for a, b in zip([began, *marks[:-1]], marks, strict=True)
               if a >= start and b <= end]
  return ((1e3 * sum(durations) / len(durations) if durations else None), len(durations))


def _roles_processes(batches: int, bindings, one_process: dict,
                     data_batches: int = DATA_BATCHES) -> dict:
  """The two role loops in two processes laid out as the processes backend lays out a run:
  the learner's process on every core with XLA's default threads, the rollout server pinned
  to its share of the cores with one XLA thread per core (runtime/child.py). Each alone, then
  both at once. `speedup_over_one_process`: the two loops one after the other in one process
  on every core (how sync runs them, from `roles`) over both at once here: the ceiling of the
  processes backend's async samples/s over sync's, before any coupling between the roles.
  `<role>_beside_ms_per_batch`: each role's batches while the other ran (how much each slows
  the other; the layout is uneven, so they need not slow alike)."""
  from jaxrl_async.backends.processes import child
  _, (server_cores,) = child.core_shares(1)
  context = mp.get_context("spawn")
  spans = {}
  with context.Manager() as manager:
    for roles in (("learner",), ("rollout",), ("learner", "rollout")):
      barrier, results = manager.Barrier(len(roles)), manager.dict()
      processes = [child.spawn("benchmarks.concurrency_ceiling:role_process",
                               (role, batches, list(bindings), barrier, results,
                                data_batches),
                               name=f"ceiling-{role}",
                               cores=server_cores if role == "rollout" else None,
                               env=child.child_env(server_cores) if role == "rollout" else None)
                   for role in roles]
      for process in processes:
        process.join(1800)
        if child.reap(process) != 0:
          raise RuntimeError(f"{process.name} failed (exit code {process.exitcode})")
      times = dict(results)
      spans[roles] = (max(end for _, end, _ in times.values())
                      - min(start for start, _, _ in times.values()))
  beside = {role: beside_ms_per_batch(times, role) for role in ("learner", "rollout")}
  both = spans[("learner", "rollout")]
  in_one = (one_process["learner_ms_per_batch"] + one_process["rollout_ms_per_batch"]) * (
      batches / 1e3)
  return {"batches": batches, "rollout_cores": server_cores,
          "learner_ms_per_batch": 1e3 * spans[("learner",)] / batches,
          "rollout_pinned_ms_per_batch": 1e3 * spans[("rollout",)] / batches,
          "both_ms_per_batch": 1e3 * both / batches,
          "learner_beside_ms_per_batch": beside["learner"][0],
          "learner_beside_batches": beside["learner"][1],
          "rollout_beside_ms_per_batch": beside["rollout"][0],
          "rollout_beside_batches": beside["rollout"][1],
          "speedup_over_one_process": in_one / both}


def ceiling(backend: str, batches: int, bindings=(), data_batches: int = DATA_BATCHES) -> dict:
  """Core overlap's ceiling of async samples/s over sync's for `backend`, from the default run's
  learner and rollout loops (`bindings` on top): 'threads' runs them in two threads of one
  process (`roles`); 'processes' and 'ray' (rollout servers in processes of their own) in the
  processes backend's layout (`roles_processes`), against both loops in one process.
  `data_batches`: the rollout batches the learner loop cycles through."""
  roles = _roles(batches, bindings, data_batches)
  if backend == "threads":
    return {"kind": "core_overlap", "layout": "threads", "speedup": roles["speedup"],
            "roles": roles}
  layout = _roles_processes(batches, bindings, roles, data_batches)
  return {"kind": "core_overlap", "layout": "processes",
          "speedup": layout["speedup_over_one_process"], "roles": roles,
          "roles_processes": layout}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--matrix", type=int, default=256, help="n of the n x n matmul chain")
  parser.add_argument("--batches", type=int, default=200, help="batches per role loop")
  parser.add_argument("--data_batches", type=int, default=DATA_BATCHES,
                      help="rollout batches recorded for the learner loop to cycle through")
  parser.add_argument("--out", default=None)
  parser.add_argument("--gin_bindings", action="append", default=[],
                      help="bindings on top of the default run's gin file")
  args = parser.parse_args(argv)
  if args.data_batches < 1:
    parser.error(f"--data_batches must be >= 1, got {args.data_batches}")
  record = {"benchmark": "concurrency_ceiling", "cpu_count": os.cpu_count(),
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "gin_bindings": list(args.gin_bindings)}
  print("python processes ...", file=sys.stderr, flush=True)
  record["python_processes"] = _two_processes("python", None)
  print("xla processes ...", file=sys.stderr, flush=True)
  record["xla_processes"] = _two_processes("xla", args.matrix)
  print("xla threads ...", file=sys.stderr, flush=True)
  record["xla_threads"] = _two_threads(_xla_work(args.matrix))
  print("roles (default run) ...", file=sys.stderr, flush=True)
  record["roles"] = _roles(args.batches, args.gin_bindings, args.data_batches)
  print("roles as processes (the processes backend's layout) ...", file=sys.stderr, flush=True)
  record["roles_processes"] = _roles_processes(args.batches, args.gin_bindings, record["roles"],
                                               args.data_batches)
  emit_json_line(record, args.out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
