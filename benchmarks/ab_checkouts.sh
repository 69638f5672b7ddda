#!/bin/bash
# One benchmarks/modes.py invocation from two checkouts of this repository, alternating
# old, new, new, old, old, new (paired interleaved rounds), each side importing its own code.
# usage: benchmarks/ab_checkouts.sh OLD_CHECKOUT NEW_CHECKOUT OUTDIR MODES_ARGS...
#   e.g. benchmarks/ab_checkouts.sh /tmp/old . /tmp/ab --backend processes \
#          --task_file gin/tasks/rlvr.gin --modes '' --recipes rlvr_async --repeats 1 \
#          --total_samples 25600 --warmup_samples 2560 --eval_every_versions 20 --ceiling_batches 0
# One Python environment with the package's dependencies on PATH. Each round writes
# OUTDIR/D-<side>-r<round>.json (and .log); OUTDIR/log has each round's start time and load.
set -eu
old=$(realpath "$1"); new=$(realpath "$2"); out=$(realpath -m "$3"); shift 3
mkdir -p "$out"
run() {  # side round MODES_ARGS...
  local side=$1 round=$2 root
  shift 2
  if [ "$side" = old ]; then root=$old; else root=$new; fi
  echo "$side r$round start $(date +%T) $(cat /proc/loadavg)" >> "$out/log"
  (cd "$root" && PYTHONPATH="$root" python benchmarks/modes.py "$@" \
    --out "$out/D-$side-r$round" > "$out/D-$side-r$round.log" 2>&1)
}
for pair in "old 1" "new 1" "new 2" "old 2" "old 3" "new 3"; do
  # shellcheck disable=SC2086  # the pair is two words on purpose
  run $pair "$@"
done
echo "end $(date +%T) $(cat /proc/loadavg)" >> "$out/log"
