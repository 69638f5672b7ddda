"""Writes the default run's base policy (the warm start of `jaxrl-async train` with its default gin file)
into tests/fixtures/base/<key>/, where the test suite finds it instead of training it again (the
warm start costs about 130 CPU-s on two cores; the fixture is about 0.4 MB).

    python tools/make_base_fixture.py

Run it again when the default task, model or warm-start recipe changes: the key names all three,
and `tests/learner/test_base_fixture.py` fails while the shipped entry is not the default's.
Uses the base policy in the user's cache (JAXRL_ASYNC_CACHE, else ~/.cache/jaxrl_async) when it
is there, and trains it there otherwise.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gin
from jaxrl_async import config as config_lib
from jaxrl_async import sharding
from jaxrl_async.learner import sft
from jaxrl_async.run import build
from launch import train

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def default_entry(cache_dir=None) -> tuple[config_lib.RunConfig, build.ModelSpec, pathlib.Path]:
  """The default run's config, model spec and base-policy cache entry under `cache_dir`."""
  train.load_config([train.DEFAULT_GIN], [])
  config = gin.get_configurable(config_lib.RunConfig)()
  gin.clear_config()
  spec = build.model_spec(config)
  return config, spec, sft.cache_entry(spec.task, spec.model_config, config.warm_start,
                                       cache_dir)


def main() -> int:
  config, spec, entry = default_entry()
  mesh = sharding.place_roles(config.learner_mesh, config.rollout_mesh).learner
  sft.cached_base_policy(spec.task, spec.model_config, config.warm_start, mesh)  # trains if absent
  target = FIXTURES / "base" / entry.name
  for old in (FIXTURES / "base").glob("*") if (FIXTURES / "base").exists() else ():
    shutil.rmtree(old)  # one entry: the default's
  shutil.copytree(entry / "params", target / "params")
  print(f"wrote {target} ({sum(f.stat().st_size for f in target.rglob('*') if f.is_file())} "
        "bytes)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
