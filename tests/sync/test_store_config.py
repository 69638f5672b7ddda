"""The weight store's knobs fail at start with the knob's name, value and what is allowed."""

import pytest

from jaxrl_async.config import RunConfig
from jaxrl_async.sync import store_options

ASYNC = dict(mode="async_stale", staleness_threshold=1.0)


@pytest.mark.parametrize("overrides, message", [
    (dict(sync_delta=True), "sync_delta=True needs sync_backend='store'"),
    (dict(rollout_param_dtype="bfloat16"), "rollout_param_dtype='bfloat16' needs sync_backend"),
    (dict(sync_backend="store", rollout_param_dtype="int8"), "rollout_param_dtype must be one"),
    (dict(sync_backend="store", sync_full_every=0), "sync_full_every must be a positive int"),
    (dict(sync_backend="store", sync_load_deadline_s=0.0), "sync_load_deadline_s must be > 0"),
])
def test_bad_store_settings_name_the_knob(overrides, message):
  with pytest.raises(ValueError, match=message):
    RunConfig(**{**ASYNC, **overrides})


def test_sync_mode_refuses_a_rollout_dtype_and_the_options_follow_the_knobs():
  with pytest.raises(ValueError, match="needs an async mode"):
    RunConfig(mode="sync", sync_backend="store", rollout_param_dtype="bfloat16")
  config = RunConfig(**ASYNC, sync_backend="store", sync_delta=True, sync_full_every=4,
                     rollout_param_dtype="bfloat16")
  assert store_options(config) == {"delta": True, "full_every": 4, "rollout_dtype": "bfloat16"}
