"""Every role at once, none waiting: the rate each role keeps while the others work beside it.

`workload_bound` times each role alone. In a run on one machine the roles share its cores,
caches and memory bandwidth, so each is slower beside the others than alone, and no schedule
gets that back. This measures it: for a window of wall-clock the rollout generates at full slots
and its reward pool scores every finished batch as the run's Rollouter does (the verifier
service at its concurrency limit), where the run's rollout servers sit (one child per server on
its cores, as `child.core_shares` lays them out; a thread of this process for the threads
layout), while the learner updates on recorded batches in this process (`learner_alone`).
Nothing passes between them, so neither ever waits on the other.

Each role's figure is seconds per sample over the window (the rollout's: samples generated and
scored by the window's end, the servers' rates added; the learner's: samples consumed by the
updates that ended in the window). `together_s_per_sample` is the slower role's; of `passes`
windows, the one with the smallest is kept. It is a reference, not a bound: a run whose roles
are not all busy at once slows them less, and can beat it. A run's samples/s times it
(`fraction_of_together`) says how much of what the roles make side by side the run's schedule
turned into samples; the rest of the gap to `workload_bound`'s bound is the machine's sharing.
Weight publishing and evaluation are not counted.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import pickle
import tempfile
import threading
import time

from benchmarks import common, learner_alone, workload_bound

BARRIER_TIMEOUT_S = 600.0  # every side compiles before the first window


def together_figures(rollout_s_per_sample: float, learner_s_per_sample: float) -> dict:
  """{'slowest_role', 'together_s_per_sample', 'together_samples_per_s'} of one window.
  ValueError for a figure that is not positive and finite."""
  figures = {"rollout": rollout_s_per_sample, "learner": learner_s_per_sample}
  for role, value in figures.items():
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
      raise ValueError(f"role {role!r}: seconds per sample must be positive and finite, "
                       f"got {value!r}")
  slowest = max(figures, key=figures.get)
  return {"slowest_role": slowest, "together_s_per_sample": figures[slowest],
          "together_samples_per_s": 1.0 / figures[slowest]}


def fraction_of_together(samples_per_s: float, together_s_per_sample: float) -> float:
  """A run's samples/s as a fraction of the roles' rate side by side."""
  return samples_per_s * together_s_per_sample


# ---- the roles, each for a window -------------------------------------------------------
def rollout_windows(config, seconds: float, passes: int, barrier) -> list[dict]:
  """In the rollout's place: generation at full slots, each step's finished samples scored by
  the reward pool as they finish, for `passes` windows of `seconds`, each begun at `barrier`.
  Per window: samples generated, samples scored by its end, its seconds and CPU seconds."""
  side, batcher, requests, _ = workload_bound.rollout_at_full_slots(config)
  try:
    return _windows(side, batcher, requests, config.max_concurrent_decodes, seconds, passes,
                    barrier)
  finally:
    side.rewards.close()


def _windows(side, batcher, requests, slots: int, seconds: float, passes: int, barrier):
  windows = []
  for _ in range(passes):
    lock, scored, pending = threading.Lock(), [0], []
    barrier.wait()
    began, cpu_began = time.perf_counter(), time.process_time()
    deadline, generated = began + seconds, 0

    def on_scored(future, deadline=deadline, lock=lock, scored=scored):
      if time.perf_counter() <= deadline:
        with lock:
          scored[0] += len(future.result())

    while time.perf_counter() < deadline:
      if batcher.num_pending < slots:
        batcher.submit(requests(2 * slots))  # the queue never runs dry
      done = batcher.step()
      if done:
        generated += len(done)
        future = side.rewards.submit_many(list(done))
        future.add_done_callback(on_scored)
        pending.append(future)
    elapsed, cpu_s = time.perf_counter() - began, time.process_time() - cpu_began
    for future in pending:  # the window's scoring ends before the next window
      future.result(timeout=BARRIER_TIMEOUT_S)
    batcher.take_pending()
    batcher.abort_active()
    with lock:
      windows.append({"s": elapsed, "generated": generated, "scored": scored[0],
                      "cpu_s": cpu_s})
  return windows


def rollout_child(config, seconds: float, passes: int, barrier, result_path: str) -> None:
  """In a rollout server's place (a spawned, pinned child): `rollout_windows`, pickled."""
  from jaxrl_async import compilation_cache
  compilation_cache.enable()
  try:
    result = rollout_windows(config, seconds, passes, barrier)
  except BaseException:
    barrier.abort()  # the learner's side stops waiting for this one
    raise
  with open(result_path, "wb") as f:
    pickle.dump(result, f)


def learner_windows(update, warm: int, seconds: float, passes: int, barrier) -> list[dict]:
  """Updates (`learner_alone.learner_updates`) for `passes` windows of `seconds`, each begun
  at `barrier`; per window the samples of the updates that ended in it and their seconds."""
  for i in range(warm):
    update(i)
  windows, i = [], 0
  for _ in range(passes):
    barrier.wait()
    began = time.perf_counter()
    deadline, consumed, ended = began + seconds, 0, began
    while True:
      samples = update(i)
      i += 1
      now = time.perf_counter()
      if now > deadline:
        break
      consumed, ended = consumed + samples, now
    windows.append({"s": ended - began, "consumed": consumed})
  return windows


def _rate(samples: int, seconds: float, role: str) -> float:
  if samples <= 0 or seconds <= 0:
    raise RuntimeError(f"the {role} made no sample in a window of {seconds:.2f} s: lengthen "
                       "the window")
  return samples / seconds


def measure_together(config, scored, backend: str, *, seconds: float = 5.0,
                     passes: int = 3) -> dict:
  """Every role at once for `passes` windows of `seconds` (the module's docstring), laid out
  as `backend` lays out a run; the learner on `scored`, recorded samples."""
  from jaxrl_async.backends.processes import child
  if seconds <= 0 or passes < 1:
    raise ValueError(f"seconds must be > 0 and passes >= 1, got {seconds} and {passes}")
  update, warm = learner_alone.learner_updates(config, scored)
  if backend == "threads":
    barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S)
    out: dict = {}

    def rollout() -> None:
      try:
        out["windows"] = rollout_windows(config, seconds, passes, barrier)
      except BaseException as error:  # raised in this thread below, after the join
        out["error"] = error
        barrier.abort()

    thread = threading.Thread(target=rollout, name="together-rollout")
    thread.start()
    learner = None
    try:
      learner = learner_windows(update, warm, seconds, passes, barrier)
    except threading.BrokenBarrierError:
      pass  # the rollout's thread failed: its error is raised below
    except BaseException:
      barrier.abort()
      raise
    finally:
      thread.join(BARRIER_TIMEOUT_S + passes * seconds)
    if "windows" not in out or learner is None:
      raise RuntimeError("the rollout's thread of the together measurement failed") from (
          out.get("error"))
    servers = [out["windows"]]
    shares = None
  else:
    _, shares = child.core_shares(config.num_rollout_servers)
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as root, context.Manager() as manager:
      barrier = manager.Barrier(len(shares) + 1, timeout=BARRIER_TIMEOUT_S)
      paths = [os.path.join(root, f"together-{i}.pkl") for i in range(len(shares))]
      processes = [child.spawn("benchmarks.workload_together:rollout_child",
                               (config, seconds, passes, barrier, path),
                               name=f"together-rollout-{i}", cores=cores,
                               env=child.child_env(cores))
                   for i, (path, cores) in enumerate(zip(paths, shares, strict=True))]
      try:
        learner = learner_windows(update, warm, seconds, passes, barrier)
      except BaseException:
        barrier.abort()
        raise
      finally:  # a child that failed is named even when the learner's side failed with it
        servers = common.collect_children(processes, paths, BARRIER_TIMEOUT_S + passes * seconds,
                                          "a together measurement's child")
  windows = []
  for k, learned in enumerate(learner):
    rollout_rate = sum(_rate(s[k]["scored"], s[k]["s"], "rollout") for s in servers)
    learner_rate = _rate(learned["consumed"], learned["s"], "learner")
    windows.append({"rollout_s_per_sample": 1.0 / rollout_rate,
                    "learner_s_per_sample": 1.0 / learner_rate,
                    "rollout": [s[k] for s in servers], "learner": learned,
                    **together_figures(1.0 / rollout_rate, 1.0 / learner_rate)})
  best = min(windows, key=lambda w: w["together_s_per_sample"])
  return {"kind": "workload_together", "seconds": seconds, "passes": passes,
          "servers": len(servers), "cores": shares, "windows": windows,
          **{key: best[key] for key in ("rollout_s_per_sample", "learner_s_per_sample",
                                        "slowest_role", "together_s_per_sample",
                                        "together_samples_per_s")}}
