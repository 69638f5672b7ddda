"""`jaxrl-async serve --checkpoint RUN_DIR` on a real tiny run: the served policy is the
checkpoint's (greedy tokens equal the engine's on the restored params), held-out accuracy
through the server equals local evaluation, and bad paths fail at start with exit code 2."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading

import grpc
import pytest

import gin
from jaxrl_async import config as config_lib
from jaxrl_async.rollout.engine import Engine
from jaxrl_async.rollout.evaluate import evaluate
from jaxrl_async.rollout.generation import ContinuousBatcher
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.serve import policy as policy_lib
from jaxrl_async.serve.client import evaluate_through_server
from launch import serve, train
from tests.test_launch import SYNC_GIN, TINY_RUN

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bad_checkpoint_path_exits_2(tmp_path, capsys):
  assert serve.main(["--checkpoint", str(tmp_path / "missing"), "--port", "0"]) == 2
  assert "config.gin" in capsys.readouterr().err


def test_eval_size_needs_a_run(tmp_path, capsys):
  assert serve.main(["--hf_model", str(tmp_path), "--eval_size", "4"]) == 2
  assert "--eval_size" in capsys.readouterr().err


def _read_lines(stream, lines: queue.Queue):
  for line in stream:
    lines.put(line)


@pytest.mark.slow
def test_serve_a_trained_run(tmp_path, capsys):
  run_dir = tmp_path / "run"
  args = ["--gin_file", SYNC_GIN, "--run_dir", str(run_dir), "--no_progress"]
  for binding in TINY_RUN:
    args += ["--gin_bindings", binding]
  assert train.main(args) == 0
  gin.clear_config()

  proc = subprocess.Popen(
      [sys.executable, "-m", "jaxrl_async.cli", "serve", "--checkpoint", str(run_dir),
       "--port", "0", "--temperature", "0", "--max_concurrent_decodes", "8"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  lines: queue.Queue = queue.Queue()
  reader = threading.Thread(target=_read_lines, args=(proc.stdout, lines), name="serve-log",
                            daemon=True)
  reader.start()
  try:
    address, seen = None, []
    while address is None:
      line = lines.get(timeout=300)
      seen.append(line)
      if line.startswith("serving "):
        address = line.strip().rsplit(" on ", 1)[1]
    assert address.startswith("127.0.0.1:"), seen
    assert "policy_version 2" in seen[-1]  # the latest checkpoint of the 2-version run

    train.load_config([str(run_dir / "config.gin")], [])
    config = gin.get_configurable(config_lib.RunConfig)()
    gin.clear_config()
    policy = policy_lib.policy_from_checkpoint(config, run_dir)
    task = config.task
    problems = task.eval_set(32)
    engine = Engine(policy.graphdef, policy.model_config, max_concurrent_decodes=8,
                    max_prefill_length=policy.max_prefill_length,
                    sampling=SamplingConfig(temperature=0.0))
    batcher = ContinuousBatcher(engine, eos_id=policy.eos_id,
                                max_response_len=policy.max_response_len)
    batcher.set_params(policy.params, policy.version)
    local = evaluate(batcher, task, problems)
    with grpc.insecure_channel(address) as channel:
      served = evaluate_through_server(channel, task, problems, concurrency=16)
    assert local["eval/accuracy"] > 0  # a warm-started policy: the comparison has content
    for name in ("eval/accuracy", "eval/reward_mean", "eval/response_len_mean"):
      assert served[name] == local[name], name
    # The same evaluation as one command: a server of its own, metrics as one JSON line.
    assert serve.main(["--checkpoint", str(run_dir), "--port", "0", "--temperature", "0",
                       "--max_concurrent_decodes", "8", "--eval_size", "32"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["policy_version"] == 2
    for name in ("eval/accuracy", "eval/reward_mean", "eval/response_len_mean"):
      assert printed[name] == local[name], name
  finally:
    proc.send_signal(signal.SIGTERM)
    try:
      code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait(timeout=30)
      raise
    reader.join(timeout=30)
  assert code == 0
