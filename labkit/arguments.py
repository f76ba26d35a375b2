"""Argument checks every layer shares (standard library only): an error a
student can read, naming the argument, what it must be and what it got."""

from __future__ import annotations

import math
import numbers
import operator


class ArgumentError(ValueError, TypeError):
    """A wrong argument, wrong in kind (2.0 where a count goes) or in value
    (0 ranks): either `except` catches it."""


def whole(value, name: str, low: int = 1, high: int | None = None) -> int:
    """`value` as an int if it is a whole number in [low, high] (a Python,
    NumPy or 0-d torch integer; a bool or a float is not one), else an
    ArgumentError naming `name`."""
    try:
        n = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        n = None
    if n is None or n < low or (high is not None and n > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        got = (f"an integer of {n.bit_length()} bits" if n is not None
               and abs(n) > 10 ** 30 else repr(value))
        raise ArgumentError(f"{name} must be an integer {span}, got {got}")
    return n


def real(value, name: str, *, zero: bool = False) -> float:
    """`value` as a float if it is a finite real number > 0 (>= 0 with
    zero=True); a bool, NaN or inf is not one: else an ArgumentError naming
    `name`."""
    ok = (not isinstance(value, bool) and isinstance(value, numbers.Real)
          and math.isfinite(value) and (value > 0 or (zero and value == 0)))
    if not ok:
        span = ">= 0" if zero else "> 0"
        raise ArgumentError(f"{name} must be a finite number {span}, got {value!r}")
    return float(value)
