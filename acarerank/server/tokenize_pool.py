"""The tokenizer workers: a thread pool that runs ``encode`` off the event loop, and its large lane.

The event loop never tokenizes and the model thread never waits for it. A request of more than
``LARGE_REQUEST_CHARS`` characters tokenizes in the large lane, at most ``workers - 1`` at once, so
one worker is always left for the small ones (docs/serving.md, "Limits and timeouts"). What a
worker raises other than an input error is a fault of the server (500 with an error id), and a
pool that can take no more work is the service's death (docs/serving.md, "Internal faults and
probes"): ``TokenizerPool.run`` says so through ``on_broken``.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Optional

from .disconnect import ClientGone, DeadlinePassed, wait_or_drop
from .errors import APIError, log_safe

#: a request of more characters is "large": large requests share tokenize_workers - 1 workers,
#: so one worker is always left for the small ones (a 32 MB body tokenizes for seconds)
LARGE_REQUEST_CHARS = 256 * 1024

log = logging.getLogger("acarerank.server")


class WorkerFault(Exception):
    """A tokenizer worker raised something other than an input error (``BaseException`` included):
    a fault of the server, answered 500 with ``error_id``."""

    def __init__(self, error_id: str, exc: BaseException):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.error_id = error_id


class TokenizerPool:
    """``workers`` tokenizer threads and the large lane (``large_lane``: ``workers - 1`` of them, at least 1).

    Args:
      workers: threads of the pool (``--tokenize-workers``).
      metrics: the ``ServerMetrics`` whose ``engine_failures{stage="tokenize"}`` counts worker faults.
      on_broken: called with the reason when the pool cannot take work (shut down, broken).
    """

    def __init__(self, workers: int, metrics, on_broken: Callable[[str], None]):
        self._threads: list = []   # the workers, for threads()
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="acarerank-tokenize",
                                            initializer=lambda: self._threads.append(threading.current_thread()))
        self.large_lane = asyncio.Semaphore(max(1, workers - 1))
        self._metrics = metrics
        self._on_broken = on_broken

    def threads(self) -> list:
        """The workers still alive."""
        return [t for t in self._threads if t.is_alive()]

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """``ThreadPoolExecutor.shutdown``: no more work; a later ``run`` is a 503."""
        self._executor.shutdown(wait=wait, cancel_futures=cancel_futures)

    async def run(self, fn, *args, is_disconnected: Optional[Callable[[], Awaitable[bool]]] = None,
                  deadline: Optional[float] = None):
        """``fn(*args)`` in the tokenizer pool. ValueError (bad input: too long, nothing left after
        truncation, a lone surrogate) passes through; anything else it raises, ``BaseException``
        included, becomes ``WorkerFault``. A TypeError too: the schemas have checked every type
        before the request gets here, so one raised while tokenizing is a fault of ours (a 400
        naming internal functions told the client to fix a request that was fine). A pool that
        cannot take work any more (shut down, broken) calls ``on_broken`` and answers 503.

        While the work waits for a worker, the client leaving (``is_disconnected``) or the event
        loop's clock reaching ``deadline`` drops it from the pool's queue and raises ``ClientGone``
        or ``DeadlinePassed`` (``wait_or_drop``): it waited behind wedged or slow tokenizations for
        as long as they ran, its admission slot held. Work a worker already runs cannot be
        interrupted (docs/serving.md, "Limits and timeouts"): it is awaited to its end, then the
        same exception is raised."""
        def run():
            try:
                return fn(*args)
            except ValueError:
                raise
            except BaseException as e:  # noqa: BLE001 - a SystemExit in a worker must not escape as plain text
                error_id = uuid.uuid4().hex[:16]
                self._metrics.engine_failures.labels("tokenize").inc()
                log.error("tokenizer worker failed (error id %s): %s: %s", error_id, type(e).__name__, log_safe(e))
                raise WorkerFault(error_id, e) from None

        try:
            fut = self._executor.submit(run)
        except RuntimeError as e:  # "cannot schedule new futures after shutdown" / BrokenThreadPool
            self._on_broken(f"the tokenizer pool cannot run work ({type(e).__name__}: {e})")
            raise APIError(503, f"server cannot serve: tokenizer pool unavailable ({e})",
                           {"Connection": "close"}) from None
        waiting = asyncio.wrap_future(fut)
        try:
            if is_disconnected is None and deadline is None:
                return await waiting
            try:
                # fut.cancel succeeds only while the work is queued, not once a worker runs it
                return await wait_or_drop(waiting, is_disconnected or _still_there, fut.cancel, deadline=deadline)
            except (ClientGone, DeadlinePassed):
                if not fut.cancelled():
                    await asyncio.wait({waiting})   # its outcome: read by wait_or_drop's _forget
                raise
        except WorkerFault as e:
            raise APIError(500, f"internal error while tokenizing (error id {e.error_id}): {e}") from None


async def _still_there() -> bool:
    """``is_disconnected`` for a caller that gave a deadline only."""
    return False
