"""Field type checks for the frozen config dataclasses (no jaxrl_async imports: every config
module may import this one without an import cycle).

Each config's __post_init__ calls `check_field_types(self)` first, so a gin binding of the wrong
type fails naming the class, the field, the value and the expected type, before a range check
can raise an unnamed TypeError ("'>' not supported between instances of 'str' and 'int'").
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any


def check_field_types(config) -> None:
  """Each field's value has its annotated type, else TypeError naming class, field, value and
  the expected type(s). An int is accepted where a float is expected (gin users write 1 for
  1.0); a bool is not an int (nor a float); an Optional field accepts None; a tuple field
  accepts a list; fields typed Any (or with a hint that names no class) are not checked."""
  cls = type(config)
  for name, allowed in _field_types(cls):
    value = getattr(config, name)
    if isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed):
      continue
    raise TypeError(f"{cls.__name__}.{name}={value!r} must be {_describe(allowed)} "
                    f"(got {type(value).__name__})")


@functools.cache
def _field_types(cls) -> tuple[tuple[str, tuple[type, ...]], ...]:
  """(field name, allowed isinstance() types) for each checked field of a dataclass."""
  hints = typing.get_type_hints(cls)
  checked = []
  for field in dataclasses.fields(cls):
    allowed = _allowed_types(hints[field.name])
    if allowed is not None:
      checked.append((field.name, allowed))
  return tuple(checked)


def _allowed_types(hint) -> tuple[type, ...] | None:
  """The isinstance() types a hint allows (None: not checked). float admits ints."""
  if hint is Any:
    return None
  if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
    parts = [_allowed_types(arg) for arg in typing.get_args(hint)]
    if any(part is None for part in parts):
      return None
    return tuple(dict.fromkeys(t for part in parts for t in part))  # in order, no repeats
  origin = typing.get_origin(hint)
  if origin in (tuple, list):
    return (tuple, list)
  if origin is not None:
    return (origin,) if isinstance(origin, type) else None
  if hint is float:
    return (float, int)
  if hint is None or hint is type(None):
    return (type(None),)
  return (hint,) if isinstance(hint, type) else None


def _describe(allowed: tuple[type, ...]) -> str:
  """'a float', 'an int or None', 'a tuple or list' (a float's int is not named)."""
  if float in allowed:
    allowed = tuple(t for t in allowed if t is not int)
  names = []
  for t in allowed:
    if t is type(None):
      names.append("None")
    else:
      article = "an" if t.__name__[:1].lower() in "aeiou" else "a"
      names.append(f"{article} {t.__name__}")
  return " or ".join(names)
