"""The cross-process benchmarks run on a tiny configuration and report their figures."""

import math

from benchmarks import buffer_throughput


def test_cross_process_buffer_benchmark_runs_two_producer_processes():
  result = buffer_throughput.run_cross_process(
      num_producers=2, num_samples=2 * 8 * 20, group_size=8, groups_per_version=4,
      staleness_threshold=1.0, groups_per_batch=2)
  assert result["samples_per_s"] > 0
  assert math.isfinite(result["latency_ms_p99"])
  assert result["latency_ms_p50"] <= result["latency_ms_p99"]
