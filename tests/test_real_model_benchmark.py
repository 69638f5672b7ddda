"""benchmarks/real_model.py runs to completion on a tiny configuration and reports every figure."""

import json

from benchmarks import real_model
from jaxrl_async.learner.step import LearnerConfig


def test_real_model_benchmark_reports_decode_learner_and_memory(tmp_path):
  out = tmp_path / "real_model.json"
  assert real_model.main(["--model", "tiny", "--prompts", "2", "--samples", "2",
                          "--prompt_len", "8", "--response_len", "6", "--decode_steps", "3",
                          "--dtype", "float32", "--param_dtype", "float32",
                          "--out", str(out)]) == 0
  record = json.loads(out.read_text())
  assert record["remat"] is True and record["model"] == "tiny"
  assert record["decode"]["tokens"] == 2 * 2 * 6 and record["decode"]["tokens_per_s"] > 0
  assert record["learner"]["ran"] and record["learner"]["tokens"] == 2 * 2 * (8 + 6)
  assert record["learner"]["logit_chunk_size"] == LearnerConfig.logit_chunk_size > 0
  for variant in ("update_remat", "update_no_remat"):
    assert record["memory"][variant]["argument_mb"] > 0
  assert record["memory"]["peak_rss_mb"] > 0 and len(record["load_average_1_5_15"]) == 3
