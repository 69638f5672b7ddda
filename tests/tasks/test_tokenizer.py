import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxrl_async.tasks.tokenizer import CharTokenizer


def test_ids_are_fixed():
  tok = CharTokenizer()
  assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.equals_id) == (0, 1, 2, 3, 4)
  assert tok.encode("0123456789").tolist() == list(range(5, 15))
  assert tok.vocab_size == 16


def test_encode_dtype_and_specials():
  ids = CharTokenizer().encode("12=", add_bos=True, add_eos=True)
  assert ids.dtype == np.int32
  assert ids.tolist() == [1, 6, 7, 4, 2]


@given(st.text(alphabet="0123456789=", max_size=40))
def test_round_trip(text):
  tok = CharTokenizer()
  assert tok.decode(tok.encode(text)) == text
  assert tok.decode(tok.encode(text, add_bos=True, add_eos=True), skip_special=True) == text


def test_unknown_character_error_names_it():
  with pytest.raises(ValueError, match=r"'x' at position 2"):
    CharTokenizer().encode("12x4")


def test_unknown_character_maps_to_unk_on_request():
  assert CharTokenizer().encode("1a", on_unknown="unk").tolist() == [6, 3]


def test_decode_stops_at_eos_and_names_specials():
  tok = CharTokenizer()
  ids = [1, 6, 7, 4, 8, 2, 9, 0]
  assert tok.decode(ids) == "<bos>12=3<eos>4<pad>"
  assert tok.decode(ids, stop_at_eos=True) == "<bos>12=3"
  assert tok.decode(ids, stop_at_eos=True, skip_special=True) == "12=3"
  assert tok.decode(np.array([[15, 3]])) == "<15><unk>"


def test_digits_to_ids():
  tok = CharTokenizer()
  assert tok.digits_to_ids([0, 9, 4]).tolist() == tok.encode("094").tolist()
  with pytest.raises(ValueError, match="digits"):
    tok.digits_to_ids([10])
