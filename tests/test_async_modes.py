"""End to end, async modes: a failing role stops the run with that role's error. (Each mode's
guarantees on every backend: tests/backends/test_backend_contract.py.)

Runs use the built-in task with short strings and a 20-step warm start, cached once per session.
"""

import threading

import pytest

from jaxrl_async.backends.base import RoleFailed
from jaxrl_async.config import RunConfig
from jaxrl_async.learner.sft import WarmStartConfig
from jaxrl_async.metrics import read_jsonl
from jaxrl_async.run import api
from jaxrl_async.tasks.reverse import DigitReverseTask

GROUP_SIZE = 4


def small_config(num_versions: int, **overrides) -> RunConfig:
  # precompile_updates off: a tiny run meets few of the row counts it would compile ahead
  settings = dict(task=DigitReverseTask(0, max_len=8), precompile_updates=False,
                  warm_start=WarmStartConfig(steps=20, batch_size=16), group_size=GROUP_SIZE,
                  mini_batch_size=2, max_concurrent_decodes=8, eval_size=16,
                  eval_every_versions=2, checkpoint_every_versions=2)
  settings.update(overrides)
  groups_per_version = (settings["mini_batch_size"] * settings.get("require_batches", 1)
                        * settings.get("trigger_parameter_sync_step", 1))
  return RunConfig(total_samples=num_versions * groups_per_version * GROUP_SIZE, **settings)


def quiet(*args, **kwargs):
  del args, kwargs


# ---- a failing role ------------------------------------------------------------------------
class PromptSourceFailure(RuntimeError):
  pass


class FailingPromptsTask:
  """Wraps a task; its training problems raise after `limit` of them were served (so the
  rollouter, which draws the prompts, fails mid-run). Same repr as the wrapped task, so the
  cached warm start is shared; the warm start and evaluation use the wrapped task's methods."""

  def __init__(self, inner, limit: int):
    self._inner = inner
    self.limit = limit
    self.served = 0
    self._lock = threading.Lock()

  def __getattr__(self, name):
    return getattr(self._inner, name)

  def __repr__(self):
    return repr(self._inner)

  def problem(self, index, split="train"):
    if split == "train":
      with self._lock:
        self.served += 1
        if self.served > self.limit:
          raise PromptSourceFailure(f"prompt source gave out after {self.limit} prompts")
    return self._inner.problem(index, split)


@pytest.mark.timeout(120)
def test_a_failing_rollouter_stops_the_run_with_its_error(tmp_path):
  task = FailingPromptsTask(DigitReverseTask(0, max_len=8), limit=6)
  config = small_config(50, mode="on_policy", task=task)  # far more prompts than it will get
  with pytest.raises(RoleFailed, match="rollouter") as info:
    api.run(config, str(tmp_path), progress=False, log=quiet)
  chain, error = [], info.value
  while error is not None:
    chain.append(error)
    error = error.__cause__ or error.__context__
  assert any(isinstance(e, PromptSourceFailure) for e in chain), chain
  assert task.served == task.limit + 1  # it stopped at the first failure
  records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "algo/version_gap_max" in r]
  assert len(records) < config.num_versions
