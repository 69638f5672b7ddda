"""The default run's base policy shipped in tests/fixtures/base (which tests/conftest.py puts in
the session's warm-start cache) is the one today's default config asks for, and loads as it."""

import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from jaxrl_async import sharding
from jaxrl_async.learner import sft
from tools import make_base_fixture


def test_the_shipped_base_policy_is_the_default_configs():
  config, spec, entry = make_base_fixture.default_entry(make_base_fixture.FIXTURES)
  shipped = sorted(p.name for p in (make_base_fixture.FIXTURES / "base").iterdir())
  assert shipped == [entry.name], (
      f"tests/fixtures/base holds {shipped}, the default config's base policy is {entry.name}: "
      "run `python tools/make_base_fixture.py`")
  mesh = sharding.place_roles(config.learner_mesh, config.rollout_mesh).learner
  params = sft.cached_base_policy(spec.task, spec.model_config, config.warm_start, mesh,
                                  cache_dir=make_base_fixture.FIXTURES, log=lambda *a: None)
  leaves = jax.tree.leaves(params)
  expected = jax.tree.leaves(spec.abstract_params)
  assert [(x.shape, x.dtype) for x in leaves] == [(x.shape, x.dtype) for x in expected]
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
  assert not (make_base_fixture.FIXTURES / "base" / f"{entry.name}.lock").exists()
