"""Supervised warm start: a short cross-entropy run that makes the base policy RL starts from.

RL on a verifiable task needs a base policy that is right some of the time (here 10% to 60% on
the held-out set), or every GRPO group has equal rewards and no signal. `warm_start` trains one on
the task's reference answers; `cached_base_policy` makes it once per (task, model, recipe) and keeps
it in an orbax checkpoint under a cache directory. Processes that need the same one at once (a
sweep's trials, a fleet started together) take turns on a lock file beside it: one trains, the
others wait and load its copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pathlib
import sys
import time

try:
  import fcntl
except ImportError:  # not a POSIX system: no lock, concurrent runs may each train a copy
  fcntl = None

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp

from jaxrl_async.config_types import check_field_types
from jaxrl_async.learner.step import TrainState, init_train_state, state_shardings
from jaxrl_async.model import ModelConfig, apply, init_model, param_logical_axes, split_model


@dataclasses.dataclass(frozen=True)
class WarmStartConfig:
  steps: int = 1200
  batch_size: int = 64
  learning_rate: float = 1e-2
  seed: int = 0

  def __post_init__(self):
    check_field_types(self)
    if self.steps < 0:
      raise ValueError(f"warm start steps must be >= 0, got {self.steps}")
    if self.batch_size < 1:
      raise ValueError(f"warm start batch_size must be >= 1, got {self.batch_size}")
    if not self.learning_rate > 0:
      raise ValueError(f"warm start learning_rate must be > 0, got {self.learning_rate}")


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array):
  """Mean over masked tokens of -log softmax(logits)[target]. logits [B,T,V]; targets, mask [B,T]."""
  assert logits.ndim == 3 and targets.shape == mask.shape == logits.shape[:2]
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)),
                             targets[..., None], axis=-1)[..., 0]
  return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def make_sft_step(graphdef, state_sh):
  def step(state: TrainState, tokens, loss_mask):
    def loss(params):
      logits, _ = apply(graphdef, params, tokens[:, :-1])
      return cross_entropy(logits, tokens[:, 1:], loss_mask[:, 1:])

    value, grads = jax.value_and_grad(loss)(state.params)
    updates, opt_state = state.tx.update(grads, state.opt_state, state.params)
    return TrainState(state.step + 1, optax.apply_updates(state.params, updates), opt_state,
                      state.tx), value

  return jax.jit(step, donate_argnums=(0,), out_shardings=(state_sh, None))


def warm_start(task, model_config: ModelConfig, config: WarmStartConfig, mesh, *,
               log_every: int = 50, log=print, initial_params=None):
  """Train a base policy on the task's reference answers; returns params. It starts from a
  random init, or from `initial_params` (e.g. a Hugging Face checkpoint's, of `model_config`'s
  structure)."""
  if initial_params is None:
    model = init_model(model_config, config.seed)
    graphdef, params = split_model(model)
  else:  # the structure only: no random weights made beside the given ones
    model = jax.eval_shape(lambda: init_model(model_config, config.seed))
    graphdef, abstract = split_model(model)
    if jax.tree.structure(initial_params) != jax.tree.structure(abstract):
      raise ValueError("warm_start: initial_params do not have the structure of model_config's "
                       "params")
    params = initial_params
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, config.learning_rate, 10,
                                                      max(config.steps, 11)))
  state = init_train_state(params, tx, mesh, param_logical_axes(model))
  step_fn = make_sft_step(graphdef, state_shardings(state))
  rng = np.random.default_rng(config.seed)
  seq_len = model_config.max_seq_len
  for i in range(config.steps):
    tokens, loss_mask = task.sft_batch(rng, config.batch_size, seq_len)
    state, loss = step_fn(state, tokens, loss_mask)
    if log_every and (i + 1) % log_every == 0:
      log(f"warm start step {i + 1}/{config.steps}: loss {float(loss):.4f}")
  return jax.device_get(state.params)


def _cache_key(task, model_config: ModelConfig, config: WarmStartConfig) -> str:
  text = json.dumps({"task": repr(task), "model": dataclasses.asdict(model_config),
                     "warm_start": dataclasses.asdict(config), "format": 1}, sort_keys=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def default_cache_dir() -> pathlib.Path:
  root = os.environ.get("JAXRL_ASYNC_CACHE") or os.path.join(
      os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "jaxrl_async")
  return pathlib.Path(root)


def cache_entry(task, model_config: ModelConfig, config: WarmStartConfig,
                cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """The cache directory of the base policy for (task, model, recipe): `<cache>/base/<key>`."""
  return pathlib.Path(cache_dir or default_cache_dir()) / "base" / _cache_key(
      task, model_config, config)


LOCK_TIMEOUT_S = 3600.0  # a warm start that holds the lock longer is taken to be stuck


@contextlib.contextmanager
def _exclusive(lock_path: pathlib.Path, log=print, timeout_s: float = LOCK_TIMEOUT_S):
  """Holds an exclusive lock on `lock_path` (released by the OS if its holder dies, so a waiter
  never waits on a process that is gone); TimeoutError after `timeout_s` of waiting."""
  if fcntl is None:
    yield
    return
  lock_path.parent.mkdir(parents=True, exist_ok=True)
  with open(lock_path, "a+", encoding="utf-8") as f:
    deadline, waiting = time.monotonic() + timeout_s, False
    while True:
      try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        if time.monotonic() >= deadline:
          raise TimeoutError(f"base policy: {lock_path} still held by another process after "
                             f"{timeout_s:.0f} s; remove the cache entry if no run is making "
                             "it") from None
        if not waiting:
          log(f"base policy: another process is making it; waiting for {lock_path.parent}")
          waiting = True
        time.sleep(0.5)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def cached_base_policy(task, model_config: ModelConfig, config: WarmStartConfig, mesh, *,
                       cache_dir: str | os.PathLike | None = None, log=print,
                       checkpointer=None):
  """Load the base policy for (task, model, recipe) from the cache, or train and cache it (one
  process at a time per cache entry: the others wait for its copy). `checkpointer`: the orbax
  checkpointer that reads and writes the cache (default: a StandardCheckpointer)."""
  directory = cache_entry(task, model_config, config, cache_dir)
  graphdef, abstract = split_model(jax.eval_shape(lambda: init_model(model_config)))
  del graphdef
  checkpointer = ocp.StandardCheckpointer() if checkpointer is None else checkpointer
  if not (directory / "params").exists():
    with _exclusive(directory.parent / f"{directory.name}.lock", log):
      if not (directory / "params").exists():  # not made while this process waited
        log(f"base policy: warm start ({config.steps} supervised steps), caching in "
            f"{directory}")
        params = warm_start(task, model_config, config, mesh, log=log)
        directory.mkdir(parents=True, exist_ok=True)
        tmp = directory / f"params.tmp{os.getpid()}"
        checkpointer.save(tmp.absolute(), params)
        checkpointer.wait_until_finished()
        try:
          os.replace(tmp, directory / "params")  # atomic: a reader sees all or nothing
        except OSError as error:  # another process finished first; use its copy
          print(f"base policy: keeping the existing cache ({error})", file=sys.stderr)
        return checkpointer.restore((directory / "params").absolute(), abstract)
  log(f"base policy: loading {directory}")
  return checkpointer.restore((directory / "params").absolute(), abstract)
