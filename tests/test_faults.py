"""The fault injector: plans parse strictly, and each action fires at its planned hit only."""

import errno
import threading
import time

import pytest

from jaxrl_async import faults


@pytest.fixture(autouse=True)
def no_plan_after():
  yield
  faults.configure(None)
  faults.hanging.clear()


@pytest.mark.parametrize("spec, needle", [
    ("nowhere=kill", "POINT"),
    ("reward.call", "POINT=ACTION"),
    ("reward.call=explode", "action 'explode'"),
    ("reward.call=kill@0", "HIT must be an int >= 1"),
    ("reward.call=kill@x", "HIT must be an int >= 1"),
    ("reward.call=delay", "delay needs seconds"),
    ("reward.call=raise:ENOTANERRNO", "not an errno name"),
])
def test_a_bad_plan_names_the_entry(spec, needle):
  with pytest.raises(ValueError, match=needle):
    faults.configure(spec)


def test_raise_fires_at_the_planned_hit_only():
  faults.configure("buffer.get_groups=raise@3")
  faults.point("buffer.get_groups")
  faults.point("buffer.get_groups")
  faults.point("reward.call")  # other points are not counted against this one
  with pytest.raises(faults.FaultInjected, match=r"buffer.get_groups \(hit 3\)"):
    faults.point("buffer.get_groups")
  faults.point("buffer.get_groups")  # once only


def test_raise_with_an_errno_is_an_oserror():
  faults.configure("checkpoint.before_write=raise:ENOSPC")
  with pytest.raises(OSError) as caught:
    faults.point("checkpoint.before_write")
  assert caught.value.errno == errno.ENOSPC


def test_delay_sleeps_then_goes_on():
  faults.configure("sync.publish=delay:0.2@1")
  began = time.monotonic()
  faults.point("sync.publish")
  assert time.monotonic() - began >= 0.2


def test_hang_blocks_the_thread_and_is_visible():
  faults.configure("rollout.decode_step=hang")
  thread = threading.Thread(target=faults.point, args=("rollout.decode_step",), daemon=True)
  thread.start()
  thread.join(0.5)
  assert thread.is_alive()
  assert faults.hanging == {"rollout.decode_step"}


def test_no_plan_is_a_no_op():
  faults.configure(None)
  for name in faults.POINTS:
    faults.point(name)
