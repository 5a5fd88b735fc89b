"""Argument checks shared by the public API: one rule for integers everywhere.

An integer argument accepts any ``numbers.Integral`` (so ``numpy.int64(3)`` works like ``3``)
but never a ``bool`` (``True`` is an int to Python, never a count to a caller).
"""
from __future__ import annotations

import numbers
from typing import Optional


def check_int(name: str, value, minimum: Optional[int] = None, allow_none: bool = False) -> Optional[int]:
    """``int(value)``; TypeError for a non-integer (bools included), ValueError below ``minimum``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {value!r} "
                        f"({type(value).__name__})")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
