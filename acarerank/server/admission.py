"""Admission by tokens (``--max-queue-tokens``): a budget of queued tokens that requests wait for in arrival order.

``TokenBudget`` holds ``held`` (the tokens of the requests tokenized and not yet answered) at most
``budget``. A request that fits the budget alone but not now waits, in strict FIFO order, until
the requests ahead of it have given back enough (docs/serving.md, "Admission by tokens"):

* a later request never overtakes a waiting one, even one that would fit at once: with a
  first-fit rule a stream of small requests kept the budget partly used and a request near the
  budget got through 11 tries of 63 (docs/benchmarks.md, "Soak and chaos"); in FIFO order its
  wait is bounded by the tokens ahead of it;
* each waiter is an ``asyncio`` future, resolved on the event loop when tokens come back (no
  thread per waiter); it is granted as soon as it is at the head and fits, and a waiter that
  leaves the head (its client left, its wait ran out) lets the ones behind it try at once;
* requests granted together reach the engine in grant order: a granted request takes its turn
  (``take_turn``) before it submits, and it is given only once every one granted before it has
  submitted or left. Resolving the futures in order is not enough: a waiter's task wakes when it
  is next scheduled, and one that was checking its client at that moment woke after the ones
  behind it (``wait_or_drop`` polls between its waits), so they went to the engine first;
* everything runs on the one event loop of the server: ``acquire``, ``release``, ``abandon`` and
  ``take_turn`` are not thread-safe, the caller (``RerankService``) calls them from its request
  tasks only.

What a request counts (``score_tokens``, ``select_tokens``) is what the engine computes for it,
counted once it is tokenized.

Invariant, after every call: ``held <= budget``, and either no one waits or the head does not fit
(``held + waiters[0].tokens > budget``); the requests granted and not yet through their turn are
``entering``, in grant order.
"""
from __future__ import annotations

import asyncio
import collections
import math
from typing import Callable, Optional

#: the bounds of the ``Retry-After`` a request whose token wait ran out is sent (``retry_after_s``)
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60


def retry_after_s(excess: int, released: int, waited_s: float) -> int:
    """Seconds a request refused after its token wait should wait before it retries: how long the
    engine takes to give back ``excess`` tokens at the rate it gave them back during the wait,
    ``ceil(excess / (released / waited_s))``, clamped to [``RETRY_AFTER_MIN_S``, ``RETRY_AFTER_MAX_S``].

    ``excess``: tokens that must leave before the retry fits — the tokens held, plus those of every
    request still waiting (the retry joins the back of the queue), plus its own, less the budget.
    ``released``: tokens given back (requests answered) during its wait of ``waited_s`` seconds.
    Nothing given back in the whole wait: the most (the engine is stuck on long work or stalled;
    a retry at once would only wait again)."""
    if excess <= 0:
        return RETRY_AFTER_MIN_S
    if released <= 0 or waited_s <= 0:
        return RETRY_AFTER_MAX_S
    return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(excess * waited_s / released))))


def score_tokens(enc) -> int:
    """Tokens the engine computes for one tokenized rerank (a ``PointwiseEncoding``), what
    ``--max-queue-tokens`` counts: ``len(shared_ids) + Σ_d len(segment_ids[d])`` — the shared part
    (instruction, question, trace, query) once, as it is prefilled once per request and its ids are
    held once, then every document's segment (its tokens and the suffix). Prefix-cache hits are not
    subtracted: whether the prefix is still cached when the request's turn comes is not known at
    admission (docs/serving.md, "Admission by tokens")."""
    return len(enc.shared_ids) + sum(len(seg) for seg in enc.segment_ids)


def select_tokens(enc, max_new_tokens: int) -> int:
    """Tokens the engine computes for one tokenized selection (a ``SelectEncoding``): its prompt,
    plus ``max_new_tokens``, the most it may decode (an upper bound: the output is often shorter)."""
    return len(enc.prompt.input_ids) + max_new_tokens


class TokenBudget:
    """``budget`` tokens handed out in FIFO order.

    Args:
      budget: the most tokens held at once (``--max-queue-tokens``; ``math.inf``: none, only counted).
      on_change: called with ``(held, waiting)`` after each change (the service's gauges).
    """

    def __init__(self, budget: int, on_change: Callable[[int, int], None] = lambda held, waiting: None):
        self.budget = budget
        self.held = 0
        self.released = 0          # tokens given back since the start, all together (a throughput gauge)
        self._waiters: collections.deque = collections.deque()   # (tokens, future), oldest first
        self._entering: collections.deque = collections.deque()  # granted futures before their turn, in grant order
        self._turns: dict = {}    # granted future -> the future that wakes its take_turn
        self._on_change = on_change

    @property
    def waiting(self) -> int:
        """Requests waiting for tokens."""
        return len(self._waiters)

    @property
    def waiting_tokens(self) -> int:
        """Tokens the waiting requests ask for, all together."""
        return sum(t for t, _ in self._waiters)

    def ahead_of(self, fut: asyncio.Future) -> int:
        """Requests waiting ahead of ``fut``'s (all of them if it no longer waits)."""
        return next((i for i, (_, f) in enumerate(self._waiters) if f is fut), len(self._waiters))

    @property
    def entering(self) -> int:
        """Requests granted that have not yet taken their turn (``take_turn``)."""
        return len(self._entering)

    def acquire(self, tokens: int) -> Optional[asyncio.Future]:
        """Take ``tokens`` now (None: held, and the caller's turn), or a future resolved once they
        are held; its holder then waits for its turn (``take_turn``) before it submits.

        ``tokens`` must be at most ``budget`` (a larger request can never fit: the caller answers 413).
        Taken now only when nobody waits: a request that arrives after a waiting one never goes first;
        taken now while granted ones have not had their turn, it is granted (a done future) behind them."""
        if tokens > self.budget:
            raise ValueError(f"tokens ({tokens}) exceed the budget ({self.budget}): it can never be admitted")
        if not self._waiters and self.held + tokens <= self.budget:
            self.held += tokens
            self._changed()
            if not self._entering:
                return None
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(None)
            self._entering.append(fut)
            return fut
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((tokens, fut))
        self._changed()
        return fut

    def release(self, tokens: int) -> None:
        """Give back ``tokens`` that were held, and grant the waiters that now fit, in order."""
        self.held -= tokens
        self.released += tokens
        self._grant()

    def abandon(self, fut: asyncio.Future, tokens: int) -> None:
        """The request of ``fut`` stops waiting (its client left, its wait or deadline ran out, its
        task was cancelled, its wait raised): out of the queue, or, granted meanwhile and before its
        turn, out of that line with its tokens given back. Then the ones behind it may go. Once per
        future has effect: a second call, or one after its turn (its tokens are the caller's to give
        back then) or after ``fail_waiters``, changes nothing."""
        if fut in self._entering:
            self._leave(fut)
            self.release(tokens)
        elif any(f is fut for _, f in self._waiters):
            fut.cancel()
            self._waiters = collections.deque((t, f) for t, f in self._waiters if f is not fut)
            self._grant()

    def fail_waiters(self, error: Callable[[], BaseException]) -> None:
        """Every waiting request gets ``error()`` now, as its future's exception, and leaves the
        queue with nothing held (the service that can no longer serve: its waiters would
        otherwise wait for tokens, then get a 429 inviting a retry)."""
        waiters, self._waiters = self._waiters, collections.deque()
        for _, fut in waiters:
            if not fut.done():
                fut.set_exception(error())
        self._changed()

    async def take_turn(self, granted: asyncio.Future) -> None:
        """Wait until every request granted before ``granted`` (a future of ``acquire``, done) has
        taken its turn or left, then take it: the caller submits its work before its next ``await``,
        so the engine sees the requests in grant order. A task cancelled here leaves the line (its
        tokens are the caller's to give back)."""
        try:
            while granted in self._entering and self._entering[0] is not granted:
                turn = self._turns[granted] = asyncio.get_running_loop().create_future()
                await turn
        finally:
            self._turns.pop(granted, None)
            self._leave(granted)

    def _leave(self, fut: asyncio.Future) -> None:
        """``fut`` is out of the entering line (its turn taken, or it left); wake the new head's turn."""
        if fut in self._entering:
            self._entering.remove(fut)
        if self._entering:
            turn = self._turns.get(self._entering[0])
            if turn is not None and not turn.done():
                turn.set_result(None)

    def _grant(self) -> None:
        while self._waiters and self.held + self._waiters[0][0] <= self.budget:
            tokens, fut = self._waiters.popleft()
            self.held += tokens
            self._entering.append(fut)
            fut.set_result(None)
        self._changed()

    def _changed(self) -> None:
        self._on_change(self.held, len(self._waiters))
