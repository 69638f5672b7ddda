#!/bin/bash
# Paired, interleaved rounds: the run layer before (1a27f73^) and after (HEAD), one modes.py
# invocation of each per round, order alternating. Usage: modes_ab.sh BACKEND OUTDIR
backend=$1; out=$2; mkdir -p $out
# MODES_AB_ARGS replaces the modes.py arguments after --backend (modes-ab-sop-20261205.sh).
ARGS="--backend $backend ${MODES_AB_ARGS:---total_samples 12800 --warmup_samples 3200 --eval_every_versions 50 --repeats 1}"
for round in 1 2 3; do
  if [ $((round % 2)) -eq 1 ]; then order="old new"; else order="new old"; fi
  for side in $order; do
    if [ $side = old ]; then dir=/tmp/old_wt; else dir=/work/main; fi
    echo "round $round $side $(uptime)" >> $out/log
    (cd $dir && /work/main/.venv/bin/python benchmarks/modes.py $ARGS --out $out/$side-r$round > $out/$side-r$round.stdout 2> $out/$side-r$round.stderr)
    echo "rc $?" >> $out/log
  done
done
