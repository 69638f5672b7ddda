"""`jaxrl-async simulate`: predict each mode's samples/s, idle ratios and staleness.

    jaxrl-async simulate --profile_from runs/sync --out runs/sim        # a measured profile
    jaxrl-async simulate --profile my_cluster.json --gin_bindings 'RunConfig.group_size = 16'
    jaxrl-async simulate --published verl:128 --num_versions 40         # verl's 128-GPU setup
    jaxrl-async simulate --profile_from runs/sync --sweep --max_gap 2 --max_stale_ratio 0.8

Each mode's knobs come from its gin file (gin/modes/<mode>.gin) plus --gin_bindings, as in
`jaxrl-async train`. With --published they are the published run's own settings, and
--gin_bindings of `RunConfig.<field>` apply on top of them (what-if questions of a published
setup, e.g. `RunConfig.staleness_threshold = 0.3`); bindings of other classes are refused.
Prints one JSON line (per mode: samples/s, speedup over sync, idle ratio of each role, stale ratio, version-gap
distribution, partial ratio); --out writes <out>/<mode>/metrics.jsonl and summary.json with
the metric names of a real run, and <out>/simulation.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import gin
from jaxrl_async import config as config_lib
from jaxrl_async.config import MODES
from jaxrl_async.sim import fit, published, simulate, sweep
from jaxrl_async.sim.profile import load_profile, save_profile
from launch import train

REPORTED = ("system/samples_per_s", "rollout/idle_ratio", "reward/idle_ratio",
            "learner/idle_ratio", "sync/idle_ratio", "algo/stale_ratio", "algo/version_gap_mean",
            "algo/version_gap_max", "algo/version_gap_hist", "algo/partial_ratio",
            "algo/max_partial_span", "queue/dropped/stale", "sim/elapsed_s")


def parse_args(argv):
  parser = argparse.ArgumentParser(prog="jaxrl-async simulate", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--profile", help="a profile JSON file (jaxrl_async/sim/profile.py)")
  source.add_argument("--profile_from", help="fit the profile from a run directory")
  source.add_argument("--published", help="a published setup: verl:32, verl:64 or verl:128")
  parser.add_argument("--modes", default=None, help=f"comma-separated (default: {MODES})")
  parser.add_argument("--gin_bindings", action="append", default=[])
  parser.add_argument("--num_versions", type=int, default=None,
                      help="policy versions per mode (default: the config's budget); with "
                      "--sweep, the budget is this many versions of the first mode's config")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--fold", type=int, default=None, help="--published: 1/fold of the cluster")
  parser.add_argument("--contention", type=float, default=None,
                      help="roles share one host with this contention (threads of a process)")
  parser.add_argument("--learner_contention", type=float, default=None,
                      help="the learner's own contention on that host, if it differs")
  parser.add_argument("--sweep", action="store_true", help="search the knobs (see sweep.py)")
  parser.add_argument("--max_gap", type=int, default=2)
  parser.add_argument("--max_stale_ratio", type=float, default=1.0)
  parser.add_argument("--save_profile", default=None, help="write the profile used as JSON")
  parser.add_argument("--out", default=None)
  return parser.parse_args(argv)


def mode_configs(modes, bindings) -> dict:
  """Each mode's RunConfig from its gin file and the bindings (gin stays at this edge)."""
  configs = {}
  for mode in modes:
    if mode not in MODES:
      raise ValueError(f"--modes: {mode!r} is not a mode; allowed: {MODES}")
    train.load_config([f"gin/modes/{mode}.gin"], bindings)
    configs[mode] = gin.get_configurable(config_lib.RunConfig)()
  gin.clear_config()
  return configs


def run_config_overrides(bindings) -> dict:
  """The RunConfig fields `bindings` set, as values (parsed by gin, as `train` parses them).
  Only `RunConfig.<field> = value` bindings are accepted: a published setup's other settings
  are not the simulator's to change."""
  names = {f.name for f in dataclasses.fields(config_lib.RunConfig)}
  fields = []
  for binding in bindings:
    target, equals, _ = binding.partition("=")
    target = target.strip()
    if not equals or not target.startswith("RunConfig."):
      raise ValueError(f"--gin_bindings {binding!r}: with --published only 'RunConfig.<field> = "
                       "value' bindings apply (on top of the published settings)")
    field = target[len("RunConfig."):]
    if field not in names:
      raise ValueError(f"--gin_bindings {binding!r}: RunConfig has no field {field!r}")
    fields.append(field)
  if not fields:
    return {}
  train.load_config(["gin/base.gin"], bindings)  # base.gin registers the classes
  try:
    return {field: gin.query_parameter(f"jaxrl_async.config.RunConfig.{field}")
            for field in fields}
  finally:
    gin.clear_config()


def load(args):
  if args.published:
    family, _, gpus = args.published.partition(":")
    if family != "verl" or not gpus.isdigit():
      raise ValueError(f"--published={args.published!r}: allowed verl:32, verl:64, verl:128")
    profile, configs = published.verl_setup(int(gpus), fold=args.fold, seed=args.seed)
    if args.modes:
      configs = {m: configs[m] for m in args.modes.split(",") if m in configs} or configs
    overrides = run_config_overrides(args.gin_bindings)
    return profile, {mode: dataclasses.replace(config, **overrides)
                     for mode, config in configs.items()}
  if args.profile_from:
    profile = fit.profile_from_run(args.profile_from, seed=args.seed)
    knobs = fit.knobs_from_run(args.profile_from)
    bindings = [f"RunConfig.{k} = {v!r}" for k, v in knobs.items()
                if k in ("group_size", "max_concurrent_decodes")]
  else:
    profile, bindings = load_profile(args.profile), []
  if args.contention is not None:
    profile = dataclasses.replace(profile, contention=args.contention)
  if args.learner_contention is not None:
    profile = dataclasses.replace(profile, learner_contention=args.learner_contention)
  modes = args.modes.split(",") if args.modes else list(MODES)
  return profile, mode_configs(modes, bindings + args.gin_bindings)


def main(argv=None) -> int:
  args = parse_args(list(sys.argv[1:] if argv is None else argv))
  try:
    profile, configs = load(args)
  except (ValueError, FileNotFoundError) as error:
    print(f"jaxrl-async simulate: {error}", file=sys.stderr)
    return 2
  if args.save_profile:
    save_profile(profile, args.save_profile)
  if args.sweep:
    base = next(iter(configs.values()))
    budget = (args.num_versions * base.samples_per_version if args.num_versions
              else base.total_samples)
    result = sweep.sweep(profile, base, total_samples=budget, max_gap=args.max_gap,
                         max_stale_ratio=args.max_stale_ratio, seed=args.seed)
    line = {"simulate": "sweep", "profile": profile.name, **result}
  else:
    modes = {}
    for mode, config in configs.items():
      result = simulate(profile, config, num_versions=args.num_versions, seed=args.seed)
      if args.out:
        result.write(os.path.join(args.out, mode))
      modes[mode] = {k: result.summary[k] for k in REPORTED}
    sync = next((m for m in modes if m.startswith("sync")), None)
    for row in modes.values():
      if sync is not None:
        row["speedup_vs_sync"] = (row["system/samples_per_s"]
                                  / modes[sync]["system/samples_per_s"])
    line = {"simulate": "modes", "profile": profile.name, "notes": list(profile.notes),
            "modes": modes}
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "simulation.json"), "w", encoding="utf-8") as f:
      json.dump({**line, "profile_used": profile.to_dict()}, f, indent=1, default=float)
  print(json.dumps(line, default=float))
  return 0
