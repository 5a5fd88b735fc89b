"""Argument checks shared by the public API: one rule for integers everywhere.

An integer argument accepts any ``numbers.Integral`` (so ``numpy.int64(3)`` works like ``3``)
but never a ``bool`` (``True`` is an int to Python, never a count to a caller).
A file another library reads whole gets its size checked first (``check_file_size``).
"""
from __future__ import annotations

import numbers
import os
from typing import Optional

__all__ = ["check_file_size", "check_int", "is_positive_int", "positive_int"]


def check_file_size(path: str, cap: int, what: str, error=ValueError) -> None:
    """``error`` (a ValueError by default) naming ``path``, its size and ``cap`` when the file holds
    more than ``cap`` bytes: a stat, before a parser (json, the tokenizers library) reads it whole.
    ``what``: the file's kind and why the cap is what it is, for the message."""
    size = os.path.getsize(path)
    if size > cap:
        raise error(f"{path}: {size:,} bytes, more than the {cap:,}-byte cap on {what}; not read")


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


def is_positive_int(value) -> bool:
    """Whether ``value`` is an integer >= 1 under the rule above (numpy ints yes, bools no)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and value >= 1


def positive_int(name: str, value, allow_none: bool = False) -> Optional[int]:
    """``int(value)`` for a count argument (a batch size, a pool size, a token budget): an integer
    >= 1 by the rule above, or None when ``allow_none``. ValueError otherwise — for a bool or a
    float as for 0 — naming ``name`` and the value, as the API's count arguments always did."""
    if value is None and allow_none:
        return None
    if not is_positive_int(value):
        raise ValueError(f"{name} must be a positive int{' or None' if allow_none else ''}, got {value!r}")
    return int(value)
