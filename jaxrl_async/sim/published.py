"""Profiles of published setups, built from the files in `profiles/` (every number there is
either copied from the cited source, or assumed with its reason).

`verl_setup(gpus)` gives verl's fully async Qwen2.5-Math-7B runs at 32, 64 or 128 GPUs: the
colocated sync baseline on all GPUs and the fully async run on the published rollout:train
split. The rollout's decode speed and the learner's cost per token are taken from the
published sync run at the same GPU count (the way a measured sync run of this project gives
the local profile); the published async results are not used.

`fold` simulates 1/fold of the cluster: the rollout replicas and every batch are divided by
`fold` (each replica keeps its load), and the learner's cost per token is multiplied by `fold`
(an update of 1/fold of the tokens takes the same time). Default: one async rollout replica.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from jaxrl_async.config import RunConfig
from jaxrl_async.learner.step import LearnerConfig
from jaxrl_async.sim.profile import (
  LatencyModel,
  LearnerCost,
  LengthModel,
  Profile,
  RolloutCost,
  SyncCost,
)
from jaxrl_async.sim.simulator import simulate

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
VERL = "verl_fully_async_qwen25_math_7b"


def load_published(name: str = VERL) -> dict:
  path = os.path.join(PROFILE_DIR, f"{name}.json")
  if not os.path.isfile(path):
    known = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
    raise ValueError(f"published profile {name!r} not found; known: {known}")
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _divide(what: str, total: int, fold: int) -> int:
  if total % fold:
    raise ValueError(f"fold={fold} must divide {what}={total}")
  return total // fold


def verl_configs(spec: dict, fold: int) -> dict[str, RunConfig]:
  """The published knob settings (sync baseline, the modes of the 128-card tables)."""
  setup = spec["setup"]
  mini = _divide("ppo_mini_batch_size", setup["ppo_mini_batch_size"], fold)
  per_step = _divide("prompts_per_step", setup["prompts_per_step"], fold)
  common = dict(group_size=setup["n_resp_per_prompt"], mini_batch_size=mini,
                max_concurrent_decodes=spec["assumed"]["slots_per_replica"]["value"],
                total_samples=10 ** 9, debug_checks=False,
                learner=LearnerConfig(use_rollout_log_probs=True))
  trigger, require = setup["trigger_parameter_sync_step"], setup["require_batches"]
  return {
      "sync": RunConfig(mode="sync", trigger_parameter_sync_step=per_step // mini, **common),
      "stream_off_policy": RunConfig(mode="stream_off_policy", require_batches=require,
                                     trigger_parameter_sync_step=trigger, **common),
      **{f"async_partial_s{s}": RunConfig(mode="async_partial", require_batches=require,
                                          trigger_parameter_sync_step=trigger,
                                          staleness_threshold=s, partial_rollout=True, **common)
         for s in (0.1, 0.3, setup["staleness_threshold"])},
  }


def verl_setup(gpus: int, *, fold: int | None = None, calibration_versions: int = 3,
               seed: int = 0, spec: dict | None = None) -> tuple[Profile, dict[str, RunConfig]]:
  spec = spec or load_published(VERL)
  if str(gpus) not in spec["published"]:
    raise ValueError(f"gpus={gpus} is not a published setup; published: "
                     f"{sorted(k for k in spec['published'] if k.isdigit())}")
  setup, assumed, run = spec["setup"], spec["assumed"], spec["published"][str(gpus)]
  tp = setup["gen_tp"]
  rollout_gpus, train_gpus = run["split"]
  async_replicas, sync_replicas = rollout_gpus // tp, gpus // tp
  fold = async_replicas if fold is None else int(fold)
  configs = verl_configs(spec, fold)
  lengths = assumed["response_length"]
  length = LengthModel(kind="lognormal", min=1, max=setup["max_response_length"],
                       median=lengths["median"], sigma=lengths["sigma"])
  samples_per_step = setup["prompts_per_step"] * setup["n_resp_per_prompt"]
  tokens_per_step = samples_per_step * length.mean()
  # Decode step shape from bytes: weights read once per step, each sequence's KV cache once.
  weight_bytes = setup["model_params"] * setup["bytes_per_param"] / tp
  kv_bytes = (setup["layers"] * 2 * setup["kv_heads"] * setup["head_dim"]
              * setup["bytes_per_param"] / tp * assumed["decode_curve_shape"]["mean_context_tokens"])
  n_sat = weight_bytes / kv_bytes
  slots = assumed["slots_per_replica"]["value"]

  def curve(t0):
    return ((1, t0 * (1 + 1 / n_sat)), (slots, t0 * (1 + slots / n_sat)))

  def rollout(replicas, t0):
    return RolloutCost(replicas=_divide("rollout replicas", replicas, fold), slots=slots,
                       decode_curve=curve(t0),
                       prefill_s_per_token=assumed["prefill_s_per_token"]["value"],
                       weight_load_s=0.0)

  reward = assumed["reward_latency_s"]
  sync = assumed["sync"]
  base = Profile(name=f"verl-qwen2.5-math-7b-{gpus}gpu", prompt_tokens=assumed["prompt_tokens"][
      "value"], response_length=length, reward_workers=max(1, reward["workers"] // fold),
      reward_latency=LatencyModel(kind="lognormal", median=reward["median"],
                                  sigma=reward["sigma"]),
      sync=SyncCost(fixed_s=sync["fixed_s"],
                    bytes=setup["model_params"] * setup["bytes_per_param"],
                    bandwidth_bytes_per_s=sync["bandwidth_bytes_per_s"]),
      token_block=assumed["token_block"]["value"])
  # Calibrate t0 on the colocated sync step: generation time = t0 * D + prefill P.
  probe = []
  for t0 in (1.0, 2.0):
    profile = dataclasses.replace(base, colocated_rollout=rollout(sync_replicas, t0),
                                  sync=SyncCost(), reward_latency=LatencyModel())
    result = simulate(profile, configs["sync"], num_versions=calibration_versions, seed=seed)
    probe.append(result.summary["sim/generate_s"] / calibration_versions)
  decode = probe[1] - probe[0]
  t0 = (run["sync_gen_s"] - (probe[0] - decode)) / decode
  b = assumed["learner_gpu_scaling_exponent"]["value"]
  per_token = run["sync_update_actor_s"] / tokens_per_step * fold
  old_pass = run["sync_old_log_prob_s"] / tokens_per_step * fold
  colocated = LearnerCost(s_per_token=per_token, old_logprob_s_per_token=old_pass,
                          old_logprob_pass_modes=("sync",))
  split = LearnerCost(s_per_token=per_token * (gpus / train_gpus) ** b)
  overhead = (run["sync_step_s"] - run["sync_gen_s"] - run["sync_old_log_prob_s"]
              - run["sync_update_actor_s"])
  notes = (f"t0 = {t0 * 1e3:.3f} ms per decode step at one active slot (calibrated to the "
           f"published sync generation time {run['sync_gen_s']} s at {gpus} GPUs), "
           f"n_sat = {n_sat:.0f} slots",
           f"mean response length {length.mean():.0f} tokens; learner "
           f"{per_token / fold * 1e6:.2f} us/token on {gpus} GPUs, x{(gpus / train_gpus) ** b:.2f}"
           f" on {train_gpus}", f"fold {fold}: {async_replicas // fold} async and "
           f"{sync_replicas // fold} sync replicas, {setup['prompts_per_step'] // fold} prompts "
           "per step")
  profile = dataclasses.replace(base, rollout=rollout(async_replicas, t0),
                                colocated_rollout=rollout(sync_replicas, t0), learner=split,
                                colocated_learner=colocated, sync_mode_overhead_s=overhead,
                                notes=notes)
  if not math.isfinite(t0) or t0 <= 0:
    raise ValueError(f"calibration failed: t0={t0} (generation probe {probe})")
  return profile, configs


def table_consistency(spec: dict | None = None) -> dict[str, dict]:
  """What the published sync runs allow the async runs, before any modelling.

  An async step cannot be shorter than its learner's update of that step's tokens. If a step
  holds the same work in the sync and the async run (what any profile built from the sync run
  assumes), the learner's time on the train split's `t` GPUs is bounded below by:
  - `scaled_b0`: the sync run's update_actor time at its `g` GPUs (the learner loses nothing
    with fewer GPUs: the most favourable case);
  - `scaled_b`: the same times (g / t) ** b, with the profile's exponent b;
  - `direct`: the update_actor time of the published sync run on `t` GPUs, where there is one.
  Each bound gives a largest possible speedup (sync step / bound), set beside the published one.
  `gpu_s_per_step` shows each stage's GPU-seconds per step: equal work per step would keep them
  near each other across GPU counts."""
  spec = spec or load_published(VERL)
  runs = {int(k): v for k, v in spec["published"].items() if k.isdigit()}
  b = spec["assumed"]["learner_gpu_scaling_exponent"]["value"]
  out = {}
  for gpus, run in sorted(runs.items()):
    train = run["split"][1]
    bounds = {"scaled_b0": run["sync_update_actor_s"],
              "scaled_b": run["sync_update_actor_s"] * (gpus / train) ** b}
    if train in runs:
      bounds["direct"] = runs[train]["sync_update_actor_s"]
    published = run["speedup_400_steps"]
    largest = {name: run["sync_step_s"] / bound for name, bound in bounds.items()}
    out[str(gpus)] = {
        "train_gpus": train, "learner_bound_s": bounds, "largest_speedup": largest,
        "published_speedup_400_steps": published,
        "published_async_step_s": run["async_step_s"],
        "published_exceeds": sorted(name for name, s in largest.items() if published > s),
        "gpu_s_per_step": {stage: run[f"sync_{stage}_s"] * gpus
                           for stage in ("gen", "old_log_prob", "update_actor")}}
  return out
