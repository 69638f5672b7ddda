#!/bin/bash
# rlvr_async (processes, 51,200 samples) with the learner process's XLA at its default thread
# pool and at one intra-op thread, alternating default, one, one, default.
# usage: learner-one-thread-20261206.sh CHECKOUT OUTDIR   (jaxrl-async on PATH)
CHECKOUT=$(realpath "$1"); OUT=$(realpath -m "$2"); mkdir -p "$OUT"
cd "$CHECKOUT" || exit 1
run() { # name xla_flags
  echo "$1 start $(cat /proc/loadavg)" >> "$OUT/log"
  XLA_FLAGS="$2" PYTHONPATH="$CHECKOUT" timeout 600 jaxrl-async train \
    --gin_file gin/recipes/rlvr_async.gin --gin_file gin/tasks/rlvr.gin \
    --gin_bindings "RunConfig.backend = 'processes'" --gin_bindings "RunConfig.total_samples = 51200" \
    --run_dir "$OUT/$1" --no_progress > "$OUT/$1.log" 2>&1
}
one="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
run d1 ""; run s1 "$one"; run s2 "$one"; run d2 ""
echo "end $(cat /proc/loadavg)" >> "$OUT/log"
