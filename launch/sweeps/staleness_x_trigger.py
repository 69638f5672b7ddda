"""How staleness and local updates per version trade speed against accuracy (async_stale).

    jaxrl-async sweep launch/sweeps/staleness_x_trigger.py --parallel 2

4 trials: staleness_threshold in {0.5, 1.0} x trigger_parameter_sync_step in {1, 2}, with
mini_batch_size halved where trigger is 2 so every trial consumes 8 groups per policy version.
Expected on a 2-core CPU (measured under load, two trials at a time): 2 to 5 minutes a trial,
about 10 minutes in all; final accuracy about 0.8 in every trial; stale ratio about 0.7 at
s = 0.5 with one update per version and near 1.0 otherwise.
"""

from launch import hyper

NAME = "staleness_x_trigger"
GIN_FILES = ["gin/modes/async_stale.gin"]
BINDINGS = ["RunConfig.total_samples = 12800", "RunConfig.eval_every_versions = 20"]

TRIALS = hyper.product([
    hyper.sweep("RunConfig.staleness_threshold", [0.5, 1.0]),
    hyper.zipit([
        hyper.sweep("RunConfig.trigger_parameter_sync_step", [1, 2]),
        hyper.sweep("RunConfig.mini_batch_size", [8, 4]),
    ]),
])
