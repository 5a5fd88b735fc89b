"""One thread for all of a process's model work: building the model, warm-up, every pass.

Why one thread: torch's CPU kernels run OpenMP parallel regions, and every thread that
enters one gets its own team of worker threads. A model built (or warmed up) on one thread
and run on another leaves two teams on the same cores, and each pass then runs ~35 % slower
(measured on a 2-core AMD EPYC (AVX2), 2026-11-30: a 9-request pass of the default model, 2,602 tokens, takes
1.02–1.07 s when one thread builds and runs it, 1.20–1.52 s when the main thread builds it
and the scheduler thread runs it; docs/ARCHITECTURE.md, "A served request"). So the server
builds its reranker on this thread and then runs the engine's scheduler loop on it.

    mt = ModelThread()
    rr = mt.call(build_reranker)           # the model's first parallel region runs here
    engine = Engine(rr, ..., model_thread=mt).start()   # the loop runs here too
"""
from __future__ import annotations

import concurrent.futures
import threading
from typing import Callable


class ModelThread:
    """A single worker thread that runs callables in submission order."""

    def __init__(self, name: str = "acarerank-model"):
        self._threads: list = []   # the worker, once started (a bounded stop waits for it: front.py)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix=name, initializer=lambda: self._threads.append(threading.current_thread()))

    def threads(self) -> list:
        """The worker thread while it is alive (a list: empty before its first call and once it ended)."""
        return [t for t in self._threads if t.is_alive()]

    def call(self, fn: Callable, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the model thread; waits and returns (or raises) its result."""
        return self._pool.submit(fn, *args, **kwargs).result()

    def submit(self, fn: Callable, *args, **kwargs) -> concurrent.futures.Future:
        """Queue ``fn`` on the model thread; its future resolves when it returns."""
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self) -> None:
        """Let the thread exit once its queued work is done (does not wait)."""
        self._pool.shutdown(wait=False)
