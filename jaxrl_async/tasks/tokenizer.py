"""A fixed character vocabulary for the built-in arithmetic-style tasks.

Ids never change (checkpoints and tests rely on them):

  0 <pad>   1 <bos>   2 <eos>   3 <unk>   4 '='   5..14 '0'..'9'   15 reserved (no symbol)

`vocab_size` is 16 so that embedding tables have a round size; id 15 decodes as "<15>".
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
EQUALS_ID = 4
DIGIT_IDS = tuple(range(5, 15))  # '0'..'9'
VOCAB_SIZE = 16

_SPECIAL_SYMBOLS = {PAD_ID: "<pad>", BOS_ID: "<bos>", EOS_ID: "<eos>", UNK_ID: "<unk>"}
_CHAR_TO_ID = {"=": EQUALS_ID, **{str(d): DIGIT_IDS[d] for d in range(10)}}
_ID_TO_CHAR = {i: c for c, i in _CHAR_TO_ID.items()}


class CharTokenizer:
  """One id per character of `=0123456789`, plus <pad>, <bos>, <eos> and <unk>.

  Stateless and immutable, so one instance may be shared by threads.
  """

  pad_id = PAD_ID
  bos_id = BOS_ID
  eos_id = EOS_ID
  unk_id = UNK_ID
  equals_id = EQUALS_ID
  digit_ids = DIGIT_IDS

  @property
  def vocab_size(self) -> int:
    return VOCAB_SIZE

  def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False,
             on_unknown: str = "raise") -> np.ndarray:
    """Returns int32 ids [len(text) (+1 per added special)].

    on_unknown: 'raise' (default) raises ValueError naming the first character outside the
    vocabulary and its position; 'unk' maps every such character to <unk>.
    """
    if on_unknown not in ("raise", "unk"):
      raise ValueError(f"on_unknown must be 'raise' or 'unk', got {on_unknown!r}")
    ids = [BOS_ID] if add_bos else []
    for position, char in enumerate(text):
      token = _CHAR_TO_ID.get(char)
      if token is None:
        if on_unknown == "raise":
          raise ValueError(
              f"character {char!r} at position {position} of {text!r} is not in the "
              f"vocabulary (allowed: '=' and digits 0-9)")
        token = UNK_ID
      ids.append(token)
    if add_eos:
      ids.append(EOS_ID)
    return np.asarray(ids, np.int32)

  def decode(self, ids: Iterable[int] | np.ndarray, *, stop_at_eos: bool = False,
             skip_special: bool = False) -> str:
    """Maps ids back to text.

    stop_at_eos: drop the first <eos> and everything after it.
    skip_special: drop <pad>, <bos>, <eos> and <unk> instead of writing their names.
    An id with no symbol (15, or out of range) is written as "<id>" so that nothing is lost.
    """
    pieces = []
    for token in np.asarray(ids).reshape(-1).tolist():
      if stop_at_eos and token == EOS_ID:
        break
      if token in _ID_TO_CHAR:
        pieces.append(_ID_TO_CHAR[token])
      elif token in _SPECIAL_SYMBOLS:
        if not skip_special:
          pieces.append(_SPECIAL_SYMBOLS[token])
      else:
        pieces.append(f"<{token}>")
    return "".join(pieces)

  def digits_to_ids(self, digits: Iterable[int]) -> np.ndarray:
    """Digit values 0-9 -> int32 token ids."""
    values = np.asarray(list(digits), np.int64)
    if values.size and (values.min() < 0 or values.max() > 9):
      raise ValueError(f"digits must be in [0, 9], got {values.tolist()}")
    return (values + DIGIT_IDS[0]).astype(np.int32)

  def __repr__(self) -> str:
    return "CharTokenizer()"
