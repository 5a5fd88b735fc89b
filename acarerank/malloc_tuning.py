"""glibc malloc thresholds for acarerank's own processes, and the CPU pass size that follows them.

torch allocates CPU tensors with malloc. glibc serves a block above its mmap threshold (adaptive,
never past 32 MB) with a fresh ``mmap`` and gives it back with ``munmap``, and it returns the
heap's free top to the kernel past its trim threshold: every layer of a pass then touches new
pages, each a minor page fault and a zeroing (docs/cpu.md, "Memory between passes"). Raising both
thresholds keeps freed blocks in the heap for the next layer, as the tcmalloc/jemalloc preloads
CPU inference servers use do. It is a whole-process setting, so the library never makes it on
import: ``acarerank serve`` (and its Ray Serve replicas), ``bench``, ``score`` and ``select`` call
``tune_malloc()`` at start unless told ``--malloc default``; an embedding application may call it
itself, or set glibc's own variables before Python starts
(``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``), which this module never overrides.

With freed blocks kept, a CPU pass of 4,096 segment tokens beats 2,048 (the larger GEMMs no longer
pay for new pages); without, 2,048 is faster. ``cpu_batch_tokens()`` gives the pointwise
reranker's CPU default accordingly (``PointwiseReranker(max_batch_tokens=None)``).
"""
from __future__ import annotations

import ctypes
import os
import threading
from typing import Optional

#: mallopt's parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: blocks up to this size are served from (and freed back into) the heap
MMAP_THRESHOLD = 512 << 20
#: free memory at the heap's top kept before any is returned to the kernel
TRIM_THRESHOLD = 1 << 30
#: glibc's variables; set in the environment, they win over tune_malloc
ENV_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
#: an environment mmap threshold at least this large counts as keeping a pass's blocks
KEEPS_BLOCKS_FROM = 64 << 20
#: pointwise segment tokens per CPU pass: with freed blocks kept / without
CPU_BATCH_TOKENS_KEPT, CPU_BATCH_TOKENS = 4096, 2048
#: the values of --malloc (acarerank serve, acarerank bench): tune_malloc at start, or glibc as it is
CHOICES = ("tuned", "default")

_lock = threading.Lock()
_tuned = False


def _env_threshold() -> Optional[int]:
    """MALLOC_MMAP_THRESHOLD_ as glibc reads it (decimal or 0x hex), None when unset or unreadable."""
    raw = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if raw is None:
        return None
    try:
        return int(raw.strip(), 0)
    except ValueError:
        return None


def _glibc_mallopt():
    """The process's mallopt where its C library is glibc, else None (musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    if not (hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallopt")):
        return None
    fn = libc.mallopt
    fn.argtypes, fn.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return fn


def tune_malloc() -> str:
    """Raise glibc's mmap and trim thresholds to MMAP_THRESHOLD / TRIM_THRESHOLD for this process
    (once; later calls report the same). Returns what holds now, for a log line:
    "tuned (...)", "environment (...)" where glibc's variables are set (left as they are), or
    "default (...)" where the C library is not glibc or mallopt refused."""
    global _tuned
    with _lock:
        if _tuned:
            return status()
        if any(v in os.environ for v in ENV_VARIABLES):
            return status()
        mallopt = _glibc_mallopt()
        if mallopt is None:
            return "default (the C library is not glibc)"
        if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
            return "default (glibc's mallopt refused the thresholds)"
        _tuned = True
        return status()


def apply(choice: str) -> str:
    """``--malloc`` of ``acarerank serve`` / ``bench`` / ``score`` / ``select``: "tuned" runs tune_malloc, "default" changes
    nothing; what holds then, for the start-up line."""
    if choice not in CHOICES:
        raise ValueError(f"--malloc must be one of {', '.join(CHOICES)}, got {choice!r}")
    return tune_malloc() if choice == "tuned" else status()


def status() -> str:
    """What this process's malloc does with freed blocks, in a few words (changes nothing)."""
    if _tuned:
        return f"tuned (mmap threshold {MMAP_THRESHOLD >> 20} MB, trim threshold {TRIM_THRESHOLD >> 20} MB)"
    set_vars = [f"{v}={os.environ[v]}" for v in ENV_VARIABLES if v in os.environ]
    if set_vars:
        return f"environment ({', '.join(set_vars)})"
    return "default (glibc's adaptive thresholds)"


def keeps_freed_blocks() -> bool:
    """True where this process keeps a pass's freed blocks: tune_malloc ran, or the environment
    sets an mmap threshold of at least KEEPS_BLOCKS_FROM."""
    env = _env_threshold()
    return _tuned or (env is not None and env >= KEEPS_BLOCKS_FROM)


def cpu_batch_tokens() -> int:
    """The pointwise reranker's default segment tokens per CPU pass in this process."""
    return CPU_BATCH_TOKENS_KEPT if keeps_freed_blocks() else CPU_BATCH_TOKENS
