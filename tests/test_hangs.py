"""No hang anywhere: a `hang` fault at each named point ends the run within its bound.

Where a hang stops the run's progress, the watchdog prints the thread stacks naming the point
and exits with its code; a reward call that never returns is timed out, counted, and does not
keep the process from exiting. A test's runs start together (they mostly wait)."""

import json
import os
import time

import pytest

from jaxrl_async import faults
from jaxrl_async.watchdog import EXIT_CODE
from tests import run_lives

WATCHDOG_S = 30  # well above a version's time (well under a second) on a loaded 2-core machine
RESCUE_S = 15  # the rescue of a run whose learner hangs cannot end: it is cut at this bound
BOUND_S = 600  # start-up on a loaded 2-core machine + reaching the point + watchdog + rescue
AT_ONCE = 9  # runs started together (most of their time is waiting): all the cases at once
BINDINGS = run_lives.TINY_BINDINGS + (
    f"RunConfig.watchdog_timeout_s = {WATCHDOG_S}.0",
    f"RunConfig.watchdog_rescue_s = {RESCUE_S}.0",
    "RunConfig.watchdog_startup_s = 400.0",  # the first version compiles
    "RunConfig.checkpoint_every_versions = 2",
    "RunConfig.eval_every_versions = 1000",
    "RunConfig.reward_timeout_s = 1.0",
    "RunConfig.reward_retries = 0",
)
# (mode, point, hit, more bindings): hits land after a few versions.
CASES = [("gin/modes/async_partial.gin", point, hit, ()) for point, hit in (
    ("checkpoint.before_write", 2), ("checkpoint.after_write", 2), ("buffer.get_groups", 5),
    ("learner.trained", 5), ("learner.take_publish", 5), ("sync.publish", 5),
    ("rollout.decode_step", 60))]
CASES += [("gin/modes/sync.gin", "sync.publish", 3, ()),
          ("gin/modes/sync.gin", "buffer.get_groups", 3, ())]
# The processes backend: the learner's watchdog, in its own process, ends a run whose learner
# hangs, and one whose rollout server hangs in its decode loop (named from the server's health
# answer, as its control thread still answers).
PROCESSES = ("RunConfig.backend = 'processes'", "RunConfig.heartbeat_timeout_s = 10.0")
PROCESSES_CASES = [("gin/modes/async_partial.gin", "learner.trained", 5, PROCESSES),
                   ("gin/modes/async_partial.gin", "rollout.decode_step", 60, PROCESSES)]
# The Ray backend: the driver's watchdog, a hung learner and a rollout actor hung in its decode
# loop (the fault plan reaches the actors through their environment).
RAY = ("RunConfig.backend = 'ray'", "RunConfig.ray_rollout_cpus = 0.5",
       "RunConfig.heartbeat_timeout_s = 10.0")
RAY_CASES = [("gin/modes/async_partial.gin", "learner.trained", 5, RAY),
             ("gin/modes/async_partial.gin", "rollout.decode_step", 60, RAY)]


def _hang_each(cases, tmp_path, env=None) -> None:
  """Runs the cases AT_ONCE at a time; each must end with the watchdog's code, naming its point.
  The first case of each configuration starts alone and the others once it has compiled (its
  version-0 record is written), so they load its programs from the compilation cache instead of
  each compiling them at the same time."""
  failures = []
  for first in range(0, len(cases), AT_ONCE):
    chunk = list(enumerate(cases[first:first + AT_ONCE], start=first))
    firsts: dict[tuple, int] = {}
    for i, (gin_file, _, _, extra) in chunk:
      firsts.setdefault((gin_file, extra), i)
    leading = set(firsts.values())
    runs, leaders = [], {}
    for i, (gin_file, point, hit, extra) in ([c for c in chunk if c[0] in leading]
                                             + [c for c in chunk if c[0] not in leading]):
      if i not in leading and leaders:
        _wait_compiled(leaders)
        leaders = {}
      bindings = BINDINGS + extra + ("RunConfig.total_samples = 10000000",)
      process = run_lives.start(tmp_path / f"run{i}", gin_file, bindings,
                                faults_plan=f"{point}=hang@{hit}", env=env)
      runs.append((point, gin_file, process))
      if i in leading:
        leaders[tmp_path / f"run{i}"] = process
    for point, gin_file, process in runs:
      code, out, err, seconds = run_lives.finish(process, BOUND_S)
      # A hung learner cannot stop, so its rescue runs to the configured bound.
      cut = point != "learner.trained" or f"the rescue took over {RESCUE_S} s" in err
      if code != EXIT_CODE or f"blocked at fault point {point}" not in err or not cut:
        failures.append(f"{gin_file} {point}: returncode {code} after {seconds:.0f} s\n"
                        f"{out[-1000:]}\n{err[-2000:]}")
  assert not failures, "\n\n".join(failures)


def _wait_compiled(leaders, timeout_s: float = BOUND_S) -> None:
  """Until each leader has written its first record or exited (bounded)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and any(
      process.poll() is None and not os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
      for run_dir, process in leaders.items()):
    time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_a_hang_at_each_point_ends_the_run_within_its_bound(tmp_path):
  # The weight store's points fire only with sync_backend='store' (tests/sync/, tests/backends/).
  store_only = {"sync.stage", "sync.load"}
  assert {point for _, point, _, _ in CASES} == set(faults.POINTS) - {"reward.call"} - store_only
  _hang_each(CASES, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_hang_in_the_learner_or_a_rollout_server_process_ends_the_run(tmp_path):
  _hang_each(PROCESSES_CASES, tmp_path)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_hang_in_the_ray_driver_or_a_rollout_actor_ends_the_run(tmp_path):
  pytest.importorskip("ray")
  from jaxrl_async.backends.ray import placement
  cluster = placement.start_local_cluster([{"num_cpus": 2}])
  try:
    _hang_each(RAY_CASES, tmp_path, env={"RAY_ADDRESS": cluster.address,
                                         "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
  finally:
    placement.stop_local_cluster(cluster)


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
