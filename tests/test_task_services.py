"""run/services.py: a task's services start before the run builds anything, the run gets the
task they yield, and they stop when the run ends, also when it fails."""

import contextlib
import dataclasses

import pytest

from jaxrl_async.config import RunConfig
from jaxrl_async.run.services import task_services
from jaxrl_async.tasks.reverse import DigitReverseTask


class ServedTask(DigitReverseTask):
  def __init__(self, events, address=None):
    super().__init__(0, max_len=8)
    self.events, self.address = events, address

  @contextlib.contextmanager
  def services(self, log=print):
    self.events.append("start")
    try:
      yield ServedTask(self.events, address="127.0.0.1:1234")
    finally:
      self.events.append("stop")


def test_the_run_gets_the_task_its_services_yield_and_they_stop_after_it():
  events = []
  config = RunConfig(task=ServedTask(events))
  with task_services(config) as served:
    assert events == ["start"]
    assert served.task.address == "127.0.0.1:1234"
    assert dataclasses.replace(served, task=config.task) == config
  assert events == ["start", "stop"]


def test_services_stop_when_the_run_fails():
  events = []
  with pytest.raises(RuntimeError, match="boom"), task_services(RunConfig(task=ServedTask(events))):
    raise RuntimeError("boom")
  assert events == ["start", "stop"]


def test_a_task_without_services_runs_as_it_is():
  config = RunConfig(task=DigitReverseTask(0, max_len=8))
  with task_services(config) as same:
    assert same is config
