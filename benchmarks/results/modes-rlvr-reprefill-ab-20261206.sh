#!/bin/bash
# rlvr_async on the processes backend from two checkouts, alternating old, new, new, old, old, new.
# usage: modes-rlvr-reprefill-ab-20261206.sh OLD_CHECKOUT NEW_CHECKOUT OUTDIR  (one Python
# environment with the package's dependencies on PATH; each side imports its own checkout)
old=$(realpath "$1"); new=$(realpath "$2"); out=$(realpath "$3"); mkdir -p "$out"
run() {  # side round
  if [ "$1" = old ]; then root=$old; else root=$new; fi
  echo "$1 r$2 start $(date +%T) $(cat /proc/loadavg)" >> "$out/log"
  (cd "$root" && PYTHONPATH="$root" python benchmarks/modes.py --backend processes \
    --task_file gin/tasks/rlvr.gin --modes '' --recipes rlvr_async --repeats 1 \
    --total_samples 25600 --warmup_samples 2560 --eval_every_versions 20 --ceiling_batches 0 \
    --out "$out/D-$1-r$2" > "$out/D-$1-r$2.log" 2>&1)
}
run old 1; run new 1; run new 2; run old 2; run old 3; run new 3
echo "end $(date +%T) $(cat /proc/loadavg)" >> "$out/log"
