"""verl's staleness_threshold and require_batches ablations: the shape of a speed curve, and the
simulator's 128-GPU prediction (one profile, no refitting) has the published shape."""

import pytest

from jaxrl_async.sim import ablations


def test_shape_finds_where_the_gain_stops():
  """Steps +50%, +20%, -3%: the plateau starts at 0.3 (the last step is under 5%)."""
  out = ablations.shape({0.0: 1.0, 0.1: 1.5, 0.3: 1.8, 0.5: 1.746})
  assert out["steps"] == pytest.approx([0.5, 0.2, -0.03])
  assert out["saturates_at"] == 0.3 and out["rising"]


def test_shape_without_a_plateau_and_with_a_loss_before_it():
  assert ablations.shape({1: 1.0, 2: 1.3, 4: 1.6})["saturates_at"] is None
  falling = ablations.shape({1: 1.0, 2: 0.8, 4: 0.81})  # -20%, then +1.25%: plateau at 2
  assert falling["saturates_at"] == 2 and not falling["rising"]
  flat = ablations.shape({1: 1.0, 2: 1.01, 4: 1.02})  # every step under 5%: flat from 1
  assert flat["saturates_at"] == 1 and flat["rising"]
  with pytest.raises(ValueError, match="two or more positive speeds"):
    ablations.shape({1: 1.0})


def test_same_shape_needs_the_same_saturation_point_and_a_rise_to_it():
  rise_to_03 = ablations.shape({0.0: 1.0, 0.1: 1.3, 0.3: 1.6, 0.5: 1.62})
  rise_to_01 = ablations.shape({0.0: 1.0, 0.1: 1.6, 0.3: 1.62, 0.5: 1.63})
  assert ablations.same_shape(rise_to_03, rise_to_03)
  assert not ablations.same_shape(rise_to_03, rise_to_01)


def test_the_published_ablations_read_from_the_profile_file():
  speeds = ablations.published_speeds()
  assert speeds["staleness_threshold"][0.3] == pytest.approx(1 / 146.11)
  assert speeds["require_batches"][1] == pytest.approx(1 / 1056)
  assert ablations.shape(speeds["staleness_threshold"])["saturates_at"] == 0.3
  assert ablations.shape(speeds["require_batches"])["saturates_at"] is None


def test_the_verl_profile_predicts_both_ablations_in_the_published_shape():
  """Fails if the simulator's staleness curve stops rising before 0.3 or keeps rising past it,
  or if its require_batches curve stops rising within 1, 2, 4 (the published shapes)."""
  result = ablations.compare(num_versions=12)
  for knob in ("staleness_threshold", "require_batches"):
    assert result[knob]["same_shape"], (knob, result[knob])
