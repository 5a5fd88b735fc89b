"""The HTTP layer: FastAPI routes over the service, errors and metrics, behind the gate (``gate.py``).

Endpoints (see ``schemas.py`` for the bodies):

=========================================  ===================================================
``POST /v1/rerank``, ``/v2/rerank``,       rerank (Cohere v2 / Jina / vLLM shape; ``texts`` →
``/rerank``                                TEI's bare list)
``POST /score``, ``/v1/score``             vLLM's score API: query/document pairs (1 to N, N to N),
                                           scores in input order
``POST /v1/select``                        setwise selection (AdaTutoRank)
``GET /health`` (or ``HEAD``)              liveness: 200 while the model thread's loop runs
                                           (with its state and how long the current model
                                           step has run); 503 once the engine is dead (a step
                                           past ``--max-pass-timeout`` included), or with
                                           ``?max_pass_s=S`` when a step has run longer than S
``GET /ready`` (or ``HEAD``)               200 once weights are loaded and a warm-up pass ran;
                                           503 before that, while draining and once dead (on
                                           Ray Serve's front: while no engine replica can serve)
``GET /v1/models``                         the one model, OpenAI list shape (``id``, ``object``,
                                           ``created``, ``owned_by``)
``GET /metrics`` (or ``HEAD``)             Prometheus text format
=========================================  ===================================================

Before FastAPI reads anything, the gate (``gate.py``) answers head size (431), drain (503),
API key (401), declared body size (413), a full queue and too many uploads (429), then reads the
body within the body timeout (408; 413 past the limit; a client that leaves during the upload is
a 499), then admits the request (its ``--max-queue`` slot; 429 if the queue filled meanwhile).

The handlers parse the body in a worker thread (``parsing.py``: never on the event loop),
check the per-request limits (characters 413, ``cache_salt`` length 422) and call the service.
``usage.cached_tokens`` goes only to a request that carries a ``cache_salt`` (its own
namespace of the prefix cache) unless the server trusts all its callers (``trust_cache``):
otherwise a caller could learn whether another one sent a given context (docs/serving.md, "Tenancy").

``/health``, ``/ready`` and ``/metrics`` are open (probes and scrapers carry no key). Every
error is ``{"error": {"message", "type", "code"}}`` but on TEI's ``/rerank``, which answers TEI's
``{"error", "error_type"}`` (``errors.py`` says when); only a fault of the server itself is a 500.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServeConfig
from .disconnect import ClientGone
from .errors import APIError, error_body, error_for, log_safe
from .gate import CLIENT_CLOSED, RERANK_PATHS, SCORE_PATHS, Gate, GateState
from .parsing import parse_body, validation_message
from .probes import check_max_pass_s, health_problem
from .schemas import (MAX_REQUEST_ID_CHARS, ErrorResponse, RerankRequest, RerankResponse, ScorePairsRequest,
                      ScoreResponse, SelectRequest, SelectResponse, TEIRank)

log = logging.getLogger("acarerank.server")

CONTEXT_FIELDS = ("query", "question", "trace", "instruction", "intent")


def check_limits(req, config: ServeConfig) -> None:
    """The per-request limits the schema cannot know: ``cache_salt`` length (422), characters (413)."""
    salt = getattr(req, "cache_salt", None)
    if salt is not None and len(salt) > config.max_salt_chars:
        raise APIError(422, f"cache_salt of {len(salt)} characters exceeds the limit of {config.max_salt_chars} "
                            f"characters (--max-salt-chars); send a short tenant or session key (e.g. a hash)")
    chars = sum(len(getattr(req, name, None) or "") for name in CONTEXT_FIELDS)
    kwargs = getattr(req, "chat_template_kwargs", None) or {}
    if isinstance(kwargs.get("instruction"), str):   # vLLM's instruction, which wins over the field's
        chars += len(kwargs["instruction"])
    chars += sum(map(len, req.document_texts()))
    if isinstance(req, ScorePairsRequest):   # its query side is a list (the others' query is a context field)
        chars += sum(map(len, req.query_texts()))
    if chars > config.max_request_chars:
        raise APIError(413, f"request of {chars} characters (query, documents and context together) exceeds the "
                            f"limit of {config.max_request_chars} characters per request (--max-request-chars)")


def _new_parse_pool() -> ThreadPoolExecutor:
    # Parsing holds the GIL in C for its whole run (~0.06 s for a 30 MB body): a pool of two keeps
    # the event loop free between bodies and bounds how many parse at once.
    return ThreadPoolExecutor(2, thread_name_prefix="acarerank-parse")


def _end_parse_threads(app: FastAPI) -> None:
    """The app's shutdown handler: the parse threads end with the serving, whoever runs the app
    (run_server, or an application's own uvicorn); a later serve of the same app gets a fresh
    pool, whose threads start on first use. A shutdown event handler, not a ``lifespan=``: with
    one of those FastAPI runs no handler an application adds with ``add_event_handler`` /
    ``on_event`` (its service's stop among them)."""
    pool, app.state.parse_pool = app.state.parse_pool, _new_parse_pool()
    pool.shutdown(wait=False, cancel_futures=True)


def create_app(service, config: Optional[ServeConfig] = None, *, api_key: Optional[str] = None,
               max_body_bytes: Optional[int] = None, state: Optional[GateState] = None) -> FastAPI:
    """The FastAPI app over ``service`` (``RerankService`` or anything with the same methods).

    config: the limits (``ServeConfig``; None: the defaults); ``api_key`` and ``max_body_bytes``
    override its fields; ``max_uploads`` left out is the larger of 64 and what the service admits at
    once (its ``admission_limit``: a ``RerankService``'s own ``max_queue``, which ``config.max_queue``
    need not be; a Ray front's share). state: the drain flag and in-flight requests, shared with a SIGTERM
    handler (a new one if None).

    The app holds the service in ``app.state`` only: the route handlers are this module's functions
    and read it from ``request.app.state``. FastAPI keeps module-level caches keyed by the handler
    functions (about 4,096 entries), so handlers that closed over the service kept every dropped
    app's service (its model weights, its cache pool) alive. The parse threads end at the app's
    lifespan shutdown.
    """
    config = config or ServeConfig()
    api_key = api_key if api_key is not None else config.api_key
    max_body_bytes = max_body_bytes if max_body_bytes is not None else config.max_body_bytes
    state = state or GateState()
    app = FastAPI(title="acarerank", summary="Qwen3 LLM rerankers: pointwise (ACARe) and setwise (AdaTutoRank)",
                  responses={code: {"model": ErrorResponse} for code in (400, 401, 408, 413, 415, 422, 429, 503)})
    app.router.add_event_handler("shutdown", functools.partial(_end_parse_threads, app))
    app.state.gate = state
    app.state.service = service
    app.state.config = config
    app.state.parse_pool = _new_parse_pool()
    # no list of a request is read past the documents the service takes (parsing.py): its own limit
    # where it has one (a RerankService built with another than config's), else config's
    app.state.max_items = getattr(service, "max_documents", None) or config.max_documents
    app.state.created = int(time.time())   # OpenAI's Model has a required `created` (Unix seconds); vLLM sends its start

    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
    for path in RERANK_PATHS:
        app.add_api_route(path, _rerank, methods=["POST"], response_model=None,
                          responses={200: {"model": RerankResponse | list[TEIRank]}},
                          summary="Rerank documents against a query (Cohere v2 / Jina / vLLM / TEI bodies)")
    for path in SCORE_PATHS:
        app.add_api_route(path, _score, methods=["POST"], response_model=None,
                          responses={200: {"model": ScoreResponse}},
                          summary="Score query/document pairs (vLLM's score API: text_1/text_2, queries/documents, "
                                  "data_1/data_2)")
    app.add_api_route("/v1/select", _select, methods=["POST"], name="select",
                      responses={200: {"model": SelectResponse}})
    app.add_api_route("/health", _health, methods=["GET"], name="health")
    app.add_api_route("/ready", _ready, methods=["GET"], name="ready")
    app.add_api_route("/v1/models", _models, methods=["GET"], name="models")
    app.add_api_route("/metrics", _metrics, methods=["GET"], name="metrics")
    # the probes take HEAD too (the GET, its body dropped by uvicorn): the connection cap's reserve
    # admits it (docs/serving.md, "What to probe") and some load balancers' checks send it. Routes of
    # their own, out of the schema: one route of both methods is two operations of one id in it
    for path, handler in (("/health", _health), ("/ready", _ready), ("/metrics", _metrics)):
        app.add_api_route(path, handler, methods=["HEAD"], include_in_schema=False)

    # never below the queue the service admits to (docs/serving.md, "Limits and timeouts"): under
    # create_app(service) config.max_queue is only the default's 512, and a Ray front admits its share
    max_uploads = config.uploads_beside(getattr(service, "admission_limit", None))
    app.add_middleware(Gate, state=state, service=service, api_key=api_key, max_body_bytes=max_body_bytes,
                       body_timeout=config.body_timeout, max_uploads=max_uploads)
    _document_bodies(app, {path: RerankRequest for path in RERANK_PATHS} | {path: ScorePairsRequest for path in SCORE_PATHS}
                     | {"/v1/select": SelectRequest})
    return app


async def _parse(request: Request, model_cls):
    app_state = request.app.state
    body = await request.body()
    # the body's top-level fields pick the error shape on TEI's route (errors.speaks_tei), once
    # the parse has ended: set before it, a request cut during it (the drain deadline's 503)
    # got the shape of however far the worker thread had got
    fields = set()
    try:
        req = await asyncio.get_running_loop().run_in_executor(app_state.parse_pool, parse_body, body, model_cls,
                                                               fields, app_state.max_items)
    except APIError:   # the worker ended: the fields it found, if any (none: not parsed)
        request.state.body_fields = fields
        raise
    request.state.body_fields = fields
    check_limits(req, app_state.config)
    return req


async def _api_error(request: Request, exc: APIError):
    return JSONResponse(error_for(request.scope, exc.status, exc.message, exc.type), status_code=exc.status,
                        headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError):
    return JSONResponse(error_for(request.scope, 422, validation_message(exc.errors())), status_code=422)


async def _http_error(request: Request, exc: StarletteHTTPException):
    return JSONResponse(error_for(request.scope, exc.status_code, str(exc.detail)),
                        status_code=exc.status_code, headers=getattr(exc, "headers", None))


async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error on %s", log_safe(request.url.path))
    return JSONResponse(error_for(request.scope, 500, f"internal error: {type(exc).__name__}"),
                        status_code=500)


async def _rerank(request: Request):
    req = await _parse(request, RerankRequest)
    service, config = request.app.state.service, request.app.state.config
    headers = {}
    try:
        body = await service.rerank(req, request.is_disconnected, headers)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if isinstance(body, dict) and req.cache_salt is None and not config.trust_cache:
        body["usage"].pop("cached_tokens", None)   # the module docstring says why
    # msgspec: an object document goes back as the raw JSON it came in (schemas.py, parsing.py)
    return Response(msgspec.json.encode(body), media_type="application/json", headers=headers)


async def _score(request: Request):
    req = await _parse(request, ScorePairsRequest)
    service, config = request.app.state.service, request.app.state.config
    header_id = request.headers.get("x-request-id")
    if getattr(service, "proxy_sets_request_id", False) and req.request_id is not None:
        header_id = None   # Ray Serve's proxy sets the header on every request: the body's id is the client's
    if header_id is not None:   # vLLM's score id: its X-Request-Id header wins over the body's request_id
        if len(header_id) > MAX_REQUEST_ID_CHARS:
            raise APIError(422, f"X-Request-Id of {len(header_id)} characters exceeds the limit of "
                                f"{MAX_REQUEST_ID_CHARS} (it is echoed in the response's id)")
        req.request_id = header_id
    headers = {}
    try:
        body = await service.score(req, request.is_disconnected, headers)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    if req.cache_salt is None and not config.trust_cache:
        body["usage"].pop("cached_tokens", None)   # the module docstring says why
    return JSONResponse(body, headers=headers)


async def _select(request: Request):
    req = await _parse(request, SelectRequest)
    headers = {}
    try:
        body = await request.app.state.service.select(req, request.is_disconnected, headers)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(body, headers=headers)


async def _health(request: Request, max_pass_s: Optional[float] = None):
    """Answered on the event loop from the engine's heartbeat: it never waits for the model."""
    try:
        check_max_pass_s(max_pass_s)
    except ValueError as e:
        return JSONResponse(error_body(422, str(e)), status_code=422)
    service = request.app.state.service
    h = service.health() if hasattr(service, "health") else {"state": "idle", "busy_s": 0.0}
    problem = health_problem(h, max_pass_s)
    if problem is not None:
        return JSONResponse(dict(error_body(503, problem), engine=h), status_code=503)
    return {"status": "ok", "engine": h}


async def _ready(request: Request):
    service = request.app.state.service
    dead = getattr(service, "dead", None)
    if dead is not None:
        return JSONResponse(error_body(503, f"engine dead: {dead}"), status_code=503)
    if request.app.state.gate.draining:
        return JSONResponse(error_body(503, "draining"), status_code=503)
    if not service.ready:
        return JSONResponse(error_body(503, "loading: weights or warm-up pass not done yet"), status_code=503)
    readiness = getattr(service, "readiness", None)   # engines elsewhere (Ray Serve's front): ask them
    problem = await readiness() if readiness is not None else None
    if problem is not None:
        return JSONResponse(error_body(503, problem), status_code=503)
    return {"status": "ready", "model": service.model_name}


async def _models(request: Request):
    return {"object": "list", "data": [{"id": request.app.state.service.model_name, "object": "model",
                                        "created": request.app.state.created, "owned_by": "acarerank"}]}


async def _metrics(request: Request):
    service = request.app.state.service
    render = getattr(service, "render_metrics", None)   # engines elsewhere (Ray Serve's front): theirs too
    # off the event loop: a scrape waits for the prefix cache's figures (metrics._CacheCollector)
    body = await render() if render is not None else await asyncio.to_thread(service.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


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
