"""Fixed staleness thresholds, the adaptive controller and sync on the RLVR workload, in paired
rounds.

    jaxrl-async sweep launch/sweeps/rlvr_staleness_paired.py

gin/recipes/rlvr_async.gin on gin/tasks/rlvr.gin, processes backend. Each round runs every
setting once with the same RunConfig.seed (0 to 4: prompt order and sampling keys; the base
policy is the same), so a setting's rounds pair with the others' and a ratio is read within a
round; the rounds follow one another, so slow drift of the machine falls on every setting alike.
Settings: sync (threads backend, s = 0, no partial rollout, the recipe's batch geometry), s in
{0.5, 1.0, 2.0} fixed, and the adaptive controller from 0.5 within [0.25, 2] twice: with its
default budgets (KL 0.02, no stale-ratio budget) and with a KL budget of 0.004, which the fixed
runs put between s = 1.0 and s = 2.0 (mean behaviour KL 0.0031 and 0.0062 in a first reading).
Expected on a 2-core CPU: about 6 minutes a round, one trial at a time.
"""

from launch import hyper

NAME = "rlvr_staleness_paired"
GIN_FILES = ["gin/recipes/rlvr_async.gin", "gin/tasks/rlvr.gin"]
BINDINGS = ["RunConfig.backend = 'processes'"]
ROUNDS = (0, 1, 2, 3, 4)

SYNC = {"RunConfig.mode": "sync", "RunConfig.backend": "threads",
        "RunConfig.staleness_threshold": 0.0, "RunConfig.partial_rollout": False}
ADAPTIVE = {"RunConfig.staleness_controller": "adaptive", "RunConfig.staleness_threshold": 0.5,
            # partial rollout needs s > 0 all along: the floor is above 0
            "RunConfig.staleness_min": 0.25}
SETTINGS = ([SYNC] + hyper.sweep("RunConfig.staleness_threshold", [0.5, 1.0, 2.0])
            + [ADAPTIVE, {**ADAPTIVE, "RunConfig.kl_budget": 0.004}])

TRIALS = [{"RunConfig.seed": seed, **setting} for seed in ROUNDS for setting in SETTINGS]
