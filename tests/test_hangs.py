"""No hang anywhere: a `hang` fault at each named point ends the run within its bound.

Where a hang stops the run's progress, the watchdog prints the thread stacks naming the point
and exits with its code; a reward call that never returns is timed out, counted, and does not
keep the process from exiting. The runs of every case start together (they mostly wait)."""

import concurrent.futures
import importlib.util
import json
import os
import time
import warnings

import pytest

from jaxrl_async import faults
from jaxrl_async.watchdog import EXIT_CODE
from tests import run_lives

# Well above a version's time (well under a second; a few seconds with the 13 runs and another
# test on 2 cores, and more where a version compiles a program the cache does not have yet):
# it bounds the time between versions only, the first one (compilation) has its own bound below.
WATCHDOG_S = 20
RESCUE_S = 5  # the rescue of a run whose learner hangs cannot end: it is cut at this bound
BOUND_S = 600  # start-up on a loaded 2-core machine + reaching the point + watchdog + rescue
BINDINGS = run_lives.TINY_BINDINGS + (
    f"RunConfig.watchdog_timeout_s = {WATCHDOG_S}.0",
    f"RunConfig.watchdog_rescue_s = {RESCUE_S}.0",
    "RunConfig.watchdog_startup_s = 400.0",  # the first version compiles
    "RunConfig.checkpoint_every_versions = 2",
    "RunConfig.eval_every_versions = 1000",
    "RunConfig.reward_timeout_s = 1.0",
    "RunConfig.reward_retries = 0",
)
# A rollout server hung in its decode loop is named from its last health answer. A checkpoint
# pauses the fleet, and the pause of a hung server holds the fleet (and its heartbeat) until the
# pause's own timeout, longer than the watchdog's: a hang just before a checkpoint would leave
# the watchdog an answer from before the hang. These cases write no checkpoint.
DECODE_HANG = ("rollout.decode_step", 60, ("RunConfig.checkpoint_every_versions = 1000",))
# (mode, point, hit, more bindings): hits land after a few versions.
CASES = [("gin/modes/async_partial.gin", point, hit, extra) for point, hit, extra in (
    ("checkpoint.before_write", 2, ()), ("checkpoint.after_write", 2, ()),
    ("buffer.get_groups", 5, ()), ("learner.trained", 5, ()), ("learner.take_publish", 5, ()),
    ("sync.publish", 5, ()), DECODE_HANG)]
CASES += [("gin/modes/sync.gin", "sync.publish", 3, ()),
          ("gin/modes/sync.gin", "buffer.get_groups", 3, ())]
# The processes backend: the learner's watchdog, in its own process, ends a run whose learner
# hangs, and one whose rollout server hangs in its decode loop (named from the server's health
# answer, as its control thread still answers).
PROCESSES = ("RunConfig.backend = 'processes'", "RunConfig.heartbeat_timeout_s = 10.0")
PROCESSES_CASES = [("gin/modes/async_partial.gin", "learner.trained", 5, PROCESSES),
                   ("gin/modes/async_partial.gin", *DECODE_HANG[:2], PROCESSES + DECODE_HANG[2])]
# The Ray backend: the driver's watchdog, a hung learner and a rollout actor hung in its decode
# loop (the fault plan reaches the actors through their environment).
RAY = ("RunConfig.backend = 'ray'", "RunConfig.ray_rollout_cpus = 0.5",
       "RunConfig.heartbeat_timeout_s = 10.0")
RAY_CASES = [("gin/modes/async_partial.gin", "learner.trained", 5, RAY),
             ("gin/modes/async_partial.gin", *DECODE_HANG[:2], RAY + DECODE_HANG[2])]


def _start(index, case, tmp_path, env=None):
  gin_file, point, hit, extra = case
  bindings = BINDINGS + extra + ("RunConfig.total_samples = 10000000",)
  return run_lives.start(tmp_path / f"run{index}", gin_file, bindings,
                         faults_plan=f"{point}=hang@{hit}", env=env)


def _failure(case, run_dir, process) -> str | None:
  """None if the run ended with the watchdog's code, naming its point; else what it did (its
  whole output is kept in its run directory)."""
  gin_file, point, _, extra = case
  code, out, err, seconds = run_lives.finish(process, BOUND_S)
  # A hung learner cannot stop, so its rescue runs to the configured bound.
  cut = point != "learner.trained" or f"the rescue took over {RESCUE_S} s" in err
  if code == EXIT_CODE and f"blocked at fault point {point}" in err and cut:
    return None
  os.makedirs(run_dir, exist_ok=True)
  for name, text in (("stdout.txt", out), ("stderr.txt", err)):
    with open(os.path.join(run_dir, name), "w", encoding="utf-8") as f:
      f.write(text)
  report = [line[:1000] for line in err.splitlines()
            if line.startswith(("jaxrl_async", "state:", "Traceback"))]
  return (f"{gin_file} {point} {' '.join(extra) or 'threads'}: returncode {code} after "
          f"{seconds:.0f} s (output in {run_dir})\n" + "\n".join(report)
          + f"\n{out[-1000:]}\n{err[-2000:]}")


def _wait_version(run_dir, process, version: int, timeout_s: float = BOUND_S) -> None:
  """Until the run has recorded `version` or exited (bounded)."""
  deadline = time.monotonic() + timeout_s
  path = os.path.join(run_dir, "metrics.jsonl")
  while time.monotonic() < deadline and process.poll() is None:
    if os.path.exists(path):
      with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")[:-1]  # whole lines: the last may be being written
      if any(json.loads(line).get("policy_version", -1) >= version for line in lines if line):
        return
    time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_a_hang_at_each_point_and_in_each_backend_ends_the_run_within_its_bound(tmp_path):
  """Every case's run starts together, as each mostly waits (for its point, then the watchdog):
  the threads backend at each point, and a hung learner or rollout server (its own process, or
  a Ray actor, the fault plan reaching the actors through their environment). The run that goes
  furthest before its hang starts alone, and the others once it has made a few versions: they
  load its programs from the compilation cache instead of each compiling them at the same time
  (the sync mode and the other backends use the same programs, bar a few small ones of the
  rollout servers). A program compiled during the run counts against the watchdog's bound, and
  some (the rollout's inserts of a new number of prompts) are first used a few versions in.
  The Ray cluster starts meanwhile."""
  # The weight store's points fire only with sync_backend='store' (tests/sync/, tests/backends/).
  store_only = {"sync.stage", "sync.load"}
  # A rollout server hung at its stop comes after the run's last version: the run ends normally
  # (tests/backends/test_processes_stop_lost.py).
  at_the_end = {"rollout.stop"}
  assert {point for _, point, _, _ in CASES} == (set(faults.POINTS) - {"reward.call"}
                                                 - store_only - at_the_end)
  with_ray = importlib.util.find_spec("ray") is not None
  if not with_ray:
    warnings.warn("ray is not installed: the Ray backend's hang cases do not run", stacklevel=1)
  runs, cluster = [], None
  try:
    first = CASES.index(("gin/modes/async_partial.gin", *DECODE_HANG))
    runs.append((CASES[first], tmp_path / "run0", _start(0, CASES[first], tmp_path)))
    if with_ray:
      from jaxrl_async.backends.ray import placement
      cluster = placement.start_local_cluster([{"num_cpus": 2}])
    _wait_version(tmp_path / "run0", runs[0][2], 3)
    ray_env = {} if cluster is None else {"RAY_ADDRESS": cluster.address,
                                          "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    others = ([(case, ray_env) for case in RAY_CASES if with_ray]
              + [(case, None) for case in PROCESSES_CASES + CASES if case != CASES[first]])
    for index, (case, env) in enumerate(others, start=1):
      runs.append((case, tmp_path / f"run{index}", _start(index, case, tmp_path, env)))
    # Each run's output is read as it comes (a run whose pipe filled up would block on it).
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
      failures = [failure for failure in pool.map(lambda run: _failure(*run), runs)
                  if failure is not None]
  finally:
    for _, _, process in runs:  # a run left over by an error above
      if process.poll() is None:
        process.kill()
        process.communicate()
    if cluster is not None:
      placement.stop_local_cluster(cluster)
  assert not failures, "\n\n".join(failures)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_reward_call_that_never_returns_is_counted_and_does_not_hold_the_exit(tmp_path):
  run_dir = tmp_path / "run"
  bindings = BINDINGS + ("RunConfig.total_samples = 160",  # 20 versions of 2 x 4 samples
                         "RunConfig.watchdog_timeout_s = 300.0")
  process = run_lives.start(run_dir, "gin/modes/async_partial.gin", bindings,
                            faults_plan="reward.call=hang@7")
  code, out, err, _ = run_lives.finish(process, BOUND_S)
  assert code == 0, (out[-2000:], err[-4000:])
  with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
    summary = json.load(f)
  assert summary["reward/timeout"] >= 1
  assert summary["queue/dropped/reward_timeout"] >= 1
  assert summary["ledger/missing"] == 0 and summary["ledger/duplicates"] == 0
