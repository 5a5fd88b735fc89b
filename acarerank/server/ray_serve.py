"""Past one machine: the same server as Ray Serve deployments (Ray does the placement and routing).

Two deployments:

* ``RerankReplica`` — one engine per replica (a ``RerankService``: model, scheduler thread,
  tokenization pool, prefix cache). Routed by Ray's consistent-hash router over the request's
  ``session_id``, so requests of one context land on one replica and its prefix cache keeps
  hitting; when that replica is saturated Ray falls back to the next one on the ring.
* ``RerankIngress`` — the HTTP app of ``app.py`` unchanged (routes, schemas, ``gate.py``, errors,
  metrics of its own requests), whose service forwards each parsed request to the replicas
  with ``session_id = routing_key(request)``, after admitting it once its body has arrived
  (``RemoteService.admit``: its share of every replica's ``max_queue`` together, split over the
  ingress replicas; a full front refuses at the head, before the body). Its ``/ready`` asks every replica's engine
  (``RemoteService.readiness``): 503 while none can serve (docs/serving.md, "Past one machine");
  its ``/metrics`` adds every replica's series, labelled ``replica`` (``RemoteService.render_metrics``).

The routing key is the stable part of a request's context: ``cache_salt``, ``question`` and
``instruction``, the same on every call of an agent session (the trace is left out: it grows
on every call). A request with none of them carries no key and is spread over the replicas;
an agent without a question gets affinity by sending a ``cache_salt`` (per session or tenant).

    app = build_app(model="/models/acare-4b", num_replicas=4, replica_options={"num_gpus": 1})
    serve.run(app, route_prefix="/")        # a cluster: docs/serving.md, "Past one machine: Ray Serve"
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from typing import Optional

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from .. import malloc_tuning
from .app import create_app
from .build import build_service
from .config import ServeConfig
from .disconnect import wait_or_drop
from .errors import APIError, error_body
from .metrics import ServerMetrics
from .probes import check_max_pass_s, health_problem
from .schemas import RerankRequest, ScorePairsRequest, SelectRequest

CONSISTENT_HASH_ROUTER = "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter"
REPLICA_HEADER = "x-acarerank-replica"
#: the ingress's ``/ready`` answers from a probe of the replicas at most this old (seconds): a
#: probe every second at most per ingress, however often the orchestrator asks
READY_PROBE_TTL_S = 1.0
#: a probe whose replicas have not all answered by then is a 503: a replica answers its ``health``
#: on its event loop, never waiting for the model, in milliseconds
READY_PROBE_TIMEOUT_S = 5.0
#: a scrape of the front's ``/metrics`` waits at most this long for the replicas' series (seconds);
#: a replica that has not answered by then is left out of that scrape
METRICS_TIMEOUT_S = 5.0
#: requests an ingress replica takes beyond what the engine replicas can hold: probes, scrapes and
#: refusals are answered while every engine is full (Ray queues what is over a deployment's
#: ``max_ongoing_requests`` at its proxy, with no bound and no answer)
INGRESS_SPARE_REQUESTS = 64
#: ``ServeConfig`` fields of the HTTP connection that Ray Serve's proxy owns (``serve.start(http_options=...)``:
#: host, port, ``keep_alive_timeout_s``, ``request_timeout_s``) or its replicas' lifecycle
#: (``graceful_shutdown_timeout_s``, ``logging_config``): ``build_app`` refuses them rather than ignore them
RAY_OWNED_OPTIONS = ("host", "port", "header_timeout", "keepalive_timeout", "send_timeout", "max_connections",
                     "drain_timeout", "log_level")


def routing_key(req) -> Optional[str]:
    """sha1 of the request's stable context (``cache_salt``, ``question``, ``instruction``); None without.

    The instruction is the one scored: vLLM's ``chat_template_kwargs["instruction"]`` wins over the
    field (``request_checks.check_vllm_options``); read from the field alone, a context sent that way had
    no key and its requests were spread over the replicas, each prefilling it again."""
    kwargs = getattr(req, "chat_template_kwargs", None)
    instruction = getattr(req, "instruction", None)
    if isinstance(kwargs, dict) and isinstance(kwargs.get("instruction"), str):
        instruction = kwargs["instruction"]
    parts = [getattr(req, "cache_salt", None), getattr(req, "question", None), instruction]
    if all(p is None for p in parts):
        return None
    return hashlib.sha1("\x00".join(p or "" for p in parts).encode()).hexdigest()


async def _never_disconnected() -> bool:
    return False  # a replica call is cancelled by Ray when its HTTP client leaves


@serve.deployment(request_router_config=RequestRouterConfig(request_router_class=CONSISTENT_HASH_ROUTER))
class RerankReplica:
    """One engine, as ``config`` asks (the same ``ServeConfig`` as ``acarerank serve``)."""

    def __init__(self, config: ServeConfig, health_max_pass_s: Optional[float] = None):
        check_max_pass_s(health_max_pass_s)
        if config.malloc == "tuned":  # a replica's process is ours, as acarerank serve's (--malloc)
            malloc_tuning.tune_malloc()
        self.service = build_service(config).start(warmup=True)
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.health_max_pass_s = health_max_pass_s

    def check_health(self) -> None:
        """Ray Serve's liveness probe of this replica (every ``health_check_period_s``, 10 s by
        default): raising marks it unhealthy and Ray replaces it with a fresh one. The rule of
        ``GET /health`` (``probes.health_problem``): a dead or stopped engine, or, when
        ``health_max_pass_s`` is set, one model step running longer than that. Without this a dead
        engine would answer 503 to every request routed to it for as long as the replica lived.
        The ingress's ``/ready`` calls it on every replica too (``RemoteService.readiness``): Ray
        takes a replica out of routing only after three failed checks. Never waits for the model."""
        problem = health_problem(self.service.health(), self.health_max_pass_s)
        if problem is not None:
            raise RuntimeError(f"replica {self.replica}: {problem}")

    async def call(self, method: str, body: dict):
        """(status, JSON body, headers) of ``rerank``, ``score`` or ``select``; errors as values, not exceptions."""
        headers = {REPLICA_HEADER: self.replica}
        try:
            if method == "rerank":
                out = await self.service.rerank(RerankRequest.model_validate(body), _never_disconnected, headers)
            elif method == "score":
                out = await self.service.score(ScorePairsRequest.model_validate(body), _never_disconnected, headers)
            elif method == "select":
                out = await self.service.select(SelectRequest.model_validate(body), _never_disconnected, headers)
            else:
                return 404, error_body(404, f"unknown method {method!r}"), {}
        except APIError as e:
            return e.status, error_body(e.status, e.message, e.type), e.headers
        return 200, out, headers

    def model_name(self) -> str:
        return self.service.model_name

    def metrics(self) -> tuple:
        """(this replica's id, its engine's metric families: ``ServerMetrics.registry.collect()``),
        for the front's ``/metrics`` (``RemoteService.render_metrics``). Read at the call, on the
        replica's event loop: it never waits for the model."""
        return self.replica, list(self.service.metrics.registry.collect())

    def __del__(self):
        service = getattr(self, "service", None)
        if service is not None:
            service.stop()


def _short(exc: BaseException, limit: int = 300) -> str:
    """One line for an exception a replica raised: its cause's type and message (Ray wraps it in a
    ``RayTaskError`` whose text holds the whole remote traceback), cut at ``limit`` characters."""
    cause = getattr(exc, "cause", None) or exc
    text = f"{type(cause).__name__}: {cause}".splitlines()[0] if str(cause) else type(cause).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def front_share(max_queue: int, num_replicas: int, ingress_replicas: int) -> int:
    """Requests one ingress front admits at once: its share of every engine replica's
    ``max_queue`` together, ``ceil(max_queue × num_replicas / ingress_replicas)``, at least 1
    (``RemoteService.limit``)."""
    return max(1, math.ceil(max_queue * num_replicas / ingress_replicas))


class RemoteService:
    """The ingress's service: forwards parsed requests to ``RerankReplica`` through a handle.

    ``/ready`` asks the replicas (``readiness``): Ray keeps a replica whose engine died in its
    routing table until three of its health checks failed (30 s and more at Ray's defaults), and
    while it restarts every replica none runs; all that time requests would get 503s from a front
    that said it was ready."""

    ready = True  # loaded: the ingress is built after a replica answered; whether one can serve is readiness()
    #: Ray Serve's proxy gives every request an ``X-Request-Id`` header (the client's, else its own), so the
    #: score route's ``id`` takes the body's ``request_id`` where one is sent (app.py; header first elsewhere)
    proxy_sets_request_id = True

    def __init__(self, handle, model_name: str, max_queue: Optional[int] = None, num_replicas: int = 1,
                 ingress_replicas: int = 1):
        self.handle = handle
        self.model_name = model_name
        # the front's own count: its share of every engine replica's max_queue together (None: not counted here)
        self.max_queue, self.num_replicas, self.ingress_replicas = max_queue, num_replicas, ingress_replicas
        self.admitted = 0
        self.metrics = ServerMetrics(engine=False)   # its HTTP requests; the engines' series: render_metrics
        self._probed: Optional[tuple] = None        # (monotonic time, problem or None) of the last probe
        self._probing: Optional[asyncio.Future] = None

    @property
    def limit(self) -> Optional[int]:
        """Requests this front admits at once: its share of every engine replica's ``max_queue``
        together, ``ceil(max_queue × num_replicas / ingress_replicas)`` (at least 1). Each front
        counts alone (a shared count would cost a Ray call before every body), so with the whole
        ``max_queue × num_replicas`` each, ``ingress_replicas`` fronts together admitted that many
        times what the engines hold, the rest read and held at the fronts until an engine refused
        it. Ray's proxy sends each request to the less loaded of two ingress replicas, so the
        shares fill about evenly; rounded up, the fronts together admit at most
        ``ingress_replicas - 1`` more than the engines hold. None: not counted."""
        if self.max_queue is None:
            return None
        return front_share(self.max_queue, self.num_replicas, self.ingress_replicas)

    @property
    def admission_limit(self) -> Optional[int]:
        """``limit``: what the gate's default upload bound follows (None: not counted here)."""
        return self.limit

    @contextlib.contextmanager
    def admit(self):
        """Hold one of this front's ``limit`` slots for the duration of a request, or raise 429 —
        taken by the gate once the body has arrived, as ``RerankService.admit`` is on ``acarerank
        serve`` (a full front's 429 comes before the body: ``refuse_if_full``). Each replica still
        applies its own ``max_queue`` (a context's requests go to one replica); this bounds the
        bodies the front holds at once, which only Ray's ``max_ongoing_requests`` bounded before,
        and past which Ray's proxy held requests with no answer (the bodies being read are the
        gate's ``max_uploads``). On the event loop only (the gate's)."""
        limit = self.limit
        if limit is None:
            yield
            return
        self.refuse_if_full()
        self.admitted += 1
        try:
            yield
        finally:
            self.admitted -= 1

    def refuse_if_full(self) -> None:
        """``admit``'s 429 if this front has no slot free now, taking none (the gate's check at a
        request's head, before its body is read)."""
        limit = self.limit
        if limit is not None and self.admitted >= limit:
            share = f"; this front's share of {self.ingress_replicas} ingress replicas: {limit}" \
                if self.ingress_replicas > 1 else ""
            raise APIError(429, f"server busy: {self.admitted} requests in flight at this front (--max-queue "
                                f"{self.max_queue} × {self.num_replicas} engine replicas{share}); retry later",
                           headers={"Retry-After": "1"})

    def health(self) -> dict:
        """``/health`` on the front: its own liveness (it runs); the engines' is Ray's ``check_health``
        of each replica, and whether any can serve is ``/ready``."""
        return dict(state="ingress", busy_s=0.0)

    async def readiness(self) -> Optional[str]:
        """None while at least one engine replica can serve; else why not (the ``/ready`` 503).

        One broadcast of ``RerankReplica.check_health`` (the rule of ``/health`` and of Ray's own
        health check) to every replica the handle's router knows, shared by all the probes of
        ``READY_PROBE_TTL_S`` seconds (a single probe in flight); awaited, so the event loop never
        blocks on it."""
        if self._probed is not None and time.monotonic() - self._probed[0] < READY_PROBE_TTL_S:
            return self._probed[1]
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._probe_replicas())
        return await asyncio.shield(self._probing)   # a probe client that leaves does not cancel it

    async def _probe_replicas(self) -> Optional[str]:
        try:
            answers = await self.handle.broadcast("check_health").results_async(
                timeout_s=READY_PROBE_TIMEOUT_S, return_exceptions=True)
        except DeploymentUnavailableError as e:   # no replica running (all gone, or starting)
            problem = f"no engine replica is running ({e})"
        except TimeoutError:
            problem = f"the engine replicas did not all answer the readiness probe within {READY_PROBE_TIMEOUT_S:g} s"
        except RayError as e:
            problem = f"the engine replicas could not be probed ({_short(e)})"
        else:
            # check_health returns None for a replica that can serve, raises why not (or the replica
            # is gone: ActorDiedError)
            problems = [_short(a) for a in answers if isinstance(a, BaseException)]
            problem = None if len(problems) < len(answers) else \
                f"no engine replica can serve ({len(answers)} probed: {'; '.join(problems)})"
        self._probed = (time.monotonic(), problem)
        return problem

    async def render_metrics(self) -> bytes:
        """The front's ``/metrics``: its own HTTP series, then every replica's series (the engine's
        queue, passes, prefix cache, failures) with a ``replica`` label, one broadcast of
        ``RerankReplica.metrics`` per scrape. A replica that fails or has not answered within
        ``METRICS_TIMEOUT_S`` is left out of that scrape (its series reappear at the next)."""
        families = {f.name: f for f in self.metrics.registry.collect()}
        try:
            answers = await self.handle.broadcast("metrics").results_async(
                timeout_s=METRICS_TIMEOUT_S, return_exceptions=True)
        except (DeploymentUnavailableError, TimeoutError, RayError):
            answers = []
        for answer in answers:
            if isinstance(answer, BaseException):
                continue
            replica, replica_families = answer
            for fam in replica_families:
                merged = families.get(fam.name)
                if merged is None:
                    merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                merged.samples.extend(s._replace(labels={**s.labels, "replica": replica}) for s in fam.samples)
        return generate_latest(_Families(list(families.values())))

    async def rerank(self, req: RerankRequest, is_disconnected, headers: Optional[dict] = None):
        return await self._forward("rerank", req, is_disconnected, headers)

    async def score(self, req: ScorePairsRequest, is_disconnected, headers: Optional[dict] = None):
        return await self._forward("score", req, is_disconnected, headers)

    async def select(self, req: SelectRequest, is_disconnected, headers: Optional[dict] = None):
        return await self._forward("select", req, is_disconnected, headers)

    async def _forward(self, method: str, req, is_disconnected, headers: Optional[dict]):
        key = routing_key(req)
        handle = self.handle.options(method_name="call", session_id=key) if key else \
            self.handle.options(method_name="call")
        # an object document's other keys never leave the front: parse_body kept each as the raw JSON
        # sent, the replica gets its text alone, and the front puts the object back into the answer
        # below (response_document, as acarerank serve answers), so both fronts answer the same bytes
        response = handle.remote(method, req.model_dump())

        async def result():
            return await response

        try:
            status, body, extra = await wait_or_drop(asyncio.ensure_future(result()), is_disconnected,
                                                     response.cancel)
        except (DeploymentUnavailableError, ReplicaUnavailableError, RayActorError) as e:
            # no replica, or the one routed to died under the request: the server's state, not this
            # request's fault (once a 500 "internal error: ActorDiedError"); a retry reaches a live one
            raise APIError(503, f"no engine replica could answer ({_short(e)}); retry",
                           {"Retry-After": "1"}) from None
        if status != 200:
            raise APIError(status, body["error"]["message"], headers=extra, type=body["error"]["type"])
        if method == "rerank" and req.return_documents and isinstance(body, dict):
            for result in body["results"]:
                result["document"] = req.response_document(result["index"])
        if headers is not None:
            headers.update(extra)
        return body


class _Families:
    """What ``generate_latest`` reads of a registry: ``collect()``."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return self.families


@serve.deployment
@serve.ingress()
class RerankIngress:
    """The HTTP front (``app.py``) of a set of ``RerankReplica``."""

    def __init__(self, replicas, config: ServeConfig, num_replicas: int = 1, ingress_replicas: int = 1):
        self.replicas = replicas
        self.config = config
        self.num_replicas = num_replicas
        self.ingress_replicas = ingress_replicas

    async def __serve_build_asgi_app__(self):
        name = await self.replicas.model_name.remote()
        return create_app(RemoteService(self.replicas, name, max_queue=self.config.max_queue,
                                        num_replicas=self.num_replicas, ingress_replicas=self.ingress_replicas),
                          self.config)


def build_app(model: Optional[str] = None, num_replicas: int = 1, replica_options: Optional[dict] = None,
              ingress_replicas: int = 1, health_max_pass_s: Optional[float] = None, **options):
    """The bound application: ``ingress_replicas`` HTTP fronts over ``num_replicas`` engines.

    replica_options: Ray actor options of each engine replica (e.g. ``{"num_gpus": 1}``).
    health_max_pass_s: Ray replaces a replica whose engine is dead, or, with this bound (seconds),
    one whose model step has run longer (``/health?max_pass_s=`` of ``acarerank serve``).
    options: ``ServeConfig`` fields (dtype, device, max_batch_tokens, max_queue, api_key, limits, ...),
    the same defaults as ``acarerank serve``; those of the connection (``RAY_OWNED_OPTIONS``: host,
    port, the header, keep-alive and send timeouts, max_connections, drain_timeout, log_level) are
    Ray's and are a ValueError naming Ray's setting; any other name is a ValueError too (Ray's
    ``autoscaling_config`` included: ``num_replicas`` and ``ingress_replicas`` are fixed counts,
    which each front's share of ``max_queue`` divides by).

    Admission as ``acarerank serve``'s: each front refuses (429) a request past its share of every
    replica's ``max_queue`` together (``ceil(max_queue × num_replicas / ingress_replicas)``) at its
    head when its share is full, else once its body has arrived (``RemoteService.admit``), and one
    past ``max_uploads`` bodies being read at once at its head (left out: the larger of 64 and
    that share, ``ServeConfig.uploads_beside``); each engine replica
    the request past its own ``max_queue`` (and waits for room in its ``max_queue_tokens``), so Ray
    must deliver it: a replica takes ``max_queue + 1`` requests at once (Ray's
    ``max_ongoing_requests``; one over it waits in Ray's queue) and an ingress replica every
    request the engines can hold, plus ``max_uploads`` being read, plus ``INGRESS_SPARE_REQUESTS``
    (Ray's default of 5 held the sixth request at the proxy, unanswered, whatever ``max_queue`` said).
    """
    check_max_pass_s(health_max_pass_s)
    for name, n in (("num_replicas", num_replicas), ("ingress_replicas", ingress_replicas)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:   # each front's share divides by it
            raise ValueError(f"build_app: {name} must be a positive int (a fixed count: no autoscaling), got {n!r}")
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(ServeConfig)})
    if unknown:
        # autoscaling would change num_replicas under each front's share of max_queue (RemoteService.limit),
        # computed once from the fixed counts: a front would admit for replicas that are gone or not yet there
        why = ("; autoscaling (autoscaling_config, num_replicas='auto') is not supported: each front's share of "
               "every engine's max_queue is computed from fixed num_replicas and ingress_replicas") \
            if "autoscaling_config" in unknown else ""
        what = "is not a ServeConfig field" if len(unknown) == 1 else "are not ServeConfig fields"
        raise ValueError(f"build_app: {', '.join(unknown)} {what} (the options of acarerank serve){why}")
    owned = [name for name in RAY_OWNED_OPTIONS if name in options]
    if owned:
        raise ValueError(f"build_app: {', '.join(owned)} {'is' if len(owned) == 1 else 'are'} not applied on Ray "
                         f"Serve: its HTTP proxy owns the connections (serve.start(http_options=...): host, port, "
                         f"keep_alive_timeout_s, request_timeout_s) and Ray the replicas' shutdown "
                         f"(graceful_shutdown_timeout_s) and logs (logging_config); leave "
                         f"{'it' if len(owned) == 1 else 'them'} out (docs/serving.md, 'Past one machine: Ray Serve')")
    config = ServeConfig(model=model, **options)
    per_replica = config.max_queue + 1   # the one past max_queue reaches the replica, which answers 429
    uploads = config.uploads_beside(front_share(config.max_queue, num_replicas, ingress_replicas))  # the gate's
    replicas = RerankReplica.options(num_replicas=num_replicas, max_ongoing_requests=per_replica,
                                     ray_actor_options=replica_options or {}).bind(config, health_max_pass_s)
    return RerankIngress.options(num_replicas=ingress_replicas,
                                 max_ongoing_requests=num_replicas * per_replica + uploads
                                 + INGRESS_SPARE_REQUESTS) \
        .bind(replicas, config, num_replicas, ingress_replicas)
