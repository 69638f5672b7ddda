"""launch/train.py and the `jaxrl-async` command: bad settings fail at start with exit code 2 and
the setting's name; a tiny run writes its operative config and says where its outputs are."""

import os
import re

import pytest

import gin
from jaxrl_async import cli
from jaxrl_async import config as config_lib
from jaxrl_async.metrics import read_jsonl
from launch import train

SYNC_GIN = "gin/modes/sync.gin"
TINY_RUN = (
    "DigitReverseTask.max_len = 8",
    "WarmStartConfig.steps = 20",
    "WarmStartConfig.batch_size = 16",
    "RunConfig.group_size = 4",
    "RunConfig.mini_batch_size = 2",
    "RunConfig.total_samples = 16",
    "RunConfig.max_concurrent_decodes = 8",
    "RunConfig.eval_size = 16",
    "RunConfig.eval_every_versions = 2",
    "RunConfig.checkpoint_every_versions = 2",
)




@pytest.fixture(autouse=True)
def clean_gin():
  yield
  gin.clear_config()


def train_args(run_dir, *bindings, gin_file=SYNC_GIN):
  args = ["--gin_file", gin_file, "--run_dir", str(run_dir), "--no_progress"]
  for binding in bindings:
    args += ["--gin_bindings", binding]
  return args


@pytest.mark.parametrize("binding, named", [
    ("RunConfig.bogus = 1", "bogus"),
    ("LearnerConfig.learning_rate = -1.0", "learning_rate"),
    ("RunConfig.group_size = 1", "group_size"),
    ("RunConfig.cache_length = 10", "cache_length"),
    ("RunConfig.mode = 'fastest'", "mode"),
    ("RunConfig.staleness_threshold = -0.5", "staleness_threshold"),
    ("RunConfgi.mode = 'sync'", "RunConfgi"),  # a typo in the configurable's name
    ("RunConfig.group_size = 'eight'", "group_size"),  # the wrong type
    ("RunConfig.mini_batch_size = 2.5", "mini_batch_size"),
    ("RunConfig.partial_rollout = True", "partial_rollout"),  # sync mode forbids it
    ("RunConfig.buffer_capacity = 4", "buffer_capacity"),  # below the admission bound
    ("RunConfig.group_filter = 'sometimes'", "group_filter"),
    ("RunConfig.watchdog_timeout_s = 0.0", "watchdog_timeout_s"),
    ("RunConfig.watchdog_rescue_s = -1.0", "watchdog_rescue_s"),
    ("RunConfig.group_size = 4 4", "group_size"),  # gin syntax: the line is quoted
], ids=["unknown", "learning_rate", "group_size", "cache_length", "mode", "staleness",
        "typo", "wrong_type", "float_for_int", "contradiction", "capacity", "group_filter",
        "watchdog", "rescue", "syntax"])
def test_bad_setting_exits_2_naming_it(tmp_path, capsys, binding, named):
  run_dir = tmp_path / "run"
  assert train.main(train_args(run_dir, *TINY_RUN, binding)) == 2
  err = capsys.readouterr().err
  assert "configuration error" in err
  assert re.search(rf"\b{named}\b", err), err
  assert not run_dir.exists()  # failed before anything was written


def test_missing_gin_file_exits_2(tmp_path, capsys):
  assert train.main(train_args(tmp_path / "run", gin_file="gin/modes/nope.gin")) == 2
  assert "nope.gin" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_run_writes_operative_config_and_prints_its_outputs(tmp_path, capsys):
  run_dir = tmp_path / "run"
  assert train.main(train_args(run_dir, *TINY_RUN)) == 0
  out = capsys.readouterr().out

  paths = dict(re.findall(r"^(metrics|checkpoint|summary):\s+(\S+)$", out, re.MULTILINE))
  assert set(paths) == {"metrics", "checkpoint", "summary"}, out
  assert paths["metrics"] == os.path.join(os.path.abspath(run_dir), "metrics.jsonl")
  assert paths["checkpoint"] == os.path.join(os.path.abspath(run_dir), "checkpoints")
  versions = [r for r in read_jsonl(paths["metrics"]) if "algo/version_gap_max" in r]
  assert [r["policy_version"] for r in versions] == [1, 2]  # 16 samples / (2 groups x 4)
  assert os.path.isfile(paths["summary"])
  assert any(name.isdigit() for name in os.listdir(paths["checkpoint"]))

  # config.gin is the operative config: parsed again it gives the same RunConfig.
  text = (run_dir / "config.gin").read_text()
  assert re.search(r"RunConfig\.total_samples = 16$", text, re.MULTILINE), text
  assert re.search(r"DigitReverseTask\.max_len = 8$", text, re.MULTILINE), text
  train.load_config([SYNC_GIN], list(TINY_RUN))
  expected = gin.get_configurable(config_lib.RunConfig)()
  train.load_config([str(run_dir / "config.gin")], [])
  reparsed = gin.get_configurable(config_lib.RunConfig)()
  assert repr(reparsed) == repr(expected)
  assert reparsed.mode == "sync" and reparsed.total_samples == 16

  # The same run_dir again without --resume: refused at start, naming the way out.
  metrics_before = (run_dir / "metrics.jsonl").read_text()
  assert train.main(train_args(run_dir, *TINY_RUN)) == 2
  err = capsys.readouterr().err
  assert "already holds checkpoints" in err and "--resume" in err, err
  assert (run_dir / "metrics.jsonl").read_text() == metrics_before  # nothing was touched


def test_cli_help_and_unknown_command(capsys):
  assert cli.main(["--help"]) == 0
  assert "train" in capsys.readouterr().err
  assert cli.main(["bogus"]) == 2
  assert cli.main([]) == 2


def test_cli_forwards_to_train(tmp_path, capsys):
  assert cli.main(["train", *train_args(tmp_path / "run", *TINY_RUN, "RunConfig.group_size = 1")
                   ]) == 2
  assert "group_size" in capsys.readouterr().err
