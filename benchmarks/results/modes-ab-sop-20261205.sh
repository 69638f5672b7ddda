#!/bin/bash
# Paired, interleaved rounds, old (before the one loop) and new; sync and stream_off_policy only,
# at 25,600 samples. Usage: modes-ab-sop-20261205.sh BACKEND OUTDIR; the old tree:
# git worktree add /tmp/old_wt 1a27f73^
MODES_AB_ARGS="--modes sync,stream_off_policy --total_samples 25600 --warmup_samples 3200 --eval_every_versions 100 --repeats 1" \
  exec "$(dirname "$0")/modes-ab-20261205.sh" "$@"
