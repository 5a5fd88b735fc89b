"""Parse a setwise reranker's output: a bracketed identifier sequence such as ``"[4] [2] [7]"``.

AdaTutoRank (2026), Eq. 2 and Eq. 6, emits the selected candidates as 1-based identifiers,
each wrapped in square brackets, separated by a single space, most useful first, at most
``max_select`` of them, no duplicates. Two readings of a raw output:

* **strict** (rewards, Eq. 6): the text must be exactly ``[i1] [i2] ... [ik]`` with
  ``1 <= k <= max_select``, every ``i`` a decimal integer without a leading zero in ``1..n``,
  and no ``i`` repeated. Surrounding whitespace is ignored (it carries no identifier and
  decoders often emit a trailing newline); anything else -- a missing space, a comma, prose,
  ``[04]``, an empty output -- makes the whole output invalid and selects nothing, so a
  reward function can map it to -1 and mask it out of distillation (Eq. 10, ``m_i = 0``).
* **lenient** (serving): keep every ``[<digits>]`` in order (spaces inside the brackets
  allowed, leading zeros read as the number), dropping identifiers that are out of range or
  already seen, and stop after ``max_select``. ``valid`` still reports whether the strict
  format held, so a server can log malformed outputs while returning the salvaged set.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import List, Optional

from .._validate import is_bool, positive_int

_STRICT_ENTRY = re.compile(r"\[([1-9][0-9]*)\]")            # one well-formed entry, no leading zero
_LENIENT_ENTRY = re.compile(r"\[\s*([0-9]+)\s*\]")            # any bracketed number


@dataclass(frozen=True)
class ParsedSelection:
    """``ids``: 1-based identifiers as emitted (ranked); ``indices``: the same, 0-based.

    ``valid``: the text followed the strict format. ``error``: why it did not (None if valid).
    """

    ids: List[int] = field(default_factory=list)
    indices: List[int] = field(default_factory=list)
    valid: bool = False
    error: Optional[str] = None


def _check_args(text, n_candidates, max_select, strict):
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    positive_int("n_candidates", n_candidates)
    positive_int("max_select", max_select, allow_none=True)
    if not is_bool(strict):
        raise TypeError(f"strict must be a bool, got {type(strict).__name__}")


def _id_value(digits: str, n: int) -> Optional[int]:
    """``int(digits)`` when it is in 1..n, else None — without converting an over-long digit string
    (Python refuses int() of more than 4,300 digits; such an id is out of range anyway)."""
    digits = digits.lstrip("0")
    if not digits or len(digits) > len(str(n)):
        return None
    i = int(digits)
    return i if i <= n else None


def _strict_error(text: str, n: int, max_select: Optional[int]) -> tuple[List[int], Optional[str]]:
    """(ids, None) when ``text`` is a strictly valid selection, else ([], reason)."""
    body = text.strip()
    if not body:
        return [], "empty output: at least one identifier is required"
    ids: List[int] = []
    seen = set()   # O(1) repeat check: the parse is linear in the output length
    pos = 0
    while True:
        m = _STRICT_ENTRY.match(body, pos)
        if m is None:
            return [], f"expected '[<id>]' (id without leading zero) at character {pos}: {body[pos:pos + 20]!r}"
        i = _id_value(m.group(1), n)
        if i is None:
            shown = m.group(1) if len(m.group(1)) <= 20 else f"{m.group(1)[:10]}...({len(m.group(1))} digits)"
            return [], f"identifier {shown} is out of range 1..{n}"
        if i in seen:
            return [], f"identifier {i} is repeated"
        ids.append(i)
        seen.add(i)
        pos = m.end()
        if pos == len(body):
            break
        if body[pos] != " ":
            return [], f"expected a single space between entries at character {pos}: {body[pos:pos + 20]!r}"
        pos += 1
    if max_select is not None and len(ids) > max_select:
        return [], f"{len(ids)} identifiers selected, at most {max_select} allowed"
    return ids, None


def parse_selection(text: str, n_candidates: int, max_select: Optional[int] = 10,
                    strict: bool = True) -> ParsedSelection:
    """Parse ``text`` (the decoded output, special tokens removed) against a pool of ``n_candidates``.

    ``max_select=None`` means no cap. Strict: any format violation -> ``ids == []``,
    ``valid=False`` and ``error`` says why (never an exception for any ``text``, however long or
    odd: 4,000-digit ids are out of range, not a crash). Lenient: the salvaged identifiers (see
    the module docstring); ``valid`` is the strict verdict either way. Time linear in ``len(text)``.
    Raises TypeError / ValueError only for bad arguments (``text`` not a str, bad ``n_candidates``,
    ``max_select`` or ``strict``).
    """
    _check_args(text, n_candidates, max_select, strict)
    n_candidates = int(n_candidates)
    max_select = None if max_select is None else int(max_select)
    strict_ids, error = _strict_error(text, n_candidates, max_select)
    if strict or error is None:
        ids = strict_ids
    else:
        ids, seen = [], set()
        for m in _LENIENT_ENTRY.finditer(text):
            i = _id_value(m.group(1), n_candidates)
            if i is not None and i not in seen:
                ids.append(i)
                seen.add(i)
                if max_select is not None and len(ids) == max_select:
                    break
    return ParsedSelection(ids=ids, indices=[i - 1 for i in ids], valid=error is None, error=error)
