"""Delta records: hand-computed records, bit-exact round trips (NaN, -0.0, bf16, ints), the
sparse/dense choice, and checks that catch a wrong base or a corrupted value."""

import ml_dtypes
import numpy as np
import pytest

from jaxrl_async.sync import delta

BF16 = np.dtype(ml_dtypes.bfloat16)


def test_a_single_change_is_one_position_and_its_new_bits():
  previous = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
  current = np.array([1.0, 5.0, 3.0, 4.0], np.float32)
  (record,) = delta.encode([previous], [current])
  assert record.encoding == delta.SPARSE and record.changed == 1
  assert record.positions.tolist() == [1] and record.positions.dtype == np.uint32
  assert record.values.tolist() == [np.float32(5.0).view(np.uint32)]
  assert record.nbytes == 4 + 4


def test_no_change_no_record_and_most_changed_goes_dense():
  leaf = np.arange(10, dtype=np.float32)
  assert delta.encode([leaf], [leaf.copy()]) == []
  moved = leaf.copy()
  moved[:6] += 1  # 6 x (4 + 4) sparse bytes >= 40 dense bytes
  (record,) = delta.encode([leaf], [moved])
  assert record.encoding == delta.DENSE and record.changed == 6 and record.positions is None
  few = leaf.copy()
  few[3] = 7
  (record,) = delta.encode([leaf], [few])
  assert record.encoding == delta.SPARSE


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16, np.int32, np.uint8])
def test_apply_reproduces_the_new_version_bit_for_bit(dtype):
  rng = np.random.default_rng(0)
  for density in (0.0, 0.01, 0.3, 1.0):
    previous = [rng.standard_normal((7, 33)).astype(dtype), rng.standard_normal(5).astype(dtype)]
    current = [leaf.copy() for leaf in previous]
    for leaf in current:
      mask = rng.random(leaf.shape) < density
      leaf[mask] = (rng.standard_normal(int(mask.sum())) * 3).astype(dtype)
    records = delta.encode(previous, current)
    held = [leaf.copy() for leaf in previous]
    delta.apply(held, records, [delta.leaf_crc(leaf) for leaf in current])
    for got, want in zip(held, current):
      assert np.array_equal(delta.bits(got), delta.bits(want))


def test_nan_payloads_and_signed_zeros_count_as_changes():
  previous = np.array([0.0, np.nan, 1.0], np.float32)
  current = previous.copy()
  current[0] = -0.0  # == 0.0 as a float, another bit pattern
  current.view(np.uint32)[1] ^= 1  # another NaN
  (record,) = delta.encode([previous], [current])
  assert record.changed == 2
  held = previous.copy()
  delta.apply([held], [record], [delta.leaf_crc(current)])
  assert np.array_equal(held.view(np.uint32), current.view(np.uint32))


def test_a_corrupted_value_or_a_wrong_base_fails_the_leaf_checksum():
  previous = np.linspace(0, 1, 64, dtype=np.float32).astype(BF16)
  current = previous.copy()
  current[[3, 40]] = BF16.type(9.0)
  (record,) = delta.encode([previous], [current])
  crcs = [delta.leaf_crc(current)]
  record.values[0] ^= 1  # one flipped bit on the wire
  with pytest.raises(delta.DeltaMismatch, match="leaf 0: CRC-32"):
    delta.apply([previous.copy()], [record], crcs)
  record.values[0] ^= 1
  other_base = previous.copy()
  other_base[10] = BF16.type(-1.0)
  with pytest.raises(delta.DeltaMismatch, match="leaf 0"):
    delta.apply([other_base], [record], crcs)


def test_records_that_do_not_fit_their_leaf_are_refused():
  leaf = np.zeros(4, np.float32)
  bad = delta.LeafDelta(0, delta.SPARSE, 1, np.zeros(1, np.uint32), np.array([9], np.uint32))
  with pytest.raises(delta.DeltaMismatch, match="position 9 is out of its 4 elements"):
    delta.apply_leaf(leaf, bad)
  wrong_width = delta.LeafDelta(0, delta.DENSE, 4, np.zeros(4, np.uint16))
  with pytest.raises(delta.DeltaMismatch, match="values of uint16"):
    delta.apply_leaf(leaf, wrong_width)
  with pytest.raises(delta.DeltaMismatch, match="differ in shape"):
    delta.encode([leaf], [np.zeros(5, np.float32)])


def test_cast_rounds_floats_only_and_the_digest_names_content():
  leaves = [np.array([1.00390625, 2.0], np.float32), np.array([3, 4], np.int32)]
  cast = delta.cast_leaves(leaves, "bfloat16")
  assert cast[0].dtype == BF16 and cast[1].dtype == np.int32
  assert cast[0].tolist() == [1.0, 2.0]  # 1 + 2**-8 rounds to even (1.0) in bfloat16
  digest = delta.version_digest([x.shape for x in cast], [x.dtype for x in cast],
                                [delta.leaf_crc(x) for x in cast])
  cast[1][0] = 5
  assert digest != delta.version_digest([x.shape for x in cast], [x.dtype for x in cast],
                                        [delta.leaf_crc(x) for x in cast])
