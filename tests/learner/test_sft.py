"""Tests for jaxrl_async.learner.sft: cross-entropy reference, warm start learns, the cache."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async import sharding
from jaxrl_async.learner import sft
from jaxrl_async.learner.sft import WarmStartConfig, cross_entropy
from jaxrl_async.model import apply, get_config, init_model, split_model
from jaxrl_async.tasks.reverse import DigitReverseTask

TASK = DigitReverseTask(0)
MODEL_CONFIG = get_config("tiny", max_seq_len=TASK.max_sequence_len)
RECIPE = WarmStartConfig(steps=30, batch_size=16)


# ---- cross entropy ------------------------------------------------------------------------------
def _np_cross_entropy(logits, targets, mask):
  total, count = 0.0, 0.0
  for b in range(logits.shape[0]):
    for t in range(logits.shape[1]):
      if mask[b, t]:
        row = logits[b, t].astype(np.float64)
        log_z = row.max() + np.log(np.exp(row - row.max()).sum())
        total -= row[targets[b, t]] - log_z
        count += 1
  return total / max(count, 1.0)


def test_cross_entropy_matches_numpy():
  rng = np.random.default_rng(0)
  logits = rng.normal(scale=3.0, size=(3, 5, 7)).astype(np.float32)
  targets = rng.integers(0, 7, (3, 5))
  mask = (rng.random((3, 5)) < 0.6).astype(np.float32)
  mask[0, 0] = 1.0
  value = jax.jit(cross_entropy)(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  assert float(value) == pytest.approx(_np_cross_entropy(logits, targets, mask), rel=1e-5)
  # Masked positions never matter, even with extreme logits there.
  logits[mask == 0] = 1e4
  again = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
  assert float(again) == pytest.approx(float(value), rel=1e-5)


def test_cross_entropy_of_an_empty_mask_is_zero_and_bfloat16_is_upcast():
  logits = jnp.ones((2, 3, 4), jnp.bfloat16)
  targets = jnp.zeros((2, 3), jnp.int32)
  assert float(cross_entropy(logits, targets, jnp.zeros((2, 3)))) == 0.0
  uniform = cross_entropy(logits, targets, jnp.ones((2, 3)))
  assert uniform.dtype == jnp.float32
  assert float(uniform) == pytest.approx(np.log(4), rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    ({"steps": -1}, r"steps must be >= 0, got -1"),
    ({"batch_size": 0}, r"batch_size must be >= 1, got 0"),
    ({"learning_rate": 0.0}, r"learning_rate must be > 0, got 0.0"),
])
def test_warm_start_config_errors_name_the_knob(kwargs, match):
  with pytest.raises(ValueError, match=match):
    WarmStartConfig(**kwargs)


# ---- warm start and its cache ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def cached(tmp_path_factory):
  """Two cached_base_policy calls on one cache dir; warm_start is wrapped to count its runs."""
  cache_dir = tmp_path_factory.mktemp("cache")
  mesh = sharding.make_mesh(sharding.MeshShape(), jax.devices()[:1])
  runs, logs = [], []
  real_warm_start = sft.warm_start

  def counting_warm_start(*args, **kwargs):
    runs.append(1)
    return real_warm_start(*args, **dict(kwargs, log_every=10))

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(sft, "warm_start", counting_warm_start)
    first = sft.cached_base_policy(TASK, MODEL_CONFIG, RECIPE, mesh, cache_dir=cache_dir,
                                   log=logs.append)
    first_logs, logs[:] = list(logs), []
    second = sft.cached_base_policy(TASK, MODEL_CONFIG, RECIPE, mesh, cache_dir=cache_dir,
                                    log=logs.append)
  return dict(first=first, second=second, first_logs=first_logs, second_logs=list(logs),
              runs=len(runs), cache_dir=cache_dir)


def _held_out_loss(params):
  graphdef, _ = split_model(init_model(MODEL_CONFIG, 0))
  tokens, mask = TASK.sft_batch(np.random.default_rng(12345), 64, MODEL_CONFIG.max_seq_len)

  @jax.jit
  def loss(params):
    logits, _ = apply(graphdef, params, tokens[:, :-1])
    return cross_entropy(logits, tokens[:, 1:], mask[:, 1:])

  return float(loss(params))


def test_warm_start_reduces_the_loss(cached):
  _, initial = split_model(init_model(MODEL_CONFIG, RECIPE.seed))
  before, after = _held_out_loss(initial), _held_out_loss(cached["first"])
  assert after < before - 0.5, (before, after)
  logged = [float(line.rsplit("loss", 1)[1]) for line in cached["first_logs"]
            if line.startswith("warm start step")]
  assert len(logged) == 3  # steps 10, 20, 30
  assert logged[-1] < logged[0]


def test_cached_base_policy_trains_once_then_loads(cached):
  assert cached["runs"] == 1
  assert any("warm start (30 supervised steps)" in line for line in cached["first_logs"])
  assert any("loading" in line for line in cached["second_logs"])
  assert not any("warm start" in line for line in cached["second_logs"])
  first, second = cached["first"], cached["second"]
  assert jax.tree.structure(first) == jax.tree.structure(second)
  for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  entries = [e for e in (cached["cache_dir"] / "base").iterdir() if e.is_dir()]
  assert len(entries) == 1 and (entries[0] / "params").exists()
  assert (cached["cache_dir"] / "base" / f"{entries[0].name}.lock").exists()
  assert not list(entries[0].glob("params.tmp*"))  # the temporary checkpoint was renamed


def test_callers_that_start_together_train_the_base_policy_once(tmp_path, monkeypatch):
  """Two callers (threads here, processes in a sweep) on an empty cache at once: one trains, the
  other waits on the entry's lock and loads the same copy."""
  mesh = sharding.make_mesh(sharding.MeshShape(), jax.devices()[:1])
  recipe = WarmStartConfig(steps=2, batch_size=8)
  runs, logs, results = [], [], {}
  real_warm_start = sft.warm_start
  start = threading.Barrier(2)

  def slow_warm_start(*args, **kwargs):
    runs.append(1)
    params = real_warm_start(*args, **kwargs)
    time.sleep(1.0)  # still training when the other caller arrives
    return params

  def call(name):
    start.wait()
    results[name] = sft.cached_base_policy(TASK, MODEL_CONFIG, recipe, mesh,
                                           cache_dir=tmp_path, log=logs.append)

  monkeypatch.setattr(sft, "warm_start", slow_warm_start)
  threads = [threading.Thread(target=call, args=(name,)) for name in ("a", "b")]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(300)
  assert set(results) == {"a", "b"}, logs
  assert len(runs) == 1, logs
  for x, y in zip(jax.tree.leaves(results["a"]), jax.tree.leaves(results["b"])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_lock_held_past_the_timeout_is_an_error_not_a_hang(tmp_path):
  lock = tmp_path / "entry.lock"
  with (sft._exclusive(lock),
        pytest.raises(TimeoutError, match="still held by another process after 1 s"),
        sft._exclusive(lock, timeout_s=1.0)):
    pass
  with sft._exclusive(lock, timeout_s=1.0):  # free again
    pass


def test_cache_key_depends_on_task_model_and_recipe():
  key = sft._cache_key(TASK, MODEL_CONFIG, RECIPE)
  assert key == sft._cache_key(DigitReverseTask(0), MODEL_CONFIG, RECIPE)
  assert len(key) == 16
  others = [sft._cache_key(DigitReverseTask(1), MODEL_CONFIG, RECIPE),
            sft._cache_key(TASK, get_config("tiny", max_seq_len=52), RECIPE),
            sft._cache_key(TASK, MODEL_CONFIG, WarmStartConfig(steps=31, batch_size=16))]
  assert len({key, *others}) == 4


def test_default_cache_dir(monkeypatch, tmp_path):
  monkeypatch.setenv("JAXRL_ASYNC_CACHE", str(tmp_path / "explicit"))
  assert sft.default_cache_dir() == tmp_path / "explicit"
  monkeypatch.delenv("JAXRL_ASYNC_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert sft.default_cache_dir() == tmp_path / "xdg" / "jaxrl_async"
