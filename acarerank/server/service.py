"""What one replica does with a parsed request: checks, admission, tokenization, the engine.

``RerankService`` sits between the HTTP layer (``app.py``, which only parses and maps
errors) and the scheduler (``engine.py``, which owns the model):

* checks the types cannot express — empty ``documents`` → 400, more than ``max_documents``
  → 413, ``raw_scores`` → 400 (the model's probabilities are what it serves), and a peer's
  option that would change the scores and that we cannot honour (``rank_fields``,
  ``max_chunks_per_doc`` other than 1, ``truncation_direction: Left``, ``truncate_prompt_tokens`` other than -1, ``use_activation:
  false``, vLLM's other options off their defaults) → 400: ``request_checks.py``;
* admission: at most ``max_queue`` requests admitted and unanswered at once, else 429 with
  ``Retry-After``; with ``max_queue_tokens``, at most that many tokens (``score_tokens`` /
  ``select_tokens``: what the engine computes, counted once tokenized) of requests unanswered at
  once: a request that does not fit now waits for room in arrival order (``admission.py``), for
  at most ``token_wait_timeout`` seconds, then 429 with ``Retry-After`` — and 413 for one request
  over the whole budget, which could never fit;
* tokenizes in a thread pool (``reranker.encode``, ``tokenize_pool.py``) — the event loop never tokenizes and the
  model thread never waits for it; the truncation policy is the reranker's own;
  ``max_tokens_per_doc`` cuts each document's tokens from its end, first; ``truncate: false``
  then turns any other cut into a 400;
* submits to the engine and waits, polling the client (``waiting.py``): a client that
  disconnects has its remaining work dropped (499), and so has a request still unanswered
  ``request_timeout`` seconds after it arrived (504; a tokenization already running finishes
  first: the worker cannot be interrupted, and the large lane must not count it gone while it runs);
* maps the engine's failures (``waiting.py``): a request the model failed on (``EngineFault``) is
  a 500 naming the error id of the failure's log line; a dead engine (``EngineDead``) a 503 at
  once, for it and every later request (``dead``); anything raised in a tokenizer worker other than an input
  error (``ValueError``/``TypeError``: 400), ``BaseException`` included, is a 500 — and a pool
  that can no longer run work marks the service dead (docs/serving.md, "Internal faults and probes");
* builds the response (results best first, ties in input order: ``responses.py``);
* vLLM's score API (``score``): the pairs' scores in input order, 1 query with N documents run as
  the rerank route's request, N queries with N documents as one engine job per distinct query.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import threading
import time
import uuid
from array import array
from typing import Awaitable, Callable, Optional

from .._validate import check_seconds
from ..pointwise import ScoreRequest
from .config import DEFAULT_MAX_DOCUMENTS, DEFAULT_MAX_QUEUE, DEFAULT_TOKEN_WAIT_TIMEOUT
from .disconnect import DeadlinePassed
# score_tokens, select_tokens: the tests import them from here
from .admission import TokenBudget, score_tokens, select_tokens  # noqa: F401
from .engine import DEFAULT_CANARY_AFTER, Engine, QueueClock, run_on_dead
from .errors import APIError
from .metrics import ServerMetrics
# select_unavailable, score_groups: build.py and the tests import them from here
from .request_checks import (check_documents, check_pairs, check_peer_options, check_vllm_options,  # noqa: F401
                             check_select_output, score_groups, select_unavailable)
from .responses import rerank_body, score_body, select_body
from .schemas import RerankRequest, ScorePairsRequest, SelectRequest
# LARGE_REQUEST_CHARS: the tests import it from here
from .tokenize_pool import LARGE_REQUEST_CHARS, TokenizerPool  # noqa: F401
from .waiting import acquire_lane, submit, wait_for_tokens, wait_groups, wait_job

#: the warm-up request, and the engine's canary: short, within every limit, known to score
CANARY = ScoreRequest("warm-up query", ["warm-up document"])

#: set while the current request holds an admission slot (taken by the HTTP gate once the body has arrived)
_holding_slot = contextvars.ContextVar("acarerank_holding_slot", default=False)

log = logging.getLogger("acarerank.server")


def pinned_tokens_bound(reranker) -> Optional[int]:
    """Shared-part tokens the engine's running requests may pin together (``Engine``'s
    ``max_running_tokens``): the reranker's ``max_pinned_tokens``, the rule ``score_encodings``
    follows offline — the prefix cache's budget (``--cache-budget``, whole pages, at least 1), the
    default budget with the cache off (docs/serving.md, "Engine"); None for a reranker without one
    (a test double): only the count bounds them."""
    return getattr(reranker, "max_pinned_tokens", None)


class RerankService:
    """One engine (one model) behind the rerank, score and select endpoints.

    Args:
      reranker: a ``PointwiseReranker``.
      model_name: what every response's ``model`` field says.
      setwise: a ``SetwiseReranker`` for ``/v1/select`` (None: the endpoint answers 404); its
        prompt is built in the tokenizer pool and its prefill chunks and decode steps run as
        steps of the engine, between scoring passes (``engine.py``).
      max_batch_tokens: segment tokens per packed pass (None: the reranker's own).
      max_queue: requests admitted and not yet answered; one more gets 429.
      max_queue_tokens: tokens (``score_tokens`` / ``select_tokens``) of the tokenized requests not
        yet answered; a request that would take the total past it waits for room in arrival order,
        one over it alone gets 413 (``hold_tokens``). None: no token budget (the total is still the
        ``queue_tokens`` gauge).
      token_wait_timeout: seconds a request may wait for room in ``max_queue_tokens``; then 429
        with ``Retry-After``. None or ``inf``: it waits until answered or ``request_timeout``.
      max_documents: documents per request; more gets 413.
      tokenize_workers: threads of the tokenization pool.
      model_thread: the ``ModelThread`` that built ``reranker``; the scheduler loop runs on it
        (one OpenMP team for all model work: ``model_thread.py``). None: a thread of its own.
      canary_after_failures: failures in a row after which the engine runs ``CANARY`` alone and,
        if that fails too, dies (``Engine``'s ``canary_after``).
      request_timeout: seconds a request may take from ``rerank``/``select`` being called to its
        answer; then 504 and its remaining work dropped. None: no deadline.
      max_pass_timeout: seconds one model step may run; past it the engine is dead (``dead``, 503
        everywhere, ``on_dead``: ``Engine``'s ``max_pass_s``, ``--max-pass-timeout``). None or
        ``inf``: no bound.
    """

    def __init__(self, reranker, model_name: str, *, setwise=None, max_batch_tokens: Optional[int] = None,
                 max_queue: int = DEFAULT_MAX_QUEUE, max_documents: int = DEFAULT_MAX_DOCUMENTS,
                 tokenize_workers: int = 2, model_thread=None, canary_after_failures: int = DEFAULT_CANARY_AFTER,
                 request_timeout: Optional[float] = None, max_queue_tokens: Optional[int] = None,
                 token_wait_timeout: Optional[float] = DEFAULT_TOKEN_WAIT_TIMEOUT,
                 max_pass_timeout: Optional[float] = None):
        for name, v in (("max_queue", max_queue), ("max_documents", max_documents),
                        ("tokenize_workers", tokenize_workers), ("max_queue_tokens", max_queue_tokens)):
            if v is None and name == "max_queue_tokens":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        request_timeout = check_seconds("request_timeout", request_timeout, none=True)
        token_wait_timeout = check_seconds("token_wait_timeout", token_wait_timeout, none=True)
        self.token_wait_timeout = None if token_wait_timeout == math.inf else token_wait_timeout
        # inf: no deadline (an infinite timer is not something asyncio's wait_for should be handed)
        self.request_timeout = None if request_timeout == math.inf else request_timeout
        self.reranker = reranker
        self.setwise = setwise
        # a model too short for the setwise template serves reranks and refuses every selection
        self.select_unavailable = None if setwise is None else select_unavailable(setwise)
        self.model_name = model_name
        self.max_queue = max_queue
        self.max_queue_tokens = max_queue_tokens
        self.max_documents = max_documents
        self.metrics = ServerMetrics(reranker.cache_stats,
                                     select_cache_stats=None if setwise is None else setwise.cache_stats)
        # the engine drives the reranker's step API (acquire_prefix / score_segments / release_prefix);
        # this service calls its encode (thread-safe) from the tokenizer pool
        # the running requests pin their shared parts outside what the prefix cache may evict
        self.engine = Engine(reranker, max_batch_tokens or reranker.max_batch_tokens, self.metrics,
                             model_thread=model_thread, select_steps=setwise, canary_after=canary_after_failures,
                             max_running_tokens=pinned_tokens_bound(reranker),
                             max_pass_s=check_seconds("max_pass_timeout", max_pass_timeout, none=True))
        self.model_thread = model_thread
        self.pool = TokenizerPool(tokenize_workers, self.metrics, self._pool_broke)
        self.large_request_chars = LARGE_REQUEST_CHARS
        self._lock = threading.Lock()
        self._admitted = 0
        # tokens of the requests tokenized and unanswered, handed out in arrival order (admission.py);
        # without a budget, only counted (the queue_tokens gauge)
        self._tokens = TokenBudget(math.inf if max_queue_tokens is None else max_queue_tokens, self._tokens_changed)
        self.ready = False
        self._dead: Optional[str] = None   # set by a tokenizer pool that can no longer run work
        self.on_dead = self.engine.on_dead  # callables(reason), run once when the service dies
        self._loop: Optional[asyncio.AbstractEventLoop] = None   # the event loop of the token waiters
        self.on_dead.append(self._wake_token_waiters)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, warmup: bool = True, timeout: float = 600.0) -> "RerankService":
        """Start the scheduler; with ``warmup`` run one scoring pass of ``CANARY`` first (then ``ready``).
        ``CANARY`` is the engine's canary (encoded here, by the reranker that serves). ValueError
        naming the model's maximum context length when even ``CANARY`` does not fit ``max_length``
        (a model of a few hundred positions: the cap is clamped to them, docs/input-safety.md)."""
        try:
            self.engine.canary = self.reranker.encode(CANARY)
        except ValueError as e:
            self.stop()   # the model thread that built the reranker, as after a failed warm-up
            # its own words ("shorten the query", "raise max_length") are advice to a client, not to
            # the operator whose model has too few positions for any request
            cap = getattr(self.reranker, "max_length", None)
            limit = getattr(getattr(self.reranker, "runner", None), "max_positions", None)
            model = f" (the model's maximum context length is {limit:,} tokens)" if isinstance(limit, int) else ""
            how = ("serve a model of more positions" if isinstance(limit, int) and isinstance(cap, int)
                   and cap >= limit else "raise --max-length (max_length)")
            raise ValueError(f"the server cannot score its own warm-up request ({len(CANARY.query.split())}-word "
                             f"query, one {len(CANARY.documents[0].split())}-word document) under max_length="
                             f"{cap}{model}: no request could be served; {how} ({e})") from None
        # one-time tokenizer set-up now, off the first long request (which stalled the probes)
        for reranker in (self.reranker, self.setwise):
            prepare = getattr(getattr(reranker, "tokenizer", None), "prepare_heads", None)
            if prepare is not None:
                prepare()
        self.engine.start()
        if warmup:
            try:
                # the engine's own job: counted in no request metric (docs/serving.md, "Metrics")
                self.engine.submit(self.engine.canary, rid="warm-up", canary=True).future.result(timeout)
            except BaseException:
                # a service that never became ready stops its threads: the scheduler and the model
                # thread left running kept `acarerank serve` from exiting after its error line
                self.stop()
                raise
        self.ready = True
        return self

    def stop(self) -> None:
        self.ready = False
        self.engine.stop()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.model_thread is not None:
            self.model_thread.shutdown()

    def threads(self) -> list:
        """The threads this service started that are still alive: the engine's scheduler (or the
        model thread it runs on) and the tokenizer workers. A bounded stop waits for these only,
        never for the embedding application's own threads (``front.run_server``)."""
        mt = self.model_thread.threads() if self.model_thread is not None else []
        return self.engine.threads() + mt + self.pool.threads()

    @property
    def dead(self) -> Optional[str]:
        """Why the service can serve no more (the engine died or the tokenizer pool broke); None while it can.

        Once set it stays: every request answers 503, ``/health`` and ``/ready`` 503 with this
        reason. ``acarerank serve`` then exits non-zero; an embedded app reads this property or
        adds a callable to ``on_dead`` (docs/serving.md, "Internal faults and probes")."""
        return self.engine.dead or self._dead

    def health(self) -> dict:
        """The engine's ``health()`` (state, busy_s, iterations, reason), dead also for a broken pool."""
        h = self.engine.health()
        if self._dead is not None and h["state"] != "dead":
            h = dict(h, state="dead", reason=self._dead)
        return h

    def _mark_dead(self, reason: str) -> None:
        if self.dead is not None:
            return
        self._dead = reason
        log.critical("service dead: %s; every waiting and later request gets 503", reason)
        self.metrics.engine_failures.labels("engine").inc()
        run_on_dead(self.on_dead, reason)

    def _wake_token_waiters(self, reason: str) -> None:
        """``on_dead``: every request waiting for room in ``max_queue_tokens`` gets the dead
        service's 503 now, as a new request does (docs/serving.md, "A dead engine is loud") — it
        waited out ``token_wait_timeout`` for tokens the engine might never give back (a tokenizer
        pool that broke under a wedged engine), then got a 429 inviting a retry. Called on the
        thread that noticed (the scheduler's or the event loop); the waiters live on the loop."""
        loop = self._loop
        if loop is None:   # no request has waited for tokens yet
            return

        def wake():
            self._tokens.fail_waiters(lambda: self._unavailable(reason))
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:   # not on an event loop: the scheduler thread
            running = None
        if running is loop:
            wake()
        elif not loop.is_closed():
            loop.call_soon_threadsafe(wake)

    @staticmethod
    def _unavailable(reason: str) -> APIError:
        return APIError(503, f"server cannot serve: {reason}; it needs a restart", {"Connection": "close"})

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self._unavailable(self.dead)

    def _pool_broke(self, reason: str) -> None:
        if self.ready:  # not our own stop(): the pool broke under a serving service
            self._mark_dead(reason)

    @property
    def admitted(self) -> int:
        return self._admitted

    @contextlib.contextmanager
    def admit(self):
        """Hold one of ``max_queue`` slots for the duration of a request, or raise 429.

        Re-entrant within a request: the HTTP gate admits once the body has arrived, and the
        handler's own ``admit`` then holds the same slot."""
        if _holding_slot.get():
            yield
            return
        with self._lock:
            self._refuse_if_full()
            self._admitted += 1
            self.metrics.in_flight.set(self._admitted)
        token = _holding_slot.set(True)
        try:
            yield
        finally:
            _holding_slot.reset(token)
            with self._lock:
                self._admitted -= 1
                self.metrics.in_flight.set(self._admitted)

    @property
    def admission_limit(self) -> int:
        """Requests admitted at once (``max_queue``): what the gate's default upload bound follows."""
        return self.max_queue

    def refuse_if_full(self) -> None:
        """``admit``'s 429 if no slot is free now, taking none: the gate's check at a request's
        head, before its body is read (the slot itself is taken once the body has arrived)."""
        with self._lock:
            self._refuse_if_full()

    def _refuse_if_full(self) -> None:
        if self._admitted >= self.max_queue:
            raise APIError(429, f"server busy: {self._admitted} requests in flight (--max-queue "
                                f"{self.max_queue}); retry later", headers={"Retry-After": "1"})

    @property
    def queued_tokens(self) -> int:
        """Tokens of the requests holding ``hold_tokens``: tokenized and not yet answered."""
        return self._tokens.held

    @property
    def waiting_for_tokens(self) -> int:
        """Requests tokenized and waiting for room in ``max_queue_tokens`` (0 without a budget)."""
        return self._tokens.waiting

    def _tokens_changed(self, held: int, waiting: int) -> None:
        self.metrics.queue_tokens.set(held)
        self.metrics.token_waiting.set(waiting)

    @contextlib.asynccontextmanager
    async def hold_tokens(self, tokens: int, is_disconnected: Callable[[], Awaitable[bool]],
                          deadline: Optional[float] = None):
        """Count a tokenized request's ``tokens`` against ``max_queue_tokens`` until it is answered.

        Held from its submission to the engine until the handler returns, whatever ends it (an
        answer, a 500, a 503, a client gone, ``--request-timeout``, the drain's cancellation): the
        ``finally`` gives them back. A dropped request's remaining documents are dropped by the
        engine's next iteration, so what it no longer counts runs at most to the end of the pass
        in progress. Raises ``APIError`` 413 when ``tokens`` alone exceed the budget (no wait can
        admit it).

        One that fits the budget alone but not now waits for it in arrival order (``TokenBudget``:
        no later request goes first), holding its admission slot and its token ids meanwhile, for
        at most ``token_wait_timeout`` seconds (then 429 with ``Retry-After``), never past
        ``deadline`` (504); a client that leaves meanwhile gives its place up at once
        (``ClientGone``, 499), and so does a task cancelled by the drain. Granted, it takes its turn
        (``TokenBudget.take_turn``): the body submits its first work to the engine before its
        first ``await``, so requests granted together reach the engine in grant order. On the
        event loop only."""
        budget = self.max_queue_tokens
        if budget is not None and tokens > budget:
            raise APIError(413, f"this request is {tokens:,} tokens once tokenized, more than the whole queue "
                                f"budget of {budget:,} tokens (--max-queue-tokens): it can never be admitted; "
                                f"send fewer or shorter documents")
        # first the loop, then the check: a death after the check wakes this request's wait (on_dead)
        self._loop = asyncio.get_running_loop()
        self._check_alive()   # a request tokenized while the service died waits for nothing
        granted = self._tokens.acquire(tokens)
        if granted is not None and not granted.done():
            try:
                await wait_for_tokens(self._tokens, granted, tokens, is_disconnected, deadline,
                                      self.token_wait_timeout, self._timed_out)
            except BaseException:
                # whatever ended the wait (its own ends give the place up already; this also covers
                # a client check that raised): a grant that is never used must not hold the line
                self._tokens.abandon(granted, tokens)
                raise
        try:
            if granted is not None:   # the engine sees the requests granted together in grant order
                await self._tokens.take_turn(granted)
            yield
        finally:
            self._tokens.release(tokens)

    # -- rerank ------------------------------------------------------------------------------
    async def rerank(self, req: RerankRequest, is_disconnected: Callable[[], Awaitable[bool]],
                     headers: Optional[dict] = None):
        """The response body for one rerank request (a dict, or TEI's list).

        is_disconnected: coroutine function, True once the client is gone. headers: filled with
        response headers (``x-queue-time``: ms from admission to the first pass, as TEI sends).
        """
        docs = req.document_texts()
        check_documents(docs, self.max_documents)
        if req.raw_scores:
            raise APIError(400, "raw_scores=true is not supported: this server returns relevance probabilities "
                                "(sigmoid of the yes/no logit difference)")
        check_peer_options(req)
        instruction = check_vllm_options(req)
        self._check_alive()
        deadline = self._deadline()
        rid = uuid.uuid4().hex
        with self.admit():
            clock = QueueClock(time.perf_counter())   # queue time runs from admission (docs/serving.md, "Metrics")
            request = ScoreRequest(req.query, docs, question=req.question, trace=req.trace,
                                   instruction=instruction, cache_salt=req.cache_salt)
            try:
                texts = (request.query, request.question, request.trace, request.instruction, *request.documents)
                enc = await self._tokenize(deadline, is_disconnected, texts, self._encode, request,
                                           req.max_tokens_per_doc or None, req.truncate)   # 0: vLLM's "no cut"
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e)) from None
            async with self.hold_tokens(score_tokens(enc), is_disconnected, deadline):
                job = submit(self.engine.submit, enc, rid, clock)
                result = await wait_job(self.engine, job, is_disconnected, deadline, self._timed_out)
        if headers is not None:  # TEI's header: milliseconds from admission to the first pass
            headers["x-queue-time"] = f"{result.queue_time * 1e3:.3f}"
        return rerank_body(req, docs, result, rid, self.model_name)

    def _deadline(self) -> Optional[float]:
        """The event loop's time by which this request must be answered (None: no deadline)."""
        if self.request_timeout is None:
            return None
        return asyncio.get_running_loop().time() + self.request_timeout

    def _check_deadline(self, deadline: Optional[float]) -> None:
        if deadline is not None and asyncio.get_running_loop().time() >= deadline:
            raise self._timed_out()

    def _timed_out(self) -> APIError:
        return APIError(504, f"request not answered within --request-timeout {self.request_timeout:g} s; "
                             f"its remaining work was dropped")

    async def _tokenize(self, deadline: Optional[float], is_disconnected: Callable[[], Awaitable[bool]],
                        texts: tuple, fn, *args):
        """``fn(*args)`` in the tokenizer pool, in the large lane when ``texts`` (None: absent) are
        large: at most ``tokenize_workers - 1`` large requests, rerank and select alike, tokenize at
        once. The wait for the lane, and then for a free worker (``TokenizerPool.run``), ends at the
        deadline (504) or when the client leaves (``ClientGone``, 499: a gone client's megabytes are
        never tokenized, which took a worker for seconds and held the lane from the requests behind
        it); the deadline is checked once more after tokenizing. The tokenization itself is not
        abandoned once a worker runs it (its worker would run on, and the lane would count it gone)."""
        chars = sum(len(x) for x in texts if x)
        lane = self.pool.large_lane if chars > self.large_request_chars else None
        if lane is not None:
            await acquire_lane(lane, is_disconnected, deadline, self._timed_out)
        try:
            enc = await self.pool.run(fn, *args, is_disconnected=is_disconnected, deadline=deadline)
        except DeadlinePassed:   # it waited for a worker past the deadline: dropped from the pool's queue
            raise self._timed_out() from None
        except Exception:   # past the deadline, the 504 a tokenization that ran over it gets (documented),
            self._check_deadline(deadline)   # not its own error (a 400 after 18 s); else that error
            raise
        finally:
            if lane is not None:
                lane.release()
        self._check_deadline(deadline)
        return enc

    def _encode(self, request: ScoreRequest, max_tokens_per_doc: Optional[int], truncate: bool):
        """Tokenize (pool thread) with ``truncate`` and ``max_tokens_per_doc``.

        ``truncate=false`` encodes with nothing cut and no document room reserved, so a request is
        refused only when one of its prompts is over ``max_length`` (the error names the document
        or the trace), not when the reserve the cutting rule keeps would have cut its trace.
        ``max_tokens_per_doc`` cuts each document first, a cut asked for: with ``truncate=false``
        a document it brings under the limit is scored, not refused."""
        # only the arguments given: a step API written against encode(request) keeps working
        kw = {}
        if not truncate:
            kw["truncate"] = False
        if max_tokens_per_doc is not None:
            kw["max_doc_tokens"] = max_tokens_per_doc
        enc = self.reranker.encode(request, **kw)
        # the token ids wait in the queue until the request is answered: a list of Python ints
        # takes ~29 bytes a token (a request of 4 M characters, 1.7 M tokens: 50 MB), array('i')
        # 4; a pass reads one segment at a time (docs/serving.md, "Limits and timeouts"). The
        # shared part too: an N-to-N /score request holds one per distinct query, up to the whole
        # request's tokens (acquire_prefix copies it into a list for the prefill alone)
        enc.shared_ids = array("i", enc.shared_ids)
        enc.segment_ids = [array("i", seg) for seg in enc.segment_ids]
        return enc

    # -- score (vLLM's score API) ------------------------------------------------------------
    def _encode_groups(self, requests: list, max_tokens_per_doc: Optional[int], truncate: bool) -> list:
        """``_encode`` of each group's request (one pool task for the whole score request)."""
        return [self._encode(r, max_tokens_per_doc, truncate) for r in requests]

    async def score(self, req: ScorePairsRequest, is_disconnected: Callable[[], Awaitable[bool]],
                    headers: Optional[dict] = None) -> dict:
        """The response body of one score request (vLLM's ``ScoreResponse``): ``data[i].score`` is
        pair ``i``'s relevance probability, the rerank route's ``relevance_score`` for that query and
        document, in input order (not sorted).

        The pairs run as one engine job per distinct query (``score_groups``): 1 query with N
        documents is the rerank route's request exactly; N queries with N documents are at most N
        jobs, admitted as one request (one ``--max-queue`` slot, their tokens together against
        ``--max-queue-tokens``) and run at most half the engine's running window at a time
        (``waiting.wait_groups``). ``usage`` sums the groups' tokens (each distinct query's shared part
        once, as the rerank route counts it); ``x-queue-time`` is the least of the groups': from the
        request's admission to its first group's first pass.
        """
        queries, docs = req.query_texts(), req.document_texts()
        check_pairs(req, queries, docs, self.max_documents)
        check_peer_options(req)
        instruction = check_vllm_options(req)
        self._check_alive()
        deadline = self._deadline()
        rid = uuid.uuid4().hex
        if len(queries) == 1:
            queries = queries * len(docs)
        groups = score_groups(queries)
        max_doc = req.max_tokens_per_doc or None   # 0: vLLM's "no cut"
        with self.admit():
            clock = QueueClock(time.perf_counter())
            requests = [ScoreRequest(q, [docs[i] for i in idx], question=req.question, trace=req.trace,
                                     instruction=instruction, cache_salt=req.cache_salt) for q, idx in groups.items()]
            try:
                texts = (*groups, req.question, req.trace, instruction, *docs)
                encs = await self._tokenize(deadline, is_disconnected, texts, self._encode_groups, requests,
                                            max_doc, req.truncate)
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e)) from None
            async with self.hold_tokens(sum(score_tokens(enc) for enc in encs), is_disconnected, deadline):
                results = await wait_groups(self.engine, encs, rid, is_disconnected, deadline, self._timed_out,
                                            self.metrics.cancelled, clock)
        if headers is not None:
            headers["x-queue-time"] = f"{min(r.queue_time for r in results) * 1e3:.3f}"
        return score_body(req, len(docs), groups, results, rid, self.model_name)

    # -- select ------------------------------------------------------------------------------
    def _encode_select(self, req: SelectRequest, docs: list):
        """The selection's tokenized prompt (pool thread)."""
        return self.setwise.encode_select(req.query, docs, intent=req.intent, max_select=req.max_select,
                                          cache_salt=req.cache_salt)

    async def select(self, req: SelectRequest, is_disconnected: Callable[[], Awaitable[bool]],
                     headers: Optional[dict] = None) -> dict:
        if self.setwise is None:
            raise APIError(404, "this server has no setwise model: /v1/select is not available")
        if self.select_unavailable is not None:   # no request can change it: not the request's fault
            raise APIError(400, f"this server's model cannot serve /v1/select at all: {self.select_unavailable} "
                                f"(/v1/rerank and /score are served)", type="context_length")
        docs = req.document_texts()
        check_documents(docs, self.max_documents)
        from ..setwise.prompts import check_inputs
        try:
            check_inputs(req.query, docs, req.intent, req.max_select)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        check_select_output(self.setwise.max_new_tokens, len(docs), req.max_select)
        self._check_alive()
        deadline = self._deadline()
        rid = uuid.uuid4().hex
        with self.admit():
            clock = QueueClock(time.perf_counter())
            try:  # the prompt is built in the tokenizer pool; the model work runs as engine steps
                enc = await self._tokenize(deadline, is_disconnected, (req.query, req.intent, *docs),
                                           self._encode_select, req, docs)
            except (ValueError, TypeError) as e:
                raise APIError(400, str(e)) from None
            async with self.hold_tokens(select_tokens(enc, self.setwise.max_new_tokens), is_disconnected, deadline):
                job = submit(self.engine.submit_select, enc, rid, clock)
                sel = await wait_job(self.engine, job, is_disconnected, deadline, self._timed_out)
        return select_body(sel, rid, self.model_name)
