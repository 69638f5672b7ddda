"""benchmarks/delta_density.py: the figures of a weight store's published versions and loads."""

import pytest

from benchmarks import delta_density


def test_delta_density_summary():
  lines = [{"version": 1, "kind": "full", "bytes": 1000, "changed": -1, "elements": 500},
           {"version": 2, "kind": "delta", "bytes": 60, "changed": 10, "elements": 500},
           {"version": 3, "kind": "delta", "bytes": 30, "changed": 5, "elements": 500},
           {"version": 4, "kind": "full", "bytes": 1000, "changed": 50, "elements": 500}]
  out = delta_density.summarize(lines)
  assert out["versions_measured"] == 3 and out["versions_full"] == 2
  assert out["density_min"] == 0.01 and out["density_max"] == 0.1
  assert out["density_median"] == 0.02
  assert out["density_mean"] == pytest.approx(65 / 1500)
  assert out["delta_bytes_median"] == 45 and out["delta_over_full_median"] == 0.045
  with pytest.raises(ValueError, match="no version"):
    delta_density.summarize(lines[:1])


def test_delta_density_checks_each_load_against_its_version_digest():
  published = [{"version": 1, "digest": "a"}, {"version": 2, "digest": "b"}]
  loads = [{"version": 1, "digest": "a"}, {"version": 2, "digest": "b"},
           {"version": 2, "digest": "a"}, {"version": 3, "digest": "c"}]
  assert delta_density.check_loads(published, loads) == {"loads": 4, "loads_digest_mismatch": 2}
