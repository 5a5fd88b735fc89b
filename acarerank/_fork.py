"""A forked child must not run torch on the OpenMP pool its parent's thread left behind.

torch's CPU wheels run intra-op work on GNU OpenMP (libgomp), whose worker threads belong to
the thread that first ran a parallel region. ``fork`` copies only the forking thread: in the
child that thread still holds the pool's bookkeeping, but its workers are gone, so its next
parallel region on more than one thread waits for them for ever (any torch op: a GEMM, a
``cos``, our native kernels). That is the pattern of ``gunicorn --preload`` and celery's prefork
pool: build (or warm up) in the parent, score in forked workers.

The rerankers' builds and passes call ``enter()``: it remembers each thread that ran them on
more than one torch thread, and in a child forked from such a thread it raises
``ForkedThreadPoolError`` — at once, naming the remedies — instead of the hang. A child thread
other than the forking one has no pool yet (libgomp makes a fresh one), and one torch thread
never uses the pool: both run. Torch work of the caller's own in the parent (building a
transformers model, a matmul) leaves the same pool and is not seen here (docs/api.md,
"Embedding in your process").
"""
from __future__ import annotations

import os
import threading

import torch

# idents of the threads of this process that ran a build or pass on > 1 torch thread
_ran_parallel: set = set()
# in a forked child: the ident of the thread that forked (the child's main thread) when that
# thread had run one in the parent, else None
_stale_pool_thread = None


class ForkedThreadPoolError(RuntimeError):
    """A build or pass in a forked child, on the thread that forked, with more than one torch
    thread, after that thread ran torch on several threads in the parent: it would hang."""


def _openmp() -> bool:
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


_USES_OPENMP = None


def _after_fork_in_child() -> None:
    global _stale_pool_thread
    me = threading.get_ident()  # the forking thread keeps its ident in the child
    _stale_pool_thread = me if me in _ran_parallel else None
    _ran_parallel.clear()


def enter(what: str) -> None:
    """Call before a build or pass runs torch ops: raises ``ForkedThreadPoolError`` where they
    would hang (above), else notes this thread when it runs on more than one torch thread."""
    global _USES_OPENMP
    n = torch.get_num_threads()
    if n <= 1:
        return
    me = threading.get_ident()
    if me == _stale_pool_thread:
        if _USES_OPENMP is None:
            _USES_OPENMP = _openmp()
        if _USES_OPENMP:
            raise ForkedThreadPoolError(
                f"{what}: this process was forked from a thread that had run torch on several OpenMP "
                f"threads, and torch is set to {n} threads here: OpenMP's thread pool does not survive "
                "fork, so this would hang. In the child call torch.set_num_threads(1) first, or run "
                "the call from a new thread, or start workers with 'spawn'/'forkserver' (or build the "
                "reranker after the fork: gunicorn without --preload)")
    _ran_parallel.add(me)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
