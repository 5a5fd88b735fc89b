"""The HTTP layer: FastAPI routes, the gate (drain, API key, body size), errors and metrics.

Endpoints (see ``schemas.py`` for the bodies):

=========================================  ===================================================
``POST /v1/rerank``, ``/v2/rerank``,       rerank (Cohere v2 / Jina / vLLM shape; ``texts`` →
``/rerank``                                TEI's bare list)
``POST /v1/select``                        setwise selection (AdaTutoRank)
``GET /health``                            liveness: 200 while the process serves HTTP
``GET /ready``                             200 once weights are loaded and a warm-up pass ran;
                                           503 before that and while draining
``GET /v1/models``                         the one model, OpenAI list shape
``GET /metrics``                           Prometheus text format
=========================================  ===================================================

The gate runs before FastAPI reads anything, in this order: a head (request line and
headers) over ``MAX_HEAD_BYTES`` gets 431; while draining, every API
request gets 503; with an API key set, a request without ``Authorization: Bearer <key>`` (or
``X-API-Key``) gets 401; a declared body over ``max_body_bytes`` gets 413; a full queue gets
429 (admission, before the body is read); then the body is read within ``body_timeout``
seconds (408 after), and one over ``max_body_bytes`` gets 413. A client that leaves during the
upload is counted as 499 (nginx's "client closed request") and logged in one line.

The handlers parse the body in a worker thread (``parsing.py``: never on the event loop),
check the per-request limits (characters 413, ``cache_salt`` length 422) and call the service.
``usage.cached_tokens`` goes only to a request that carries a ``cache_salt`` (its own
namespace of the prefix cache) unless the server trusts all its callers (``trust_cache``):
otherwise a caller could learn whether another one sent a given context (docs/serving.md, "Tenancy").

``/health``, ``/ready`` and ``/metrics`` are open (probes and scrapers carry no key). Every
error is ``{"error": {"message", "type", "code"}}``; only a fault of the server itself is a 500.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import DEFAULT_MAX_BODY_BYTES, MAX_HEAD_BYTES, ServeConfig  # noqa: F401 (re-exported)
from .disconnect import ClientGone
from .errors import APIError, error_body, error_bytes
from .parsing import parse_body, validation_message
from .schemas import ErrorResponse, RerankRequest, RerankResponse, SelectRequest, SelectResponse, TEIRank

log = logging.getLogger("acarerank.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")
API_PATHS = frozenset(RERANK_PATHS + ("/v1/select",))
CLIENT_CLOSED = 499                         # nginx's status for "client closed request" (metrics only)
CONTEXT_FIELDS = ("query", "question", "trace", "instruction", "intent")
LINGER_BYTES = 64 * 1024    # an early answer (401, 413, 429) first reads and drops a declared body up to this
LINGER_S = 2.0              # ... for at most this many seconds


@dataclass
class GateState:
    """Shared between the gate and whoever drains the server (the SIGTERM handler)."""
    draining: bool = False
    in_flight: int = 0     # API requests past the drain and key checks and not yet answered
    tasks: set = field(default_factory=set)   # their asyncio tasks (the drain deadline cancels them)
    expired: bool = False  # the drain deadline passed: what is still in flight is answered 503

    def expire(self) -> None:
        """On the event loop: answer every request still in flight with 503 (the gate sends it)."""
        self.expired = True
        for task in list(self.tasks):
            task.cancel("drain deadline")


def _endpoint(path: str) -> str:
    return path if path in OPEN_PATHS or path in API_PATHS or path == "/v1/models" else "other"


async def _send_error(send, status: int, message: str, headers: Optional[dict] = None) -> None:
    body = error_bytes(status, message)
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
    seconds) and replayed to the app; after the replay ``receive`` is the server's own, which is
    how a handler learns that its client disconnected.
    """

    def __init__(self, app, state: GateState, service, api_key: Optional[str], max_body_bytes: int,
                 body_timeout: float):
        self.app = app
        self.state = state
        self.metrics = service.metrics
        self.admit = getattr(service, "admit", None)   # the Ray front admits in the replicas
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout

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
            self.metrics.observe_response(_endpoint(scope["path"]), status["code"], time.perf_counter() - t0)

    async def _gate(self, scope, receive, send, status):
        head = len(scope.get("raw_path") or b"") + sum(len(k) + len(v) + 4 for k, v in scope["headers"])
        if head > MAX_HEAD_BYTES:
            return await _send_error(send, 431, f"request line and headers of {head} bytes exceed {MAX_HEAD_BYTES} "
                                                f"bytes", {"Connection": "close"})
        if scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await _send_error(send, 503, "server is draining (shutting down); retry on another replica",
                                     {"Retry-After": "1", "Connection": "close"})
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        length = headers.get("content-length")
        length = int(length) if length is not None and length.isdigit() else None
        if self.api_key is not None and not self._authorized(headers):
            return await self._refuse(receive, send, status, length, 401, "missing or wrong API key: send "
                                      "'Authorization: Bearer <key>'", {"WWW-Authenticate": "Bearer"})
        if length is not None and length > self.max_body_bytes:
            return await self._refuse(receive, send, status, length, 413, f"request body of {length} bytes "
                                      f"exceeds the limit of {self.max_body_bytes} bytes (--max-body-bytes)")
        slot = contextlib.ExitStack()
        if self.admit is not None and scope["path"] in API_PATHS and scope["method"] == "POST":
            try:
                slot.enter_context(self.admit())   # 429 before a byte of the body is read
            except APIError as e:
                return await self._refuse(receive, send, status, length, e.status, e.message, e.headers)

        async def send_releasing(message):
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                slot.close()   # the slot is free once the answer is written, before the task winds down

        task = asyncio.current_task()
        self.state.tasks.add(task)
        self.state.in_flight += 1
        try:
            await self._read_and_run(scope, receive, send_releasing, status)
        except asyncio.CancelledError:
            if not self.state.expired:
                raise
            task.uncancel()
            if status["code"] == 500:   # no response started: the drain deadline answers it
                await _send_error(send, 503, "server shut down before this request finished (--drain-timeout); "
                                             "retry on another replica", {"Connection": "close"})
        finally:
            slot.close()
            self.state.in_flight -= 1
            self.state.tasks.discard(task)

    async def _refuse(self, receive, send, status, length: Optional[int], code: int, message: str, headers=None):
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
        await _send_error(send, code, message, headers)

    async def _read_and_run(self, scope, receive, send, status):
        try:
            body = await self._read_body(receive)
        except _Upload as e:
            if e.status == CLIENT_CLOSED:
                status["code"] = CLIENT_CLOSED
                log.info("client %s closed the connection during the upload of %s %s", _client(scope),
                         scope["method"], scope["path"])
                return
            return await _send_error(send, e.status, e.message, {"Connection": "close"})
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive) -> bytes:
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Upload(CLIENT_CLOSED)
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    more = message.get("more_body", False)
                    if size > self.max_body_bytes:
                        raise _Upload(413, f"request body exceeds the limit of {self.max_body_bytes} bytes "
                                           f"(--max-body-bytes)")
        except TimeoutError:
            raise _Upload(408, f"request body not received within {self.body_timeout:g} s (--body-timeout); "
                               f"{size} bytes arrived") from None
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


def check_limits(req, config: ServeConfig) -> None:
    """The per-request limits the schema cannot know: ``cache_salt`` length (422), characters (413)."""
    salt = getattr(req, "cache_salt", None)
    if salt is not None and len(salt) > config.max_salt_chars:
        raise APIError(422, f"cache_salt of {len(salt)} characters exceeds the limit of {config.max_salt_chars} "
                            f"characters (--max-salt-chars); send a short tenant or session key (e.g. a hash)")
    chars = sum(len(getattr(req, name, None) or "") for name in CONTEXT_FIELDS)
    chars += sum(map(len, req.document_texts()))
    if chars > config.max_request_chars:
        raise APIError(413, f"request of {chars} characters (query, documents and context together) exceeds the "
                            f"limit of {config.max_request_chars} characters per request (--max-request-chars)")


def create_app(service, config: Optional[ServeConfig] = None, *, api_key: Optional[str] = None,
               max_body_bytes: Optional[int] = None, state: Optional[GateState] = None) -> FastAPI:
    """The FastAPI app over ``service`` (``RerankService`` or anything with the same methods).

    config: the limits (``ServeConfig``; None: the defaults); ``api_key`` and ``max_body_bytes``
    override its fields. state: the drain flag and in-flight requests, shared with a SIGTERM
    handler (a new one if None).
    """
    config = config or ServeConfig()
    api_key = api_key if api_key is not None else config.api_key
    max_body_bytes = max_body_bytes if max_body_bytes is not None else config.max_body_bytes
    state = state or GateState()
    # Parsing holds the GIL in C for its whole run (~0.06 s for a 30 MB body): a pool of two keeps
    # the event loop free between bodies and bounds how many parse at once.
    parse_pool = ThreadPoolExecutor(2, thread_name_prefix="acarerank-parse")
    app = FastAPI(title="acarerank", summary="Qwen3 LLM rerankers: pointwise (ACARe) and setwise (AdaTutoRank)",
                  responses={code: {"model": ErrorResponse} for code in (400, 401, 408, 413, 422, 429, 503)})
    app.state.gate = state
    app.state.service = service
    app.state.parse_pool = parse_pool

    async def parse(request: Request, model_cls):
        body = await request.body()
        req = await asyncio.get_running_loop().run_in_executor(parse_pool, parse_body, body, model_cls)
        check_limits(req, config)
        return req

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.type), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(422, validation_message(exc.errors())), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    async def _rerank(request: Request):
        req = await parse(request, RerankRequest)
        headers = {}
        try:
            body = await service.rerank(req, request.is_disconnected, headers)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(body, dict) and req.cache_salt is None and not config.trust_cache:
            body["usage"].pop("cached_tokens", None)   # the module docstring says why
        return JSONResponse(body, headers=headers)

    for path in RERANK_PATHS:
        app.add_api_route(path, _rerank, methods=["POST"], response_model=None,
                          responses={200: {"model": RerankResponse | list[TEIRank]}},
                          summary="Rerank documents against a query (Cohere v2 / Jina / vLLM / TEI bodies)")

    @app.post("/v1/select", responses={200: {"model": SelectResponse}})
    async def select(request: Request):
        req = await parse(request, SelectRequest)
        headers = {}
        try:
            body = await service.select(req, request.is_disconnected, headers)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body, headers=headers)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if state.draining:
            return JSONResponse(error_body(503, "draining"), status_code=503)
        if not service.ready:
            return JSONResponse(error_body(503, "loading: weights or warm-up pass not done yet"), status_code=503)
        return {"status": "ready", "model": service.model_name}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "owned_by": "acarerank"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.add_middleware(Gate, state=state, service=service, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout=config.body_timeout)
    _document_bodies(app, {path: RerankRequest for path in RERANK_PATHS} | {"/v1/select": SelectRequest})
    return app


def _document_bodies(app: FastAPI, bodies: dict) -> None:
    """Put each route's request schema back into /openapi.json: the handlers take the raw
    ``Request`` (they parse off the event loop), so FastAPI cannot see the body model."""
    generate = app.openapi

    def openapi():
        if app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
