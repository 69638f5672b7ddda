"""benchmarks/store_bench.py runs end to end on the tiny preset and reports every channel; at
3% changed elements a delta version is the changed (position, value) pairs, far under a full
one. (Its figures are taken as documented in the script; nothing here times.)"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_store_bench_reports_each_channel_and_the_delta_bytes(tmp_path):
  out = tmp_path / "store_bench.json"
  subprocess.run([sys.executable, "benchmarks/store_bench.py", "--presets", "tiny", "--repeats",
                  "1", "--warmup", "0", "--density", "0.03", "--out", str(out)], cwd=ROOT,
                 check=True, capture_output=True, timeout=300,
                 env={**os.environ, "JAX_PLATFORMS": "cpu"})
  with open(out, encoding="utf-8") as f:
    record = json.loads(f.readline())
  full = record["tiny_bf16_bytes"]
  for kind in ("shm", "store_full", "store_delta"):
    assert record[f"tiny_{kind}_latency_s"] > 0 and record[f"tiny_{kind}_mb_per_s"] > 0
  assert record["tiny_shm_bytes_per_version"] == record["tiny_store_full_bytes_per_version"]
  assert record["tiny_store_full_bytes_per_version"] == full
  # ~3% of the elements, 4 bytes of position + 2 of value each: about 9% of the bf16 bytes.
  assert 0.06 * full < record["tiny_store_delta_bytes_per_version"] < 0.12 * full
