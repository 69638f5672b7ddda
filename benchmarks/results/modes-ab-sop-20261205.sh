#!/bin/bash
# Paired, interleaved rounds, old (before the one loop) and new; sync and stream_off_policy only.
# Usage: modes-ab-sop-20261205.sh BACKEND OUTDIR; the old tree: git worktree add /tmp/old_wt 1a27f73^
backend=$1; out=$2; mkdir -p $out
ARGS="--backend $backend --modes sync,stream_off_policy --total_samples 25600 --warmup_samples 3200 --eval_every_versions 100 --repeats 1"
for round in 1 2 3; do
  if [ $((round % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ $side = old ]; then dir=/tmp/old_wt; else dir=/work/main; fi
    echo "round $round $side $(uptime)" >> $out/log
    (cd $dir && /work/main/.venv/bin/python benchmarks/modes.py $ARGS --out $out/$side-r$round > $out/$side-r$round.stdout 2> $out/$side-r$round.stderr)
    echo "rc $? $(date +%T)" >> $out/log
  done
done
