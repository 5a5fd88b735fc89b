"""A request's waits — for the large tokenizer lane, for room in the token budget, for its engine
jobs — each watching the client and the deadline, each ended early giving back what it held.

Every wait runs ``wait_or_drop`` (``disconnect.py``): a client that leaves is ``ClientGone``
(499) and its work is dropped; the deadline (``--request-timeout``) is the caller's
``timed_out()`` (504); a token wait past ``--token-wait-timeout`` is a 429 with ``Retry-After``
(docs/serving.md, "Limits and timeouts" and "Admission by tokens"). What the engine raises is the
server's fault, as input was checked before it: a dead engine is 503, a job the model failed 500
with the error id of its log line (docs/serving.md, "Internal faults and probes"). Plain
functions: the state they wait on (the lane, the ``TokenBudget``, the engine) is the caller's
(``RerankService``), passed in.
"""
from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, Optional

from .admission import TokenBudget, retry_after_s
from .disconnect import ClientGone, DeadlinePassed, wait_or_drop
from .engine import EngineDead, EngineFault, EngineStopped, QueueClock
from .errors import APIError

#: a score request's groups take at most 1/SCORE_GROUPS_SHARE of the engine's running window at once
SCORE_GROUPS_SHARE = 2

IsDisconnected = Callable[[], Awaitable[bool]]


async def acquire_lane(lane: asyncio.Semaphore, is_disconnected: IsDisconnected, deadline: Optional[float],
                       timed_out: Callable[[], APIError]) -> None:
    """``lane.acquire()``, watching the client and the deadline meanwhile (``wait_or_drop``).
    A lane granted at the moment the wait is given up goes back at once: never leaked."""
    acquiring = asyncio.ensure_future(lane.acquire())

    def give_up():
        if acquiring.done() and not acquiring.cancelled():
            lane.release()
        else:
            acquiring.cancel()  # asyncio.Semaphore passes a grant it cannot deliver to the next waiter
    try:
        await wait_or_drop(acquiring, is_disconnected, give_up, deadline=deadline)
    except DeadlinePassed:
        raise timed_out() from None


async def wait_for_tokens(budget: TokenBudget, granted: asyncio.Future, tokens: int, is_disconnected: IsDisconnected,
                          deadline: Optional[float], wait_timeout: Optional[float],
                          timed_out: Callable[[], APIError]) -> None:
    """Wait for ``granted`` (``budget.acquire``'s future for ``tokens``) up to ``wait_timeout``
    seconds (``--token-wait-timeout``; None: no limit) and ``deadline``, watching the client
    (``wait_or_drop``); whatever ends the wait early gives the place (or the tokens granted
    meanwhile) back. The wait running out is a 429 whose ``Retry-After`` is ``retry_after_s``."""
    loop = asyncio.get_running_loop()
    ends = [t for t in (deadline, None if wait_timeout is None else loop.time() + wait_timeout) if t is not None]
    seen = {}
    start, released = loop.time(), budget.released

    def give_up():   # what the 429 reports: the queue as it stood when the wait ran out
        seen.update(held=budget.held, ahead=budget.ahead_of(granted))
        drained = budget.released - released   # given back by the others during its wait
        budget.abandon(granted, tokens)
        # its retry joins the back: what is held and waiting now, then its own, must fit the budget
        queued = budget.held + budget.waiting_tokens
        seen["retry"] = retry_after_s(queued + tokens - budget.budget, drained, loop.time() - start)
    try:
        await wait_or_drop(granted, is_disconnected, give_up, deadline=min(ends) if ends else None)
    except DeadlinePassed:
        if deadline is not None and loop.time() >= deadline:
            raise timed_out() from None
        raise APIError(429, f"server busy: {seen['held']:,} tokens queued and {seen['ahead']} request(s) waiting "
                            f"ahead; this request's {tokens:,} did not fit the budget of "
                            f"{budget.budget:,} (--max-queue-tokens) within {wait_timeout:g} s "
                            f"(--token-wait-timeout); retry in {seen['retry']} s",
                       headers={"Retry-After": str(seen["retry"])}) from None


def submit(submit_fn, enc, rid: str, clock: Optional[QueueClock] = None):
    """``submit_fn(enc, rid, clock=clock)`` (``Engine.submit`` / ``submit_select``; ``clock``: the
    request's queue time, from its admission): the job, or the engine's refusal as a 503 (dead: it
    needs a restart; stopped: shutting down)."""
    try:
        return submit_fn(enc, rid, clock=clock)
    except EngineDead as e:
        raise APIError(503, f"server cannot serve: {e}; it needs a restart", {"Connection": "close"}) from None
    except EngineStopped as e:
        raise APIError(503, f"server shutting down: {e}") from None


async def wait_job(engine, job, is_disconnected: IsDisconnected, deadline: Optional[float],
                   timed_out: Callable[[], APIError]):
    """The job's result; drops the job if the client disconnects first (ClientGone, answered 499)
    or the deadline passes first (504).

    Everything the engine raises is the server's fault (input was checked before it): a dead
    engine is 503, any other failure 500 with the error id of its log line."""
    return await wait_for(asyncio.wrap_future(job.future), lambda: engine.cancel(job), is_disconnected, deadline,
                          timed_out)


async def wait_groups(engine, encs: list, rid: str, is_disconnected: IsDisconnected, deadline: Optional[float],
                      timed_out: Callable[[], APIError], cancelled, clock: Optional[QueueClock] = None) -> list:
    """The results of one request's engine jobs (``encs``: a score request's groups), in order.

    At most ``engine.max_running // SCORE_GROUPS_SHARE`` of them are in the engine at once, the
    next submitted as one ends: the engine's pass takes its documents from its first
    ``max_running`` jobs in arrival order, so 1,000 groups submitted together kept every later
    request out of the passes until all but the last few had ended (a 2-document rerank sent
    during a 1,000-query score waited 0.79 s, 0.03 s during a 1,000-document rerank).
    Whatever ends the wait early (a job failed, the client left, the deadline, a cancellation)
    drops every job not finished, so no group of a request that was answered keeps the engine busy;
    a request dropped with work left (not one that failed) is one in ``cancelled``
    (``acarerank_requests_cancelled_total``), as a rerank is, not one per group then in the engine.
    ``clock``: the request's queue time, shared by its groups (one sample, from its admission)."""
    if len(encs) == 1:
        return [await wait_job(engine, submit(engine.submit, encs[0], rid, clock), is_disconnected, deadline,
                               timed_out)]
    window = max(1, engine.max_running // SCORE_GROUPS_SHARE)
    # the jobs not finished, only: a finished job keeps its prefix handle, and a handle whose
    # prefix did not fit the cache's pool holds a private pool of its KV (docs/serving.md,
    # "Engine"), so a list of every job held the KV of all the request's groups till the end
    jobs = {}
    results, running, queued = [None] * len(encs), {}, iter(range(len(encs)))

    def fill() -> None:   # submit the next groups while the window has room
        while len(running) < window and (k := next(queued, None)) is not None:
            job = submit(engine.submit, encs[k], f"{rid}-{k}", clock)
            jobs[k] = job
            running[asyncio.wrap_future(job.future)] = k

    async def run() -> list:
        try:
            while True:
                fill()
                if not running:
                    return results
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    k = running.pop(fut)
                    del jobs[k]
                    results[k] = fut.result()
        finally:
            for fut in running:   # dropped: their outcome is read when it comes (disconnect.py)
                fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    dropped = []

    def drop():
        # one request, however many of its groups were in the engine: counted once, as the
        # rerank route counts its one job (acarerank_requests_cancelled_total counts requests)
        if task is not None and not task.done() and not dropped:
            cancelled.inc()
        dropped.append(True)
        if task is not None:
            task.cancel()
        for job in list(jobs.values()):
            if not job.future.done():
                engine.cancel(job, count=False)
    task = None
    try:
        try:
            fill()   # before the first await: the caller's turn in the token budget (hold_tokens)
        except Exception as e:  # noqa: BLE001 - re-raised below through wait_for, as run()'s errors are
            task = asyncio.get_running_loop().create_future()
            task.set_exception(e)
        else:
            task = asyncio.ensure_future(run())
        return await wait_for(task, drop, is_disconnected, deadline, timed_out)
    except BaseException:
        drop()
        raise


async def wait_for(fut, drop: Callable[[], None], is_disconnected: IsDisconnected, deadline: Optional[float],
                   timed_out: Callable[[], APIError]):
    """``fut``'s result, errors mapped as ``wait_job`` says; ``drop`` gives up the work."""
    try:
        return await wait_or_drop(fut, is_disconnected, drop, deadline=deadline)
    except (ClientGone, APIError):   # APIError: a group could not be submitted (wait_groups)
        raise
    except DeadlinePassed:
        raise timed_out() from None
    except EngineDead as e:
        raise APIError(503, f"server cannot serve: {e}; it needs a restart", {"Connection": "close"}) from None
    except EngineStopped as e:
        raise APIError(503, f"server shutting down: {e}") from None
    except EngineFault as e:
        raise APIError(500, f"internal error while running the model (error id {e.error_id}): {e}") from None
    except Exception as e:  # noqa: BLE001 - a fault of ours, not of the input
        raise APIError(500, f"internal error while scoring: {type(e).__name__}: {e}") from None
