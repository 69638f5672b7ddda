"""Every config dataclass checks its field types first, naming class, field, value and type."""

import dataclasses
import os
import re
import subprocess
import sys
import typing
from typing import Any

import pytest

import gin
from jaxrl_async import config as config_lib
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.learner.step import LearnerConfig
from jaxrl_async.rollout.sampling import SamplingConfig
from jaxrl_async.sharding import MeshShape

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = (RunConfig, LearnerConfig, SamplingConfig, WarmStartConfig, MeshShape)

# (class, field, wrong value, the expected type as the message words it)
WRONG = [
    (LearnerConfig, "learning_rate", "fast", "a float"),  # str for float
    (LearnerConfig, "normalize_std", "yes", "a bool"),  # str for bool
    (LearnerConfig, "use_rollout_log_probs", 1, "a bool"),  # int for bool
    (LearnerConfig, "agg_mode", 3, "a str"),  # int for str
    (LearnerConfig, "dual_clip", "3", "a float or None"),  # str for optional float
    (LearnerConfig, "is_cap", True, "a float or None"),  # bool for optional float
    (LearnerConfig, "temperature", None, "a float"),  # None for float
    (SamplingConfig, "temperature", "hot", "a float"),
    (SamplingConfig, "top_k", 2.0, "an int"),
    (SamplingConfig, "top_k", False, "an int"),
    (SamplingConfig, "top_p", None, "a float"),
    (WarmStartConfig, "steps", 10.0, "an int"),
    (WarmStartConfig, "batch_size", "64", "an int"),
    (WarmStartConfig, "learning_rate", "1e-2", "a float"),
    (WarmStartConfig, "seed", True, "an int"),
    (MeshShape, "data", 2.0, "an int"),
    (MeshShape, "fsdp", "4", "an int"),
    (MeshShape, "tensor", True, "an int"),
    (MeshShape, "tensor", None, "an int"),
    (RunConfig, "seed", 1.5, "an int"),
    (RunConfig, "mode", 3, "a str"),
    (RunConfig, "partial_rollout", "yes", "a bool"),
    (RunConfig, "staleness_threshold", "0.5", "a float"),
    (RunConfig, "max_version_gap", 2.5, "an int or None"),
    (RunConfig, "watchdog_timeout_s", False, "a float or None"),
    (RunConfig, "metric_sinks", "tensorboard", "a tuple or a list"),
    (RunConfig, "learner", "fast", "a LearnerConfig"),
    (RunConfig, "learner_mesh", None, "a MeshShape"),
    (RunConfig, "rollout_mesh", (1, 1, 1), "a MeshShape or None"),
]


@pytest.mark.parametrize(("cls", "field", "value", "expected"), WRONG,
                         ids=[f"{c.__name__}.{f}={v!r}" for c, f, v, _ in WRONG])
def test_a_wrong_type_is_named(cls, field, value, expected):
  match = (rf"^{cls.__name__}\.{field}={re.escape(repr(value))} must be {expected} "
           rf"\(got {type(value).__name__}\)$")
  with pytest.raises((TypeError, ValueError), match=match):
    cls(**{field: value})


def _checked_fields(cls):
  """(field, hint) for every field whose hint names classes (not Any)."""
  hints = typing.get_type_hints(cls)
  return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if hints[f.name] is not Any]


@pytest.mark.parametrize("value", [1.5, True, "64", None])
def test_logit_chunk_size_keeps_its_own_check(value):
  """Its own type-and-range check (a ValueError, tests/learner/test_chunked_logits.py) runs
  first; it names class, field, value and type too."""
  match = (r"^LearnerConfig\.logit_chunk_size must be an int >= 0 \(0: unchunked\), got "
           rf"{re.escape(repr(value))} \({type(value).__name__}\)$")
  with pytest.raises(ValueError, match=match):
    LearnerConfig(logit_chunk_size=value)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_field_refuses_a_wrong_type(cls):
  """Each typed field of each class: a str where it is not a str, else an int."""
  fields = _checked_fields(cls)
  assert fields
  for field, hint in fields:
    value = 7 if hint is str or str in typing.get_args(hint) else "wrong"
    with pytest.raises((TypeError, ValueError), match=rf"^{cls.__name__}\.{field}[= ]"):
      cls(**{field: value})


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_bools_are_refused_for_ints(cls):
  fields = [name for name, hint in _checked_fields(cls)
            if hint is int or (int in typing.get_args(hint) and bool not in typing.get_args(hint))]
  assert fields
  for field in fields:
    with pytest.raises((TypeError, ValueError),
                       match=rf"^{cls.__name__}\.{field}(=True)? must be an int"):
      cls(**{field: True})


def test_ints_are_accepted_for_floats():
  learner = LearnerConfig(learning_rate=1, weight_decay=0, adam_b1=0, adam_b2=1, grad_clip=1,
                          clip_low=0, clip_high=1, dual_clip=3, kl_coef=0, entropy_coef=0,
                          temperature=1, is_cap=5)
  assert learner.learning_rate == 1
  assert SamplingConfig(temperature=0, top_p=1).top_p == 1
  assert WarmStartConfig(learning_rate=1).learning_rate == 1
  config = RunConfig(staleness_threshold=0, reward_timeout_s=10, heartbeat_timeout_s=5,
                     ray_rollout_cpus=1, ray_rollout_gpus=0, watchdog_timeout_s=60,
                     watchdog_startup_s=120, learner=learner)
  assert config.learner is learner


def test_optional_fields_accept_none():
  assert LearnerConfig(dual_clip=None, is_cap=None).is_cap is None
  assert RunConfig(max_version_gap=None, rollout_mesh=None, watchdog_timeout_s=None,
                   cache_length=None).max_version_gap is None


def test_tuples_accept_lists():
  assert RunConfig(metric_sinks=["tensorboard"]).metric_sinks == ["tensorboard"]


def test_range_checks_still_run_after_the_types():
  with pytest.raises(ValueError, match=r"learning_rate must be > 0, got 0"):
    LearnerConfig(learning_rate=0)
  with pytest.raises(ValueError, match=r"top_k must be >= 0 \(0 = off\), got -1"):
    SamplingConfig(top_k=-1)
  with pytest.raises(ValueError, match=r"warm start batch_size must be >= 1, got 0"):
    WarmStartConfig(batch_size=0)
  with pytest.raises(ValueError, match=r"mesh axis 'fsdp' must be a positive size or -1"):
    MeshShape(fsdp=0).resolve(8)


def test_config_module_uses_the_shared_check():
  from jaxrl_async import config_types
  assert config_lib.check_field_types is config_types.check_field_types


def test_a_wrong_gin_binding_names_the_field():
  from launch import train

  train.load_config(["gin/modes/sync.gin"], ["LearnerConfig.learning_rate = 'fast'"])
  with pytest.raises(TypeError, match=r"LearnerConfig\.learning_rate='fast' must be a float"):
    gin.get_configurable(config_lib.RunConfig)()


def test_launch_exits_before_training_naming_the_field(tmp_path):
  run_dir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAXRL_ASYNC_CACHE=str(tmp_path / "cache"))
  result = subprocess.run(
      [sys.executable, "-m", "launch.train", "--run_dir", str(run_dir),
       "--gin_bindings", "LearnerConfig.learning_rate = 'fast'"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
  assert result.returncode == 2, result.stderr
  assert "configuration error" in result.stderr
  assert "LearnerConfig.learning_rate='fast' must be a float (got str)" in result.stderr
  assert "not supported between instances" not in result.stderr
  assert not run_dir.exists()  # failed while building the config: no run started
