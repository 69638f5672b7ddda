"""The simulator on hand-computable profiles, and the bounds on random ones (hypothesis)."""

import dataclasses

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxrl_async.config import RunConfig
from jaxrl_async.metrics import staleness_metrics
from jaxrl_async.sim import profile_from_dict, simulate
from jaxrl_async.sim.clock import Clock, Device, Host
from jaxrl_async.sim.replicas import SimSample, make_sample

# Fixed response length L, one replica with room for a whole version: a version takes
# L decode steps + one update + one sync, in every mode where nothing overlaps.
FIXED = {"name": "fixed", "prompt_tokens": 4,
         "response_length": {"kind": "fixed", "min": 1, "max": 100, "value": 10},
         "rollout": {"replicas": 1, "slots": 64, "decode_curve": [[1, 0.01]]},
         "learner": {"per_update_s": 0.5, "s_per_token": 0.0},
         "sync": {"fixed_s": 0.25}}
VERSION_S = 10 * 0.01 + 0.5 + 0.25
SMALL = dict(group_size=4, mini_batch_size=4, max_concurrent_decodes=64, total_samples=160)


def test_sync_version_time_is_the_sum_of_its_stages():
  result = simulate(profile_from_dict(FIXED), RunConfig(mode="sync", **SMALL))
  times = [r["time_s"] for r in result.records]
  assert len(times) == 10
  np.testing.assert_allclose(np.diff(times), VERSION_S)
  np.testing.assert_allclose(result.summary["system/samples_per_s"], 16 / VERSION_S)
  assert result.summary["algo/version_gap_max"] == 0
  np.testing.assert_allclose(result.records[-1]["rollout/busy_s"], 10 * 0.1)
  np.testing.assert_allclose(result.records[-1]["learner/busy_s"], 10 * 0.5)


def test_on_policy_cannot_overlap_versions():
  """s = 0, trigger 1: nothing for v+1 starts before v+1 is published, so it is as slow as
  sync (plus the first publish of version 0)."""
  result = simulate(profile_from_dict(FIXED), RunConfig(mode="on_policy", **SMALL))
  np.testing.assert_allclose(np.diff([r["time_s"] for r in result.records]), VERSION_S)
  assert result.summary["algo/stale_ratio"] == 0


def test_staleness_lets_rollout_run_ahead():
  """With s = 1 the rollout generates the next version while the learner trains: a version
  then takes max(rollout, learner + sync) once the pipeline is full."""
  config = RunConfig(mode="async_stale", staleness_threshold=1.0, max_version_gap=1, **SMALL)
  result = simulate(profile_from_dict(FIXED), config)
  steady = np.diff([r["time_s"] for r in result.records])[3:]
  np.testing.assert_allclose(steady, 0.75)
  assert result.summary["algo/version_gap_max"] == 1
  assert 0 < result.summary["algo/stale_ratio"] <= 1


def test_a_device_with_its_own_contention_slows_down_alone():
  """Two 1 s pieces at once; the learner has contention 1, the rollout 0: the rollout ends at
  1 s at full speed, the learner has done half of its work then and ends at 1.5 s. With one
  contention of 0.5 for both, each runs at 1 / 1.5 and both end at 1.5 s."""
  for host, expected in ((Host(0.0, {"learner": 1.0}), {"rollout0": 1.0, "learner": 1.5}),
                         (Host(0.5), {"rollout0": 1.5, "learner": 1.5})):
    clock, ended = Clock(), {}
    for name in ("rollout0", "learner"):
      device = Device(clock, name, host)
      device.start(1.0, lambda n=name, c=clock, e=ended: e.setdefault(n, c.now), name)
    clock.run(100)
    assert ended == expected


def test_the_learners_own_contention_slows_only_the_learner():
  """async_stale: rollout and learner compute at once. With contention only on the learner,
  the rollout's busy time is what it is alone and the learner's grows; with one contention
  for both, both grow."""
  config = RunConfig(mode="async_stale", staleness_threshold=1.0, max_version_gap=1, **SMALL)
  alone = simulate(profile_from_dict(FIXED), config).records[-1]
  learner_only = simulate(profile_from_dict(dict(FIXED, learner_contention=1.0)),
                          config).records[-1]
  both = simulate(profile_from_dict(dict(FIXED, contention=1.0)), config).records[-1]
  np.testing.assert_allclose(learner_only["rollout/busy_s"], alone["rollout/busy_s"])
  assert learner_only["learner/busy_s"] > alone["learner/busy_s"] + 0.1
  assert both["rollout/busy_s"] > alone["rollout/busy_s"] + 0.1
  assert both["learner/busy_s"] > alone["learner/busy_s"] + 0.1


def test_partial_rollout_records_spans_across_versions():
  long = dict(FIXED, response_length={"kind": "lognormal", "min": 1, "max": 400,
                                      "median": 60, "sigma": 1.0})
  config = RunConfig(mode="async_partial", staleness_threshold=0.5, max_version_gap=3,
                     partial_rollout=True, group_size=4, mini_batch_size=2,
                     max_concurrent_decodes=16, total_samples=400)
  result = simulate(profile_from_dict(long), config)
  assert result.summary["algo/partial_ratio"] > 0
  assert result.summary["algo/max_partial_span"] >= 1
  assert result.summary["rollout/interrupted"] > 0
  assert result.summary["algo/version_gap_max"] <= 3


def test_waiting_at_the_gap_bound_trains_on_the_long_responses_that_drops_lose():
  """A long tail under partial rollout with a tight bound: dropping at the bound loses the
  longest responses (consumed shorter than generated); waiting for them keeps both equal."""
  long = dict(FIXED, response_length={"kind": "lognormal", "min": 1, "max": 400,
                                      "median": 8, "sigma": 1.5})
  found = {}
  for policy in ("drop", "wait"):
    config = RunConfig(mode="async_partial", staleness_threshold=0.5, max_version_gap=1,
                       version_gap_policy=policy, partial_rollout=True, group_size=4,
                       mini_batch_size=4, max_concurrent_decodes=64, total_samples=3200)
    summary = simulate(profile_from_dict(long), config, seed=3).summary
    assert summary["algo/version_gap_max"] <= 1
    found[policy] = summary
  assert found["drop"]["queue/dropped/stale"] > 0
  assert found["drop"]["lengths/consumed_over_generated_mean"] < 0.97
  assert found["wait"]["queue/dropped/stale"] == 0
  assert abs(found["wait"]["lengths/consumed_over_generated_mean"] - 1) < 0.02


def test_records_use_the_real_run_metric_names():
  record = simulate(profile_from_dict(FIXED), RunConfig(mode="async_stale",
                                                        staleness_threshold=0.5,
                                                        **SMALL)).records[-1]
  for name in ("policy_version", "learner_step", "samples", "time_s", "system/samples_per_s",
               "system/tokens_per_s", "rollout/idle_ratio", "learner/idle_ratio",
               "reward/idle_ratio", "sync/idle_ratio", "sync/latency_s", "queue/depth",
               "queue/dropped/stale", "algo/version_gap_mean", "algo/stale_ratio",
               "algo/partial_ratio", "algo/max_partial_span"):
    assert name in record, name


def test_sim_sample_summaries_equal_the_array_ones():
  versions = np.array([3, 3, 4, 6], np.int32)
  sample = SimSample(prompt_id=0, group_id=0, group_size=1, prompt_tokens=np.zeros(1),
                     response_tokens=np.zeros(4), behaviour_logprobs=np.zeros(4),
                     token_versions=versions).set_versions(3, 6)
  plain = dataclasses.replace(sample)
  plain.__class__ = SimSample.__mro__[1]
  for name in ("min_version", "max_version", "version_span", "is_partial"):
    assert getattr(sample, name) == getattr(plain, name)
  assert staleness_metrics([[sample]], 7) == staleness_metrics([[plain]], 7)


@st.composite
def random_setup(draw):
  mode = draw(st.sampled_from(["sync", "on_policy", "stream_off_policy", "async_stale",
                               "async_partial"]))
  stale = mode in ("async_stale", "async_partial")
  staleness = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0])) if stale else 0.0
  gap = draw(st.one_of(st.none(), st.integers(0, 3))) if stale else None
  kind = draw(st.sampled_from(["geometric", "lognormal"]))
  profile = profile_from_dict({
      "name": "random", "prompt_tokens": draw(st.integers(1, 32)),
      "response_length": {"kind": kind, "min": 1, "max": draw(st.integers(2, 200)),
                          "ratio": draw(st.floats(0.5, 0.99)),
                          "median": draw(st.floats(2, 50)), "sigma": draw(st.floats(0, 1.5))},
      "rollout": {"replicas": draw(st.integers(1, 3)), "slots": draw(st.integers(1, 24)),
                  "decode_curve": [[1, draw(st.floats(1e-4, 1e-2))],
                                   [24, draw(st.floats(1e-4, 5e-2))]],
                  "prefill_s_per_token": draw(st.floats(0, 1e-4)),
                  "weight_load_s": draw(st.floats(0, 0.05))},
      "reward_workers": draw(st.integers(1, 4)),
      "reward_latency": {"kind": "lognormal", "median": draw(st.floats(0, 0.05)),
                         "sigma": draw(st.floats(0, 1))},
      "reward_fail_prob": draw(st.sampled_from([0.0, 0.0, 0.05, 0.3])),
      "learner": {"per_update_s": draw(st.floats(0, 0.5)),
                  "s_per_token": draw(st.floats(0, 1e-3)),
                  "recompute_s_per_token": draw(st.floats(0, 1e-3))},
      "sync": {"fixed_s": draw(st.floats(0, 0.2))},
      "contention": draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])),
      "token_block": draw(st.integers(1, 3))})
  config = RunConfig(
      mode=mode, group_size=draw(st.integers(2, 4)), mini_batch_size=draw(st.integers(1, 3)),
      require_batches=draw(st.integers(1, 2)),
      trigger_parameter_sync_step=(draw(st.integers(1, 3)) if mode != "on_policy" else 1),
      staleness_threshold=staleness, max_version_gap=gap,
      version_gap_policy="drop" if gap is None else draw(st.sampled_from(["drop", "wait"])),
      partial_rollout=mode == "async_partial" and staleness > 0,
      partial_strategy=draw(st.sampled_from(["reprefill", "keep_kv"])),
      total_samples=10 ** 6)
  return profile, config, draw(st.integers(2, 8)), draw(st.integers(0, 2 ** 16))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_setup())
def test_random_profiles_keep_the_gap_bound_and_the_accounting(setup):
  profile, config, num_versions, seed = setup
  result = simulate(profile, config, num_versions=num_versions, seed=seed)
  counts = result.counts
  dropped = sum(counts["dropped"].values())
  assert counts["put"] == counts["consumed"] + dropped + counts["queued"]
  assert counts["dropped"]["stale"] == 0 or config.max_version_gap is not None
  assert len(result.records) == num_versions
  bound = 0 if config.staleness_threshold == 0 else config.max_version_gap
  for record in result.records:
    if bound is not None:
      assert record["algo/version_gap_max"] <= bound
    if not config.partial_rollout:
      assert record["algo/partial_ratio"] == 0
  if config.mode != "sync" and profile.reward_fail_prob == 0 and config.max_version_gap is None:
    assert counts["consumed"] == num_versions * config.samples_per_version
  assert result.summary["consumed_samples"] == counts["consumed"]


def test_made_samples_match_validated_ones_and_share_read_only_versions():
  prompt = np.zeros(1, np.int32)
  template = SimSample(prompt_id=0, group_id=0, group_size=4, prompt_tokens=prompt,
                       reward=1.0).set_versions(0, 0)
  versions = np.full(3, 7, np.int32)
  versions.flags.writeable = False
  fields = dict(prompt_id=5, group_id=5, response_tokens=np.zeros(3, np.int32),
                behaviour_logprobs=np.zeros(3, np.float32), token_versions=versions,
                finish_reason="eos", reward_status="ok", interruptions=1,
                meta={"index_in_group": 2, "tokens": 3})
  made = make_sample(template, **fields, _oldest=7, _newest=7)
  checked = SimSample(group_size=4, prompt_tokens=prompt, reward=1.0,
                      **fields).set_versions(7, 7)
  assert made.uid == checked.uid == (5, 2)
  assert made.to_dict() == checked.to_dict()
  assert made.min_version == 7 and not made.is_partial
  assert not made.token_versions.flags.writeable  # shared between samples: nobody writes it
