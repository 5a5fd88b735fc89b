"""Argument checks shared by the public API: one rule for integers everywhere.

An integer argument accepts any ``numbers.Integral`` (so ``numpy.int64(3)`` works like ``3``)
but never a ``bool`` (``True`` is an int to Python, never a count to a caller).
A file another library reads whole gets its size checked first (``check_file_size``). A duration
(a timeout, a health bound) is checked by one rule too (``check_seconds``).
"""
from __future__ import annotations

import math
import numbers
import operator
import os
import sys
from collections.abc import Mapping, Set
from typing import Iterable, List, Optional

__all__ = ["check_file_size", "check_int", "check_seconds", "check_token_ids", "is_bool", "is_positive_int",
           "positive_int"]


def is_bool(value) -> bool:
    """Whether ``value`` is a bool: Python's, or numpy's (``np.True_``: a flag read from a numpy or
    pandas table). numpy's type is named "bool_" before NumPy 2 and "bool" from it, so it is tested by
    isinstance; numpy is not imported for it: a numpy bool exists only once numpy is."""
    if isinstance(value, bool):
        return True
    np = sys.modules.get("numpy")
    return np is not None and isinstance(value, np.bool_)


def check_seconds(name: str, value, *, zero: bool = False, inf: bool = True, none: bool = False) -> Optional[float]:
    """``value`` as a duration in seconds, a float: an int or a float (never a bool or a str),
    > 0 (>= 0 when ``zero``), finite unless ``inf`` (where inf means no limit), never NaN (it
    compares false with every bound: a timer that never fires, a probe that never fails); None
    passes when ``none``. An int too large for a float is inf (refused when ``inf`` is False).
    ValueError naming ``name`` (a field, or the ``--flag`` it comes from) and the value."""
    if value is None and none:
        return None
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int past 1.8e308: no float holds it, no timer could use it
            seconds = math.inf
    if not ((seconds >= 0 if zero else seconds > 0) and (inf or math.isfinite(seconds))):
        raise ValueError(f"{name} must be a {'' if inf else 'finite '}number {'>= 0' if zero else '> 0'} "
                         f"(seconds{'; inf: no limit' if inf else ''}){' or None' if none else ''}, got {value!r}")
    return seconds


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


def check_token_ids(what: str, ids) -> List[int]:
    """``ids`` (a sequence or iterable of ids, a 1-D tensor or numpy array) as a list of ints, by the
    rule above: int, numpy or 0-d tensor integers, never a float or a bool (int() would truncate 1.7
    to 1 and read True as id 1), nor a str / bytes (its items are characters / ints: b"ok" would be
    ids 111, 107), nor a set or a mapping (no order: {3, 1, 2} was read as [1, 2, 3], a dict as its
    keys — another sequence, scored with no error). TypeError naming ``what``; the vocabulary range
    is the caller's to check."""
    if isinstance(ids, (str, bytes, bytearray)) or not isinstance(ids, Iterable):
        raise TypeError(f"{what}: expected token ids, got a {type(ids).__name__}")
    if isinstance(ids, (Set, Mapping)):
        raise TypeError(f"{what}: token ids are a sequence in order (a list, tuple, 1-D tensor or array), got a "
                        f"{type(ids).__name__}, which has no order")
    if hasattr(ids, "tolist"):  # a tensor / numpy array: Python numbers (a float or bool one stays so)
        listed = ids.tolist()
        if not isinstance(listed, list):  # a 0-d one is one number: "'int' object is not iterable" below
            raise TypeError(f"{what}: expected token ids, got a 0-d {type(ids).__name__} ({ids!r})")
        ids = listed
    elif not isinstance(ids, list):
        ids = list(ids)  # read once: a generator's items, then checked below
    if all(type(t) is int for t in ids):  # the common case, a tokenizer's list: 2.4x faster than the loop below
        return list(ids)
    out = []
    for t in ids:
        v = t.tolist() if hasattr(t, "tolist") else t  # a 0-d tensor / numpy scalar: its Python value
        try:
            if isinstance(v, bool):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(f"{what}: token ids must be integers, got {t!r} ({type(t).__name__})") from None
    return out


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
