"""jaxrl_async.compilation_cache: where XLA's persistent cache goes, and how to turn it off."""

import jax
import pytest

from jaxrl_async import compilation_cache


@pytest.fixture
def restore_jax_cache_dir():
  before = jax.config.jax_compilation_cache_dir
  yield
  jax.config.update("jax_compilation_cache_dir", before)


def test_off_leaves_jax_alone(monkeypatch, restore_jax_cache_dir):
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.setenv(compilation_cache.ENV, "off")
  assert compilation_cache.enable() is None
  assert jax.config.jax_compilation_cache_dir is None


def test_default_is_under_the_cache_root(tmp_path, monkeypatch, restore_jax_cache_dir):
  jax.config.update("jax_compilation_cache_dir", None)
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  monkeypatch.setenv("JAXRL_ASYNC_CACHE", str(tmp_path))
  directory = compilation_cache.enable()
  assert directory == str(tmp_path / "xla") == jax.config.jax_compilation_cache_dir
  assert (tmp_path / "xla").is_dir()


def test_environment_names_the_directory(tmp_path, monkeypatch, restore_jax_cache_dir):
  monkeypatch.setenv(compilation_cache.ENV, str(tmp_path / "elsewhere"))
  assert compilation_cache.enable() == str(tmp_path / "elsewhere")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "elsewhere")


def test_a_directory_set_for_jax_is_kept(tmp_path, monkeypatch, restore_jax_cache_dir):
  monkeypatch.delenv(compilation_cache.ENV, raising=False)
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "users"))
  assert compilation_cache.enable() == str(tmp_path / "users")
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / "users")
