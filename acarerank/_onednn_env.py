"""Bounds on oneDNN's caches of generated code, set before torch first uses oneDNN.

torch's oneDNN linear (``torch.ops.mkldnn._linear_pointwise``, the CPU "onednn" linear backend,
and bf16 ``F.linear``) builds a primitive — generated code — per input row count and keeps it in
two caches: oneDNN's own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's
(``LRU_CACHE_CAPACITY``), 1,024 entries each by default. A reranker's passes each bring a new
token count, so a server's RSS climbed by ~1 MB per new row count and layer shape: +0.9 GB over
500 random row counts at the 0.6B shapes in bf16 (EPYC, 2026-12-02), levelling off only near
the capacity. Every layer of a pass runs the same row count, so a pass needs one entry per layer
shape (4-5) and a cache of ``CAPACITY`` entries still holds the last few passes: a miss costs one
primitive build (≤ 3 ms at the 0.6B shapes) for the whole pass. Bounded to ``CAPACITY``, the
same traffic levels off within ~100 MB.

A leaf (imports nothing): ``acarerank/__init__.py`` calls ``bound_onednn_caches()`` first thing.
Both variables are read once, when oneDNN first builds a primitive in the process: where torch
has already run a oneDNN op before acarerank is imported, or where the variables are already
set, nothing changes (setdefault; docs/cpu.md, "GEMMs").
"""
from __future__ import annotations

import os
import re

#: entries kept by each of the two caches (unless the environment sets its own)
CAPACITY = 32
VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def c_atoi(text: str) -> int:
    """``text`` as ideep reads the variable, C's ``atoi`` as glibc computes it, ``(int) strtol(text,
    NULL, 10)``: C-locale whitespace skipped, an optional sign, then the ASCII digits up to the
    first other character (none: 0), clamped to a 64-bit long, then cut to a 32-bit int."""
    digits = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    if digits is None:
        return 0
    value = max(-2**63, min(2**63 - 1, int(digits.group(1))))
    return (value + 2**31) % 2**32 - 2**31


def bound_onednn_caches() -> None:
    """Set both cache capacities to ``CAPACITY`` where the environment does not set them, and
    ideep's where it sets one that ideep reads (``c_atoi``) as less than 1: "", "abc", "0", or
    "٣٢" (Unicode digits, which Python's int() takes) are ideep's capacity 0, and its cache then
    crashes the process (SIGSEGV) on the first oneDNN linear, with no message; a warning says what
    was replaced. (oneDNN's own takes 0: no cache.)"""
    for name in VARIABLES:
        os.environ.setdefault(name, str(CAPACITY))
    given = os.environ["LRU_CACHE_CAPACITY"]
    if c_atoi(given) < 1:
        import warnings

        os.environ["LRU_CACHE_CAPACITY"] = str(CAPACITY)
        warnings.warn(f"LRU_CACHE_CAPACITY={given!r} is not an integer >= 1: ideep's cache of oneDNN kernels "
                      f"crashes the process at that capacity; set to {CAPACITY}", RuntimeWarning, stacklevel=2)
