"""Argument checks shared by the loss functions: clear errors at trace time, free at run time."""

from __future__ import annotations

import numbers

import jax


def check_choice(name: str, value, allowed: tuple[str, ...]) -> None:
  if value not in allowed:
    raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_number(name: str, value, low: float, low_inclusive: bool = True) -> None:
  # Traced values (e.g. a scheduled clip range) cannot be checked at trace time.
  if isinstance(value, numbers.Real) and not (value >= low if low_inclusive else value > low):
    bound = ">=" if low_inclusive else ">"
    raise ValueError(f"{name} must be {bound} {low}, got {value!r}")


def is_zero(coef) -> bool:
  return isinstance(coef, numbers.Real) and coef == 0.0


def check_tokens(mask: jax.Array, **arrays: jax.Array) -> None:
  assert mask.ndim == 2, f"mask must be [B, T], got shape {mask.shape}"
  for name, array in arrays.items():
    assert array.shape == mask.shape, f"{name} must be [B, T] = {mask.shape}, got {array.shape}"
