"""Fixed staleness thresholds against the adaptive controller on the RLVR workload.

    jaxrl-async sweep launch/sweeps/rlvr_staleness.py

5 trials of gin/recipes/rlvr_async.gin on gin/tasks/rlvr.gin (processes backend): s in
{0.25, 0.5, 1.0, 2.0} fixed, and 'adaptive' starting at 1.0 within [0.25, 2]. Compare each trial's
system/samples_per_s, eval/accuracy, algo/stale_ratio and the adaptive trial's
staleness/threshold path. Expected on a 2-core CPU: about 2 minutes a trial, one at a time.
"""

from launch import hyper

NAME = "rlvr_staleness"
GIN_FILES = ["gin/recipes/rlvr_async.gin", "gin/tasks/rlvr.gin"]
BINDINGS = ["RunConfig.backend = 'processes'"]

TRIALS = hyper.chainit([
    hyper.sweep("RunConfig.staleness_threshold", [0.25, 0.5, 1.0, 2.0]),
    # partial rollout needs s > 0 all along: the controller's floor is the sweep's smallest s
    [{"RunConfig.staleness_controller": "adaptive", "RunConfig.staleness_min": 0.25}],
])
