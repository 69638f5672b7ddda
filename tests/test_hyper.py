"""launch.hyper: the sweep vocabulary on hand-made values (order, merging, errors)."""

import itertools

import pytest

from launch import hyper


def test_sweep_and_fixed():
  assert hyper.sweep("a", [1, 2]) == [{"a": 1}, {"a": 2}]
  assert hyper.sweep("a", (x for x in "xy")) == [{"a": "x"}, {"a": "y"}]
  assert hyper.fixed("b", None) == [{"b": None}]
  assert hyper.sweep("a", []) == []


def test_product_varies_the_last_sweep_fastest():
  trials = hyper.product([hyper.sweep("a", [1, 2]), hyper.sweep("b", ["x", "y", "z"])])
  assert trials == [{"a": a, "b": b} for a, b in itertools.product([1, 2], "xyz")]
  assert hyper.product([hyper.sweep("a", [1, 2]), hyper.sweep("b", [])]) == []
  assert hyper.product([hyper.sweep("a", [1])]) == [{"a": 1}]


def test_zipit_pairs_element_by_element():
  trials = hyper.zipit([hyper.sweep("a", [1, 2, 3]), hyper.sweep("b", [4, 5, 6])])
  assert trials == [{"a": 1, "b": 4}, {"a": 2, "b": 5}, {"a": 3, "b": 6}]


def test_chainit_concatenates():
  trials = hyper.chainit([hyper.sweep("a", [1]), hyper.product([hyper.sweep("b", [2, 3])])])
  assert trials == [{"a": 1}, {"b": 2}, {"b": 3}]


def test_nested_combinations():
  trials = hyper.product([
      hyper.sweep("s", [0.5, 1.0]),
      hyper.zipit([hyper.sweep("t", [1, 2]), hyper.sweep("m", [8, 4])]),
      hyper.fixed("seed", 0),
  ])
  assert trials == [{"s": s, "t": t, "m": m, "seed": 0}
                    for s in (0.5, 1.0) for t, m in ((1, 8), (2, 4))]
  trials[0]["s"] = 9  # plain dicts, fresh each time
  assert hyper.product([hyper.sweep("s", [0.5])]) == [{"s": 0.5}]


def test_errors_name_the_problem():
  with pytest.raises(ValueError, match="lengths"):
    hyper.zipit([hyper.sweep("a", [1, 2]), hyper.sweep("b", [1])])
  with pytest.raises(ValueError, match="swept twice"):
    hyper.product([hyper.sweep("a", [1]), hyper.sweep("a", [2])])
  with pytest.raises(ValueError, match="list of values"):
    hyper.sweep("a", "abc")
  with pytest.raises(ValueError, match="not a sweep"):
    hyper.product([[1, 2]])
  with pytest.raises(ValueError, match="non-empty"):
    hyper.sweep("", [1])
