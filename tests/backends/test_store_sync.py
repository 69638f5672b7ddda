"""Faults in a rollout server's load through the weight store (`sync_backend='store'`, delta
publishes of bf16 rollout weights): a hang, a raise or a kill is counted while the run goes on,
and every version a server loaded is a published one (its digest in the server's load log).
The store's plain run on every backend is in test_backend_contract.py."""

from __future__ import annotations

import os

import pytest

from jaxrl_async import faults
from jaxrl_async.metrics import read_jsonl
from tests import run_lives
from tests.backends.test_backend_contract import ray_cluster, run_mode, tiny_config  # noqa: F401

STORE = dict(mode="async_stale", staleness_threshold=1.0, max_version_gap=2,
             sync_backend="store", sync_delta=True, rollout_param_dtype="bfloat16")


def check_faulted_run(config, summary, records, run_dir) -> None:
  """A run with a replaced server: every version trained and recorded once, and the ledger
  accounts for every sample (consumed once or dropped once; the replaced server's groups
  re-issued)."""
  assert summary["policy_version"] == config.num_versions
  assert [r["policy_version"] for r in records] == list(range(1, config.num_versions + 1))
  assert summary["queue/consumed"] == config.total_samples
  run_lives.check_books(run_lives.books(run_dir), config.num_versions)


def check_loads(run_dir) -> tuple[list[dict], list[dict]]:
  """(published versions, loads): every load's digest is the digest published for its version,
  so no server ever held a partial or mixed version."""
  weights = os.path.join(run_dir, "weights")
  published = read_jsonl(os.path.join(weights, "published.jsonl"))
  digests = {line["version"]: line["digest"] for line in published}
  loads = [load for name in os.listdir(os.path.join(weights, "loads"))
           for load in read_jsonl(os.path.join(weights, "loads", name))]
  assert loads and all(load["digest"] == digests[load["version"]] for load in loads)
  return published, loads


@pytest.mark.slow
def test_a_server_that_hangs_in_a_load_is_replaced_and_the_run_goes_on(tmp_path, monkeypatch):
  """The server hangs at its third load; past the load deadline the fleet replaces it; its
  successor loads the newest version whole."""
  monkeypatch.setenv(faults.ENV, "sync.load=hang@3")
  config = tiny_config("processes", num_versions=6, sync_load_deadline_s=3.0, **STORE)
  summary, records = run_mode(config, tmp_path)
  check_faulted_run(config, summary, records, tmp_path)
  check_loads(tmp_path)
  assert summary["sync/load_deadline_missed"] >= 1
  assert summary["rollout_server_restarts"] >= 1


@pytest.mark.soak
@pytest.mark.parametrize("action, count", [("raise", "sync/load_failed"),
                                           ("kill", "runtime/reissued_groups/server_died")])
def test_a_load_that_raises_or_dies_is_counted_and_the_run_goes_on(action, count, tmp_path,
                                                                   monkeypatch):
  monkeypatch.setenv(faults.ENV, f"sync.load={action}@3")
  config = tiny_config("processes", num_versions=6, **STORE)
  summary, records = run_mode(config, tmp_path)
  check_faulted_run(config, summary, records, tmp_path)
  check_loads(tmp_path)
  assert summary[count] >= 1 if action == "raise" else summary["rollout_server_restarts"] >= 1


@pytest.mark.soak
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.xfail(reason="seen once: the run finished with the deadline counted, but the "
                   "ledger audit listed 12 samples of groups 11-13 as 'unknown' after the "
                   "actor's restart; cause not yet found", strict=False)
def test_a_ray_actor_that_hangs_in_a_load_is_restarted_and_the_run_goes_on(tmp_path,
                                                                           monkeypatch):
  monkeypatch.setenv(faults.ENV, "sync.load=hang@3")
  config = tiny_config("ray", num_versions=6, sync_load_deadline_s=3.0, **STORE)
  summary, records = run_mode(config, tmp_path)
  check_faulted_run(config, summary, records, tmp_path)
  check_loads(tmp_path)
  assert summary["sync/load_deadline_missed"] >= 1
