"""The gate: ASGI middleware that answers what needs no body, then reads the body under its limits.

It runs before FastAPI reads anything, in this order: a head (request line and headers) over
``MAX_HEAD_BYTES`` gets 431; while draining, every API request gets 503; with an API key set, a
request without ``Authorization: Bearer <key>`` (or ``X-API-Key``) gets 401; a declared body over
``max_body_bytes`` gets 413; an API POST with a ``Content-Encoding`` (gzip, ...) gets 415; a queue
already full gets 429 (``service.refuse_if_full``: a look, no slot taken), and so does one more
upload than ``max_uploads`` (``--max-uploads``), both before the body is read; then the body is
read within ``body_timeout`` seconds (408 after), and one over ``max_body_bytes`` gets 413; only
then does the request take its ``--max-queue`` slot (``service.admit``), a 429 if the queue
filled meanwhile. As nginx buffers a body before the upstream sees it: a client that sends half
a body and stalls holds one of ``max_uploads`` until ``body_timeout``, never a queue slot, so a
few stalled uploads cannot refuse every other client (docs/serving.md, "Limits and timeouts").
Only a POST to an API path is admitted, so only it may send up to ``max_body_bytes``; any other
request's body (an unknown path, a wrong method) is capped at ``LINGER_BYTES`` (413) and
``LINGER_S`` (408), at most ``LINGER_READS`` read at once (429), else such requests, uncounted by
``--max-uploads`` and ``--max-queue``, could each hold ``max_body_bytes`` for ``body_timeout``.
Paths are compared as the app routes them (``errors.route_path``: under Ray Serve's
``route_prefix``, without it).
An early answer first reads and drops a small
declared body (nginx's lingering close, bounded by ``LINGER_BYTES`` and ``LINGER_S``). A client
that leaves during the upload is counted as 499 (nginx's "client closed request") and logged in one
line per ``LOG_EVERY_S`` at most, with the count since the last. ``GateState`` is shared with the SIGTERM drain (``front.py``), which waits for requests still
uploading as for admitted ones. ``/health``, ``/ready`` and
``/metrics`` pass straight through (probes and scrapers carry no key).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from .config import DEFAULT_MAX_UPLOADS, MAX_HEAD_BYTES
from .errors import ANSWERED_BY_PROTOCOL, CLIENT_CLOSED, APIError, error_for, log_safe, route_path

log = logging.getLogger("acarerank.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
LOG_EVERY_S = 10.0   # at most one line per this many seconds for a client-triggered event (_RateLimited)
RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")
SCORE_PATHS = ("/score", "/v1/score")   # vLLM's score API (vLLM serves both)
API_PATHS = frozenset(RERANK_PATHS + SCORE_PATHS + ("/v1/select",))
LINGER_BYTES = 64 * 1024    # an early answer (401, 413, 429) first reads and drops a declared body up to this
LINGER_S = 2.0              # ... for at most this many seconds (and a non-API request's body: it, at most)
#: non-API requests (an unknown path, a wrong method) whose body is being read at once; one more is
#: a 429 at its head. Uncounted, 140 clients stalling such bodies held every request a Ray Serve
#: ingress takes (its max_ongoing_requests), and its proxy queued the probes behind them unanswered.
LINGER_READS = 16


class _RateLimited:
    """One log line per ``every`` seconds at ``level``, with the count of events since the last line
    (a client can trigger them at will: one line each let it flood the log)."""

    def __init__(self, every: float = LOG_EVERY_S, level: int = logging.WARNING):
        self.every = every
        self.level = level
        self.last = -float("inf")
        self.count = 0

    def __call__(self, message: str) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.log(self.level, "%s (%d since the last such line)", message, self.count)
            self.last, self.count = now, 0


@dataclass
class GateState:
    """Shared between the gate and whoever drains the server (the SIGTERM handler)."""
    draining: bool = False
    in_flight: int = 0     # API requests past the drain, key and 429 checks and not yet answered (uploads included)
    uploading: int = 0     # API POSTs whose body is being read (at most the gate's max_uploads)
    lingering: int = 0     # non-API requests whose body is being read (at most LINGER_READS)
    tasks: set = field(default_factory=set)   # their asyncio tasks (the drain deadline cancels them)
    expired: bool = False  # the drain deadline passed: what is still in flight is answered 503
    stopping: bool = False  # stopping with no drain (SIGINT, a dead engine): a request the stop cancels gets 503

    def expire(self) -> None:
        """On the event loop: answer every request still in flight with 503 (the gate sends it)."""
        self.expired = True
        for task in list(self.tasks):
            task.cancel("drain deadline")


def _endpoint(path: str) -> str:
    return path if path in OPEN_PATHS or path in API_PATHS or path == "/v1/models" else "other"


async def _send_error(scope, send, status: int, message: str, headers: Optional[dict] = None) -> None:
    body = json.dumps(error_for(scope, status, message)).encode()   # TEI's shape on its route (errors.py)
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


class _Upload(Exception):
    """The request ended during its upload: ``status`` for the metrics (and a response unless 499)."""

    def __init__(self, status: int, message: str = ""):
        self.status = status
        self.message = message


class Gate:
    """ASGI middleware: metrics of every response, then drain / API key / admission / body checks.

    The body is read here (at most ``max_body_bytes`` + 1 bytes, within ``body_timeout``
    seconds; at most ``max_uploads`` API POST bodies at once) and replayed to the app once the
    request holds its ``--max-queue`` slot; after the replay ``receive`` is the server's own, which is
    how a handler learns that its client disconnected.
    """

    def __init__(self, app, state: GateState, service, api_key: Optional[str], max_body_bytes: int,
                 body_timeout: float, max_uploads: int = DEFAULT_MAX_UPLOADS):
        self.app = app
        self.state = state
        self.metrics = service.metrics
        self.admit = getattr(service, "admit", None)
        self.refuse_if_full = getattr(service, "refuse_if_full", None)
        self.max_uploads = max_uploads
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        # 2,000 uploads cut short in 0.4 s wrote 2,000 lines (docs/serving.md, "Errors")
        self._cut_log = _RateLimited(level=logging.INFO)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = {"code": 500}

        async def send_counted(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self._gate(scope, receive, send_counted, status)
        finally:
            self.metrics.observe_response(_endpoint(route_path(scope)), status["code"], time.perf_counter() - t0)

    async def _gate(self, scope, receive, send, status):
        query = scope.get("query_string") or b""   # not in raw_path: a 60 kB query string was served
        head = (len(scope.get("raw_path") or b"") + (len(query) + 1 if query else 0)
                + sum(len(k) + len(v) + 4 for k, v in scope["headers"]))
        if head > MAX_HEAD_BYTES:
            return await _send_error(scope, send, 431, f"request line and headers of {head} bytes exceed "
                                                       f"{MAX_HEAD_BYTES} bytes", {"Connection": "close"})
        path = route_path(scope)
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await _send_error(scope, send, 503, "server is draining (shutting down); retry on another "
                                                       "replica", {"Retry-After": "1", "Connection": "close"})
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        length = headers.get("content-length")
        length = int(length) if length is not None and length.isdigit() else None
        if self.api_key is not None and not self._authorized(headers):
            return await self._refuse(scope, receive, send, status, length, 401, "missing or wrong API key: "
                                      "send 'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"})
        # only a POST to an API path takes a body worth reading, and only it is admitted (counted
        # against --max-queue): any other request's body is capped at LINGER_BYTES, so requests that
        # bypass admission (an unknown path, a wrong method) cannot hold max_body_bytes each
        api_post = path in API_PATHS and scope["method"] == "POST"
        if api_post:
            limit, flag = self.max_body_bytes, " (--max-body-bytes)"
        else:
            limit = LINGER_BYTES
            flag = f" for {scope['method']} {log_safe(path)} (only a POST to {', '.join(sorted(API_PATHS))} takes more)"
        if length is not None and length > limit:
            return await self._refuse(scope, receive, send, status, length, 413, f"request body of {length} "
                                      f"bytes exceeds the limit of {limit} bytes{flag}")
        encoding = headers.get("content-encoding", b"").strip().lower()
        if api_post and encoding not in (b"", b"identity"):
            # a compressed body would reach the JSON decoder as bytes it calls malformed (a 422 that
            # hides the cause); inflating it would let a small upload exceed --max-body-bytes
            return await self._refuse(scope, receive, send, status, length, 415, f"Content-Encoding "
                                      f"{encoding.decode('latin-1')!r} is not supported: send the JSON body "
                                      f"uncompressed", {"Accept-Encoding": "identity"})
        if api_post:
            try:
                if self.refuse_if_full is not None:
                    self.refuse_if_full()   # a full queue: 429 before a byte of the body is read
            except APIError as e:
                return await self._refuse(scope, receive, send, status, length, e.status, e.message, e.headers)
            if self.state.uploading >= self.max_uploads:
                return await self._refuse(scope, receive, send, status, length, 429, f"server busy: "
                                          f"{self.state.uploading} request bodies being received (--max-uploads "
                                          f"{self.max_uploads}); retry later", {"Retry-After": "1"})
        lingers = not api_post and ((length or 0) > 0 or "transfer-encoding" in headers)   # a body to read
        if lingers and self.state.lingering >= LINGER_READS:
            return await _send_error(scope, send, 429, f"server busy: {self.state.lingering} bodies of requests "
                                     f"to no API path being received; retry later",
                                     {"Retry-After": "1", "Connection": "close"})
        slot = contextlib.ExitStack()   # the --max-queue slot, taken once the body has arrived

        async def send_releasing(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                slot.close()   # the slot is free once the answer is written, before the task winds down

        task = asyncio.current_task()
        self.state.tasks.add(task)
        self.state.in_flight += 1
        try:
            await self._read_and_run(scope, receive, send_releasing, status, limit, flag, slot if api_post else None,
                                     lingers)
        except asyncio.CancelledError:
            # cancelled by the drain deadline, or by uvicorn's stop once its grace is over: answered
            # 503 here (uvicorn's own answer to a cancelled request was a text/plain 500)
            if not (self.state.expired or self.state.stopping):
                # else by the server under us: Ray Serve's proxy cancels a request whose client left
                # (uvicorn lets the handler see it, ClientGone); counted as 499 as there, not as a 500
                if status["code"] == 500:   # no response started
                    status["code"] = CLIENT_CLOSED
                raise
            task.uncancel()
            if status["code"] == 500:   # no response started
                why = ("(--drain-timeout)" if self.state.expired
                       else "(stopped without a drain: SIGINT or a dead engine)")
                await _send_error(scope, send, 503, f"server shut down before this request finished {why}; "
                                                    f"retry on another replica", {"Connection": "close"})
        finally:
            slot.close()
            self.state.in_flight -= 1
            self.state.tasks.discard(task)

    async def _refuse(self, scope, receive, send, status, length: Optional[int], code: int, message: str,
                      headers=None):
        """An answer before the body is read. A small declared body is read and dropped first (nginx's
        lingering close, bounded): the connection stays usable and the client, still writing, never
        meets a reset instead of the answer. A larger one (or none declared) closes the connection."""
        headers = dict(headers or {})
        if length is not None and length <= LINGER_BYTES:
            try:
                async with asyncio.timeout(min(self.body_timeout, LINGER_S)):
                    more = length > 0
                    while more:
                        message_ = await receive()
                        if message_["type"] == "http.disconnect":
                            status["code"] = CLIENT_CLOSED
                            return
                        more = message_.get("more_body", False)
            except TimeoutError:
                headers["Connection"] = "close"
        else:
            headers["Connection"] = "close"
        await _send_error(scope, send, code, message, headers)

    async def _read_and_run(self, scope, receive, send, status, limit: int, flag: str,
                            slot: Optional[contextlib.ExitStack], lingers: bool):
        """Read the body, then (an API POST: ``slot`` given) take the ``--max-queue`` slot into
        ``slot`` and run the app. While the body is read the request counts in
        ``state.uploading`` (an API POST) or ``state.lingering`` (``lingers``: any other request with a
        body, read within ``LINGER_S``), whatever ends the read (408, 413, 499, the drain deadline's cancel)."""
        if slot is not None:
            self._count_upload(+1)
        self.state.lingering += lingers
        ended = None
        try:
            body = await self._read_body(receive, limit, flag, self.body_timeout if slot is not None
                                         else min(self.body_timeout, LINGER_S))
        except _Upload as e:
            ended = e
        finally:   # before any answer is written: a client slow to read its 408 holds no upload
            if slot is not None:
                self._count_upload(-1)
            self.state.lingering -= lingers
        if ended is not None:
            if ended.status == CLIENT_CLOSED:
                status["code"] = scope.get(ANSWERED_BY_PROTOCOL, CLIENT_CLOSED)
                if status["code"] != CLIENT_CLOSED:   # the protocol refused it (its trailers) and closed
                    return
                self._cut_log(f"client {_client(scope)} closed the connection during the upload of "
                              f"{log_safe(scope['method'])} {log_safe(scope['path'])}")
                return
            return await _send_error(scope, send, ended.status, ended.message, {"Connection": "close"})
        if slot is not None and self.admit is not None:
            try:
                slot.enter_context(self.admit())
            except APIError as e:   # the queue filled during the upload; the body is read: the connection stays
                return await _send_error(scope, send, e.status, f"the queue filled while this request's body "
                                         f"arrived: {e.message}", e.headers)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _count_upload(self, step: int) -> None:
        self.state.uploading += step
        self.metrics.uploading.set(self.state.uploading)

    async def _read_body(self, receive, limit: int, flag: str, timeout: float) -> bytes:
        chunks, size = [], 0
        try:
            async with asyncio.timeout(timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Upload(CLIENT_CLOSED)
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    more = message.get("more_body", False)
                    if size > limit:
                        raise _Upload(413, f"request body exceeds the limit of {limit} bytes{flag}")
        except TimeoutError:
            why = "(--body-timeout)" if timeout == self.body_timeout else flag.strip()
            raise _Upload(408, f"request body not received within {timeout:g} s {why}; {size} bytes arrived") from None
        return b"".join(chunks)

    def _authorized(self, headers: dict) -> bool:
        given = None
        auth = headers.get("authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        elif "x-api-key" in headers:
            given = headers["x-api-key"].strip()
        return given is not None and hmac.compare_digest(given, self.api_key)


def _client(scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"
