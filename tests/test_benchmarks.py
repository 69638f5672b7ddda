"""The benchmark scripts run end to end on a tiny configuration and print their JSON fields.
(Their figures are measured by running them as documented in benchmarks/; nothing here times.)"""

import json
import math
import os

import jax
import pytest

import gin
from benchmarks import concurrency_ceiling, learner_step, modes, workload_bound, workload_together
from benchmarks import serve as serve_bench

TINY = ("DigitReverseTask.max_len = 8", "WarmStartConfig.steps = 20",
        "WarmStartConfig.batch_size = 16", "RunConfig.group_size = 4",
        "RunConfig.mini_batch_size = 2", "RunConfig.max_concurrent_decodes = 8",
        "RunConfig.eval_size = 16")


# The update compiles at the shapes a run meets instead of at every row count a batch can have
# before the run: these tests check what the scripts report, not how long a run's first updates
# take, and compiling every shape of every run's learner was most of their time.
NO_PRECOMPILE = "RunConfig.precompile_updates = False"


@pytest.fixture(autouse=True)
def clean_gin():
  yield
  gin.clear_config()


@pytest.fixture
def no_xla_optimizations(monkeypatch):
  """XLA's optimisation passes off, here and in the processes a script spawns (JAX reads the
  variable at import): the tests below check the fields the scripts report, never a speed, and
  the passes were most of each compile's time."""
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


def _bindings(*extra):
  return [arg for binding in (*TINY, *extra) for arg in ("--gin_bindings", binding)]


def _read(path):
  with open(path, encoding="utf-8") as f:
    return json.loads(f.readline())


@pytest.mark.slow
def test_learner_step_compares_packed_and_padded(tmp_path, no_xla_optimizations):
  out = tmp_path / "learner_step.json"
  # The roofline part once, on one model and one timed run of each machine figure: nothing
  # below checks its figures, only that the script gets through it.
  assert learner_step.main(["--batches", "2", "--repeats", "1", "--out", str(out),
                            "--roofline_repeats", "1", "--roofline_models", "tiny",
                            "--machine_repeats", "1", *_bindings(NO_PRECOMPILE)]) == 0
  record = _read(out)
  assert record["samples_per_batch"] == 8
  for layout in ("packed", "one_row_per_sample"):
    assert record[layout]["ms_per_update"] > 0
    assert record[layout]["tokens_laid_out_per_batch"] >= record["real_tokens_per_batch"]
  assert (record["packed"]["tokens_laid_out_per_batch"]
          <= record["one_row_per_sample"]["tokens_laid_out_per_batch"])


@pytest.mark.slow
def test_modes_runs_each_mode_and_compares_with_sync(tmp_path, monkeypatch, no_xla_optimizations):
  monkeypatch.chdir(tmp_path)  # modes.py changes to the repository root; restored afterwards
  out = tmp_path / "modes"
  variant = "async_partial_t2=async_partial:RunConfig.trigger_parameter_sync_step = 2"
  # sync, one async mode (as a variant: its gin file with a binding on top) and one recipe
  assert modes.main(["--total_samples", "32", "--modes", "sync",
                     "--variant", variant, "--repeats", "2", "--recipes", "verl_defaults",
                     "--warmup_samples", "32", "--eval_every_versions", "2", "--out", str(out),
                     "--ceiling_batches", "4", "--ceiling_data_batches", "2",
                     *_bindings(NO_PRECOMPILE)]) == 0
  with open(f"{out}.json", encoding="utf-8") as f:
    result = json.load(f)
  assert result["repeats"] == 2 and len(result["rounds"]) == 2
  for name, row in result["modes"].items():  # the median of the two rounds, and their spread
    speeds = [r[name]["samples_per_s"] for r in result["rounds"]]
    assert row["rounds"] == 2
    assert row["samples_per_s"] == pytest.approx(sum(speeds) / 2)
    assert (row["samples_per_s_min"], row["samples_per_s_max"]) == (min(speeds), max(speeds))
    assert row["version_gap_max"] == max(r[name]["version_gap_max"] for r in result["rounds"])
    ratios = [r[name]["samples_per_s"] / r["sync"]["samples_per_s"] for r in result["rounds"]]
    assert row["samples_per_s_vs_sync"] == pytest.approx(sum(ratios) / 2)
  assert set(result["modes"]) == {"sync", "async_partial_t2", "verl_defaults"}
  for row in result["modes"].values():  # consumed against generated response lengths
    assert row["consumed_mean"] > 0 and row["generated_p90"] >= 1
    assert row["consumed_over_generated_mean"] == pytest.approx(
        row["consumed_mean"] / row["generated_mean"], rel=0.2)
  assert result["variants"] == {"async_partial_t2": {
      "mode": "async_partial", "bindings": ["RunConfig.trigger_parameter_sync_step = 2"]}}
  assert result["modes"]["sync"]["samples_per_s_vs_sync"] == 1.0
  # The ceiling, measured in the same invocation, and every run's ratio as a fraction of it.
  ceiling = result["ceiling"]
  assert ceiling["kind"] == "core_overlap" and ceiling["layout"] == "threads"
  assert ceiling["speedup"] == ceiling["roles"]["speedup"] > 0
  for row in result["modes"].values():
    assert row["fraction_of_ceiling"] == pytest.approx(
        row["samples_per_s_vs_sync"] / ceiling["speedup"])
  for row in result["modes"].values():
    assert 0.0 <= row["final_accuracy"] <= 1.0 and row["samples_per_s"] > 0
  assert result["modes"]["sync"]["version_gap_max"] == 0
  assert (tmp_path / "modes.png").is_file()
  with open(tmp_path / "modes-report" / "index.html", encoding="utf-8") as f:
    page = f.read()
  assert "<th>sync</th>" in page and "<th>async_partial_t2</th>" in page
  assert "<th>verl_defaults</th>" in page
  with pytest.raises(SystemExit):  # an unknown mode in a variant is refused by name
    modes.main(["--variant", "x=no_such_mode:RunConfig.seed = 1", *_bindings()])
  with pytest.raises(SystemExit):
    modes.main(["--repeats", "0", *_bindings()])
  with pytest.raises(SystemExit):
    modes.main(["--ceiling_batches", "-1", *_bindings()])
  assert (tmp_path / "modes-report" / "timeline.png").is_file()


@pytest.mark.slow
def test_concurrency_ceiling_reports_every_pair(tmp_path, no_xla_optimizations):
  out = tmp_path / "ceiling.json"
  # Two recorded batches for the learner loop (16 by default): every figure below is checked for
  # being there and positive, none for its size.
  assert concurrency_ceiling.main(["--matrix", "32", "--batches", "4", "--data_batches", "2",
                                   "--out", str(out), *_bindings(NO_PRECOMPILE)]) == 0
  record = _read(out)
  for part in ("python_processes", "xla_processes", "xla_threads", "roles"):
    assert record[part]["speedup"] > 0, part
  layout = record["roles_processes"]  # the loops in the processes backend's layout
  assert layout["batches"] == 4 and layout["speedup_over_one_process"] > 0
  assert layout["rollout_cores"] and all(isinstance(c, int) for c in layout["rollout_cores"])
  for key in ("learner_ms_per_batch", "rollout_pinned_ms_per_batch", "both_ms_per_batch"):
    assert layout[key] > 0, key  # timings are figures for the report, not bounds for a test


@pytest.mark.slow
def test_serve_compares_the_server_with_the_engine(tmp_path):
  out = tmp_path / "serve.json"
  assert serve_bench.main(["--requests", "6", "--slots", "4", "--repeats", "1",
                           "--out", str(out)]) == 0
  record = _read(out)
  assert record["tokens_match"] is True  # the server streamed the engine's tokens
  assert record["requests"] == 6 and record["tokens"] >= 6
  assert record["engine_tokens_per_s"] > 0 and record["server_tokens_per_s"] > 0


RLVR_TINY = ("RLVRReverseTask.max_len = 15", "WarmStartConfig.steps = 20",
             "WarmStartConfig.batch_size = 16", "RunConfig.group_size = 4",
             "RunConfig.mini_batch_size = 1", "RunConfig.max_concurrent_decodes = 8",
             "RunConfig.eval_size = 16", "VerifierSettings.time_scale = 1e-3",
             "VerifierSettings.concurrency = 2", "RunConfig.reward_workers = 1")


def run_bound(tmp_path, *args):
  """workload_bound.py on verl_fully_async's settings and the tiny RLVR task -> its record."""
  out = tmp_path / "bound.json"
  assert workload_bound.main([
      *args, "--gin_file", "gin/recipes/verl_fully_async.gin", "--gin_file",
      "gin/tasks/rlvr.gin", "--out", str(out),
      *[a for b in RLVR_TINY for a in ("--gin_bindings", b)]]) == 0
  return _read(out)


@pytest.mark.slow  # about 12 CPU-s: a verifier process, two compiles
def test_workload_bound_is_the_slowest_role_measured_alone(tmp_path, monkeypatch,
                                                          no_xla_optimizations):
  monkeypatch.chdir(tmp_path)  # main changes to the repository root; restored afterwards
  record = run_bound(tmp_path, "--backend", "threads", "--samples", "24", "--updates", "3",
                     "--repeats", "2", "--together_s", "0.5")
  check_together(record["together"], passes=2, servers=1)
  assert record["together"]["cores"] is None  # the threads layout: the rollout in a thread
  roles = record["roles"]
  figures = {role: roles[role]["s_per_sample"] for role in workload_bound.ROLES}
  for role, value in figures.items():
    assert math.isfinite(value) and value > 0, role
    assert roles[role]["s"] == min(roles[role]["passes_s"]), role  # the fastest pass kept
  work = {role: roles[role]["work_s_per_sample"] for role in workload_bound.ROLES}
  for role, value in work.items():
    assert math.isfinite(value) and value > 0, role
  assert roles["reward"]["verifier_processes"] == 1  # its CPU counted in the reward's work
  cores = len(os.sched_getaffinity(0))
  assert record["cores"] == cores
  assert record["roles_bound_s_per_sample"] == max(figures.values())
  assert record["cores_bound_s_per_sample"] == pytest.approx(sum(work.values()) / cores)
  assert record["bound_s_per_sample"] == max(record["roles_bound_s_per_sample"],
                                             record["cores_bound_s_per_sample"])
  assert record["slowest_role"] in (*figures, "cores")
  assert record["bound_samples_per_s"] == pytest.approx(1 / record["bound_s_per_sample"])
  assert roles["rollout"]["samples"] == 24 and roles["rollout"]["slots"] == 8
  # Scored at the verifier's concurrency: more callers than reward_workers, the service at its
  # limit and never above it; every pass's requests reached the service.
  assert roles["reward"]["callers"] == 2 and roles["reward"]["concurrency"] == 2
  assert roles["reward"]["requests"] == 2 * 24 and roles["reward"]["errors"] == 0
  assert 1 <= roles["reward"]["max_active"] <= 2
  # 4 groups of 4 a batch (mini_batch_size 1 x require_batches 4): 16 samples an update.
  assert roles["learner"]["updates"] == 3 and roles["learner"]["samples"] == 3 * 16
  # A run at 100 samples/s against a bound of 5 ms a sample reached half of the ceiling; a sync
  # run at 50 samples/s (20 ms a sample) leaves a ceiling of 4x.
  assert workload_bound.fraction_of_ceiling(100.0, 0.005) == pytest.approx(0.5)
  assert workload_bound.ceiling_speedup(50.0, 0.005) == pytest.approx(4.0)
  assert workload_bound.bound_figures({"a": 0.25, "b": 0.5})["slowest_role"] == "b"
  for bad in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="role 'b'"):
      workload_bound.bound_figures({"a": 0.25, "b": bad})


def check_together(together, *, passes, servers):
  """Every role measured at once: each window's figures from its counts, the kept window the
  one whose slower role was fastest."""
  assert together["kind"] == "workload_together" and together["passes"] == passes
  assert len(together["windows"]) == passes and together["servers"] == servers
  for window in together["windows"]:
    assert len(window["rollout"]) == servers
    rate = sum(w["scored"] / w["s"] for w in window["rollout"])
    assert window["rollout_s_per_sample"] == pytest.approx(1 / rate)
    for w in window["rollout"]:  # scored by the window's end: never more than generated
      assert 0 < w["scored"] <= w["generated"] and w["cpu_s"] > 0
    learned = window["learner"]
    assert learned["consumed"] > 0 and learned["consumed"] % 16 == 0  # whole updates of 16
    assert window["learner_s_per_sample"] == pytest.approx(learned["s"] / learned["consumed"])
    assert window["together_s_per_sample"] == max(window["rollout_s_per_sample"],
                                                  window["learner_s_per_sample"])
  best = min(w["together_s_per_sample"] for w in together["windows"])
  assert together["together_s_per_sample"] == best
  assert together["together_samples_per_s"] == pytest.approx(1 / best)


@pytest.mark.slow  # a verifier process, a spawned rollout child, two compiles
def test_workload_together_runs_the_rollout_where_the_processes_backend_does(
    tmp_path, monkeypatch, no_xla_optimizations):
  monkeypatch.chdir(tmp_path)
  together = run_bound(tmp_path, "--backend", "processes", "--samples", "24", "--updates", "2",
                       "--repeats", "1", "--together_s", "1.0")["together"]
  check_together(together, passes=1, servers=1)
  from jaxrl_async.backends.processes import child
  assert together["cores"] == child.core_shares(1)[1]  # the rollout server's cores


def test_together_figures_name_the_slower_role():
  figures = workload_together.together_figures(0.0005, 0.0008)
  assert figures["slowest_role"] == "learner"
  assert figures["together_s_per_sample"] == 0.0008
  assert figures["together_samples_per_s"] == pytest.approx(1250.0)
  assert workload_together.together_figures(0.002, 0.0008)["slowest_role"] == "rollout"
  # A run at 1,000 samples/s against roles that make 1,250 a second side by side: 0.8.
  assert workload_together.fraction_of_together(1000.0, 0.0008) == pytest.approx(0.8)
  for bad in (0.0, -1.0, float("nan"), float("inf")):
    with pytest.raises(ValueError, match="role 'learner'"):
      workload_together.together_figures(0.0005, bad)
  with pytest.raises(ValueError, match="seconds must be > 0"):
    workload_together.measure_together(None, [], "threads", seconds=0.0)


def test_modes_gives_each_run_as_fractions_of_the_bound_and_of_the_roles_together():
  table = {"sync": {"samples_per_s": 500.0}, "rlvr_async": {"samples_per_s": 1000.0}}
  modes.add_fractions(table, {"kind": "workload_bound", "bound_s_per_sample": 0.0005,
                              "together": {"together_s_per_sample": 0.0008}})
  assert table["rlvr_async"]["fraction_of_ceiling"] == pytest.approx(0.5)
  assert table["rlvr_async"]["fraction_of_together"] == pytest.approx(0.8)
  assert table["sync"]["fraction_of_together"] == pytest.approx(0.4)
  table = {"sync": {"samples_per_s": 500.0}}  # without the roles measured together
  modes.add_fractions(table, {"kind": "workload_bound", "bound_s_per_sample": 0.0005})
  assert "fraction_of_together" not in table["sync"]
  table = {"sync": {"samples_per_s": 500.0, "samples_per_s_vs_sync": 1.0},
           "async_partial": {"samples_per_s": 600.0, "samples_per_s_vs_sync": 1.2}}
  modes.add_fractions(table, {"kind": "core_overlap", "speedup": 1.5})
  assert table["async_partial"]["fraction_of_ceiling"] == pytest.approx(0.8)


def _result(curve, wall_s):
  """run_mode's result for a run whose evaluations are `curve` ((s, samples, accuracy))."""
  summary = {"eval/accuracy": curve[-1][2], "consumed_samples": curve[-1][1],
             "system/samples_per_s": curve[-1][1] / wall_s, "system/wall_s": wall_s,
             **{f"{role}/idle_ratio": 0.1 for role in ("rollout", "reward", "learner", "sync")}}
  return {"summary": summary, "curve": curve, "version_gap_max": 0, "stale_ratio_mean": 0.0,
          "partial_ratio_mean": 0.0, "max_partial_span": 0}


def test_a_run_past_syncs_samples_compares_at_equal_samples_and_reaches_later():
  sync = _result([(0.0, 0, 0.4), (5.0, 100, 0.6), (10.0, 200, 0.8)], 10.0)
  # Twice as fast, trained on to 300 samples: 0.7 at sync's 200 samples, 0.82 at 300.
  longer = _result([(0.0, 0, 0.4), (2.5, 100, 0.55), (4.0, 200, 0.7), (6.0, 300, 0.82)], 6.0)
  rows = modes.mode_rows({"sync": sync, "rlvr_async": longer}, equal_samples=200)
  row = rows["rlvr_async"]
  assert row["final_accuracy"] == 0.7 and row["final_accuracy_at_end"] == 0.82
  assert row["samples_per_s"] == pytest.approx(50.0)  # 200 samples in 4 s, not 300 in 6
  assert row["samples_per_s_vs_sync"] == pytest.approx(2.5)
  assert row["accuracy_minus_sync"] == pytest.approx(-0.1)
  assert row["time_to_sync_final_accuracy_s"] == 6.0  # past sync's samples
  assert row["time_to_sync_final_accuracy_vs_sync"] == pytest.approx(0.6)
  assert rows["sync"]["final_accuracy"] == rows["sync"]["final_accuracy_at_end"] == 0.8
  same = modes.mode_rows({"sync": sync, "rlvr_async": longer})  # without: where it ended
  assert same["rlvr_async"]["final_accuracy"] == 0.82
  with pytest.raises(ValueError, match="no evaluation after exactly 250 samples"):
    modes.mode_rows({"sync": sync, "rlvr_async": longer}, equal_samples=250)


def test_the_cores_bound_is_the_roles_work_over_the_cores():
  alone = {"rollout": 0.3, "reward": 0.25, "learner": 0.33}
  # 0.3 + 0.05 + 0.6 = 0.95 core-s a sample over 2 cores: 0.475 s, above the slowest role's 0.33.
  figures = workload_bound.bound_figures(alone, {"rollout": 0.3, "reward": 0.05,
                                                 "learner": 0.6}, cores=2)
  assert figures["slowest_role"] == "cores"
  assert figures["cores_bound_s_per_sample"] == pytest.approx(0.475)
  assert figures["bound_s_per_sample"] == pytest.approx(0.475)
  assert figures["roles_bound_s_per_sample"] == 0.33
  # On 4 cores the same work fits under the slowest role: the roles' bound holds.
  figures = workload_bound.bound_figures(alone, {"rollout": 0.3, "reward": 0.05,
                                                 "learner": 0.6}, cores=4)
  assert figures["slowest_role"] == "learner" and figures["bound_s_per_sample"] == 0.33
  with pytest.raises(ValueError, match="role 'reward': work per sample"):
    workload_bound.bound_figures(alone, {"rollout": 0.3, "reward": 0.0, "learner": 0.6}, 2)
  with pytest.raises(ValueError, match="cores"):
    workload_bound.bound_figures(alone, {"rollout": 0.3, "reward": 0.05, "learner": 0.6}, 0)


def test_modes_refuses_a_missing_task_file_and_an_unknown_bound_run(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  with pytest.raises(SystemExit):
    modes.main(["--task_file", "gin/tasks/no_such_task.gin", "--modes", "sync"])
  with pytest.raises(SystemExit):
    modes.main(["--task_file", "gin/tasks/rlvr.gin", "--modes", "sync",
                "--bound_run", "async_partial"])
  with pytest.raises(SystemExit):  # a variant of a recipe that does not exist
    modes.main(["--variant", "x=recipes/no_such_recipe:RunConfig.seed = 1", "--modes", "sync"])
  with pytest.raises(SystemExit):
    modes.main(["--task_file", "gin/tasks/rlvr.gin", "--modes", "sync", "--together_s", "-1"])
  with pytest.raises(SystemExit):
    modes.main(["--modes", "sync", "--async_run_on", "0.5"])
  runs = {"sync": ("sync", []), "verl_fully_async": ("recipes/verl_fully_async", [])}
  assert modes.bound_run(runs, None) == "verl_fully_async"  # the first async run
  assert modes.bound_run({"sync": ("sync", [])}, None) == "sync"
  assert modes.bound_run(runs, "sync") == "sync"


def test_buffer_throughput_reports_the_buffer_beside_a_bare_queue(tmp_path, monkeypatch):
  from benchmarks import buffer_throughput
  out = tmp_path / "buffer.json"
  monkeypatch.setattr("sys.argv", ["buffer_throughput.py", "--samples", "2048",
                                   "--out", str(out)])
  buffer_throughput.main()
  line = json.loads(out.read_text())
  for prefix in ("", "bare_queue_"):
    p50, p99 = line[f"{prefix}latency_ms_p50"], line[f"{prefix}latency_ms_p99"]
    assert 0 < p50 <= p99, line
  assert line["bare_queue_samples_per_s_4_producers"] > 0
  assert line["latency_p99_over_bare_queue"] == pytest.approx(
      line["latency_ms_p99"] / line["bare_queue_latency_ms_p99"], rel=0.05)
