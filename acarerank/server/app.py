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

The gate runs before FastAPI reads anything: while draining, every API request gets 503;
with an API key set, a request without ``Authorization: Bearer <key>`` (or ``X-API-Key``)
gets 401; a body over ``max_body_bytes`` gets 413. ``/health``, ``/ready`` and ``/metrics``
are open (probes and scrapers carry no key). Every error is ``{"error": {"message", "type",
"code"}}``; only a fault of the server itself is a 500.
"""
from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import APIError, error_body, error_bytes
from .schemas import ErrorResponse, RerankRequest, RerankResponse, SelectRequest, SelectResponse, TEIRank
from .service import ClientGone

log = logging.getLogger("acarerank.server")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
RERANK_PATHS = ("/v1/rerank", "/v2/rerank", "/rerank")
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024   # 1,000 documents of ~32 kB each
CLIENT_CLOSED = 499                         # nginx's status for "client closed request" (metrics only)


@dataclass
class GateState:
    """Shared between the gate and whoever drains the server (the SIGTERM handler)."""
    draining: bool = False
    in_flight: int = 0     # API requests past the gate and not yet answered


def _endpoint(path: str) -> str:
    return path if path in OPEN_PATHS or path in RERANK_PATHS or path in ("/v1/select", "/v1/models") else "other"


async def _send_error(send, status: int, message: str, headers: Optional[dict] = None) -> None:
    body = error_bytes(status, message)
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


class Gate:
    """ASGI middleware: metrics of every response, then drain / API key / body-size checks.

    The body is read here (at most ``max_body_bytes`` + 1 bytes) and replayed to the app, so an
    oversized body is refused before it is parsed; after the replay ``receive`` is the
    server's own, which is how a handler learns that its client disconnected.
    """

    def __init__(self, app, state: GateState, metrics, api_key: Optional[str], max_body_bytes: int):
        self.app = app
        self.state = state
        self.metrics = metrics
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

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
            await self._gate(scope, receive, send_counted)
        finally:
            self.metrics.observe_response(_endpoint(scope["path"]), status["code"], time.perf_counter() - t0)

    async def _gate(self, scope, receive, send):
        if scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await _send_error(send, 503, "server is draining (shutting down); retry on another replica",
                                     {"Retry-After": "1", "Connection": "close"})
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if self.api_key is not None and not self._authorized(headers):
            return await _send_error(send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                     {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await _send_error(send, 413, f"request body of {int(length)} bytes exceeds the limit of "
                                                f"{self.max_body_bytes} bytes")
        chunks, size = [], 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                return await _send_error(send, 413, f"request body exceeds the limit of {self.max_body_bytes} bytes")
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        self.state.in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.in_flight -= 1

    def _authorized(self, headers: dict) -> bool:
        given = None
        auth = headers.get("authorization")
        if auth is not None and auth[:7].lower() == b"bearer ":
            given = auth[7:].strip()
        elif "x-api-key" in headers:
            given = headers["x-api-key"].strip()
        return given is not None and hmac.compare_digest(given, self.api_key)


def create_app(service, *, api_key: Optional[str] = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               state: Optional[GateState] = None) -> FastAPI:
    """The FastAPI app over ``service`` (``RerankService`` or anything with the same methods).

    ``state``: the drain flag and in-flight count, shared with a SIGTERM handler (a new one if None).
    """
    state = state or GateState()
    app = FastAPI(title="acarerank", summary="Qwen3 LLM rerankers: pointwise (ACARe) and setwise (AdaTutoRank)",
                  responses={code: {"model": ErrorResponse} for code in (400, 401, 413, 422, 429, 503)})
    app.state.gate = state
    app.state.service = service

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(error_body(exc.status, exc.message, exc.type), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        problems = []
        if any(err.get("type") == "json_invalid" for err in exc.errors()):
            return JSONResponse(error_body(422, "malformed JSON body: " + "; ".join(
                str(err.get("ctx", {}).get("error", err.get("msg"))) for err in exc.errors())), status_code=422)
        for err in exc.errors()[:5]:
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg')}")
        return JSONResponse(error_body(422, "invalid request: " + "; ".join(problems)), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), status_code=500)

    async def _rerank(req: RerankRequest, request: Request):
        headers = {}
        try:
            body = await service.rerank(req, request.is_disconnected, headers)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(body, headers=headers)

    for path in RERANK_PATHS:
        app.add_api_route(path, _rerank, methods=["POST"], response_model=None,
                          responses={200: {"model": RerankResponse | list[TEIRank]}},
                          summary="Rerank documents against a query (Cohere v2 / Jina / vLLM / TEI bodies)")

    @app.post("/v1/select", responses={200: {"model": SelectResponse}})
    async def select(req: SelectRequest, request: Request):
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

    app.add_middleware(Gate, state=state, metrics=service.metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    return app
