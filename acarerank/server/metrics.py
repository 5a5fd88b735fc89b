"""Prometheus metrics of one server (``prometheus_client``), in a registry of their own.

Names follow the peers' meaning (TEI ``te_request_duration``/``te_queue_size``/
``te_batch_next_tokens``, vLLM ``e2e_request_latency_seconds``/``num_requests_waiting``/
``prefix_cache_hits``) under the ``acarerank_`` prefix:

==========================================  =========  ==============================================
name                                        type       meaning
==========================================  =========  ==============================================
acarerank_request_duration_seconds          histogram  HTTP request latency, by endpoint
acarerank_requests_total                    counter    HTTP responses, by endpoint and status code (the
                                                       HTTP protocol's own 400, 408, 431 included)
acarerank_errors_total                      counter    error responses (status ≥ 400), by code; a
                                                       client that left (499) is not one
acarerank_client_disconnects_total          counter    requests whose client left before the answer
                                                       (499 in requests_total), by endpoint
acarerank_queue_time_seconds                histogram  admission (the whole body; tokenization and the
                                                       wait for --max-queue-tokens included) → first
                                                       pass (or selection step): one sample a request
acarerank_queue_size                        gauge      requests waiting for their first pass
acarerank_requests_running                  gauge      requests with documents in flight
acarerank_requests_in_flight                gauge      requests admitted and not yet answered
acarerank_requests_uploading                gauge      requests whose body is being received, not yet
                                                       admitted (what --max-uploads bounds)
acarerank_queue_tokens                      gauge      tokens of the tokenized requests not yet answered
                                                       (what --max-queue-tokens bounds; shared part once)
acarerank_requests_waiting_for_tokens       gauge      requests tokenized and waiting, in arrival order,
                                                       for room in --max-queue-tokens
acarerank_batch_tokens                      histogram  segment tokens per packed pass
acarerank_batch_requests                    histogram  requests sharing a packed pass
acarerank_documents_scored_total            counter    documents scored (requests': not the warm-up's
                                                       or the canary's)
acarerank_requests_cancelled_total          counter    requests whose remaining work was dropped: the
                                                       client left, or --request-timeout passed (a
                                                       /score request once, not once per group)
acarerank_engine_failures_total             counter    model-side failures, by stage (pass, prefill,
                                                       select, scheduler, tokenize, engine)
acarerank_engine_failures_in_a_row          gauge      failures since the last success, by kind (model:
                                                       requests the model failed; iteration: failed
                                                       scheduler iterations); the canary runs at
                                                       ``--canary-after-failures``
acarerank_engine_canary_total               counter    canary runs, by outcome (passed: the failures were
                                                       the requests'; failed: the engine died)
acarerank_prefix_cache_<x>_tokens_total     counter    lookup / hit / computed / evicted tokens, by
                                                       cache (rerank; select: /v1/select's own)
acarerank_prefix_cache_<x>_tokens           gauge      resident / budget tokens, by cache
==========================================  =========  ==============================================

The prefix-cache series are read from each cache's ``cache_stats()`` at scrape time, on a
thread of their own and for at most ``CACHE_STATS_WAIT_S`` (``_CacheCollector``).
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .errors import CLIENT_CLOSED

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
_TOKEN_BUCKETS = (16, 64, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CACHE_COUNTERS = ("lookup", "hit", "computed", "evicted")
CACHE_GAUGES = ("resident", "budget")
#: every stage ``acarerank_engine_failures_total`` counts (docs/serving.md lists the same; a test keeps
#: them equal): each series is present at 0 from the start, as ``rate()`` over a missing series is
#: empty, not 0, and an alert on a stage that never failed yet would have nothing to read
ENGINE_FAILURE_STAGES = ("pass", "prefill", "select", "scheduler", "tokenize", "engine")
#: seconds a scrape waits for ``cache_stats()``, which takes the prefix cache's pool lock (a model
#: step may hold it) before it serves the last figures read
CACHE_STATS_WAIT_S = 0.25

log = logging.getLogger("acarerank.server")


class _CacheReader:
    """Reads one cache's ``cache_stats()`` for a scrape.

    The scrape must not depend on the cache (docs/serving.md, "Metrics"): ``cache_stats()`` runs on a
    daemon thread of its own, one read at a time (a read that never returns is waited on by the
    next scrapes, not stacked), and a scrape waits for it at most ``wait_s`` seconds, then serves
    the last figures read (none yet: no cache series). A ``cache_stats()`` that raises leaves the
    cache series out of that scrape and is logged once until a read succeeds again. Read inline,
    a raise was a 500 for the whole scrape (the engine's failure counters lost with it), and a step
    holding the pool lock blocked the event loop: no probe answered, no dead engine's exit."""

    def __init__(self, name: str, cache_stats: Callable[[], dict], wait_s: float):
        self.name = name
        self.cache_stats = cache_stats
        self.wait_s = wait_s
        self._lock = threading.Lock()
        self._reading: Optional[concurrent.futures.Future] = None   # the read in progress, or the last one
        self._last: Optional[dict] = None    # the last figures read (set by the read's thread)
        self._failing = False                # logged since the last read that succeeded

    def _run(self, fut: concurrent.futures.Future) -> None:
        try:
            stats = self.cache_stats() or {}
        except BaseException as e:  # noqa: BLE001 - the scrape reports it; this thread only ends
            fut.set_exception(e)
            return
        # kept as the read ends, not when a scrape sees it end: a read slower than the wait ends
        # between scrapes, and the next scrape starts a new one (docs/serving.md, "Metrics")
        with self._lock:
            self._last = stats
        fut.set_result(stats)

    def read(self) -> Optional[dict]:
        """The cache's figures: read now, or the last ones read (None: none to serve)."""
        with self._lock:
            fut = self._reading
            if fut is None or fut.done():
                fut = self._reading = concurrent.futures.Future()
                threading.Thread(target=self._run, args=(fut,), name="acarerank-cache-stats", daemon=True).start()
        try:
            stats = fut.result(self.wait_s)
        except concurrent.futures.TimeoutError:
            self._note(f"cache_stats() did not answer within {self.wait_s:g} s (a model step holds the prefix "
                       f"cache's lock?): the {self.name} prefix-cache series serve the last figures read")
            with self._lock:
                return self._last
        except BaseException as e:  # noqa: BLE001 - the scrape goes on without the cache series
            self._note(f"cache_stats() failed ({type(e).__name__}: {e}): the {self.name} prefix-cache series "
                       f"are left out")
            return None
        self._failing = False
        return stats

    def _note(self, msg: str) -> None:
        if not self._failing:
            self._failing = True
            log.error("%s; logged once until a read succeeds", msg)


class _CacheCollector:
    """Exports each cache's ``cache_stats()`` (monotonic counters and gauges) on every scrape,
    labelled ``cache`` by the name it is given (``caches``: name → ``cache_stats``), each read by a
    ``_CacheReader`` of its own: a cache that cannot be read leaves only its own series out. One
    collector for all, as a metric family is written once per scrape, every cache's samples in it."""

    def __init__(self, caches: dict, wait_s: float = CACHE_STATS_WAIT_S):
        self.readers = [_CacheReader(name, stats, wait_s) for name, stats in caches.items()]

    def collect(self):
        figures = [(r.name, r.read()) for r in self.readers]
        figures = [(name, stats) for name, stats in figures if stats is not None]
        if not figures:
            return
        for name in CACHE_COUNTERS:
            c = CounterMetricFamily(f"acarerank_prefix_cache_{name}_tokens",
                                    f"prefix-cache tokens {name} (shared-part tokens)", labels=["cache"])
            for cache, stats in figures:
                c.add_metric([cache], float(stats.get(f"{name}_tokens", 0)))
            yield c
        for name in CACHE_GAUGES:
            g = GaugeMetricFamily(f"acarerank_prefix_cache_{name}_tokens", f"prefix-cache tokens {name}",
                                  labels=["cache"])
            for cache, stats in figures:
                g.add_metric([cache], float(stats.get(f"{name}_tokens", 0)))
            yield g


class ServerMetrics:
    """All series of one server. ``cache_stats``: the step API's ``cache_stats`` (None: not exported),
    labelled ``cache="rerank"``; ``select_cache_stats``: the setwise reranker's (``/v1/select``'s own
    prefix cache, sized by the same budget: docs/serving.md, "Metrics"), ``cache="select"``.
    ``engine=False``: the HTTP series only (request_duration, requests, errors, client_disconnects),
    for a front whose engines are elsewhere (Ray Serve's ingress, which adds theirs at each scrape):
    engine series of its own would stay at 0 and read as an idle engine."""

    def __init__(self, cache_stats: Optional[Callable[[], dict]] = None, engine: bool = True,
                 select_cache_stats: Optional[Callable[[], dict]] = None):
        self.registry = r = CollectorRegistry()
        self.request_duration = Histogram("acarerank_request_duration_seconds", "HTTP request latency",
                                          ["endpoint"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("acarerank_requests", "HTTP responses", ["endpoint", "code"], registry=r)
        self.errors = Counter("acarerank_errors", "error responses (status >= 400) but 499 (the client left)",
                              ["code"], registry=r)
        self.disconnects = Counter("acarerank_client_disconnects", "requests whose client left before the "
                                   "answer (499: during the upload or while waiting)", ["endpoint"], registry=r)
        # the gate's (an ingress front has it too): its bodies are read there
        self.uploading = Gauge("acarerank_requests_uploading", "requests whose body is being received, not yet "
                               "admitted (--max-uploads bounds it)", registry=r)
        if not engine:
            return
        # the HTTP protocol's own closes (protocol.py). No series until a first close: behind Ray
        # Serve (its proxy holds those limits) a replica's engine series are forwarded, and a 0
        # there would claim a limit that is not this server's
        self.connections_closed = Counter("acarerank_connections_closed", "connections the server closed for a "
                                          "limit, by reason (max_connections: closed as accepted, past "
                                          "--max-connections; send_timeout: a response left unread past "
                                          "--send-timeout)", ["reason"], registry=r)
        self.queue_time = Histogram("acarerank_queue_time_seconds", "admission to first pass",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_size = Gauge("acarerank_queue_size", "requests waiting for their first pass", registry=r)
        self.running = Gauge("acarerank_requests_running", "requests with documents in flight", registry=r)
        self.in_flight = Gauge("acarerank_requests_in_flight", "requests admitted and not yet answered", registry=r)
        self.queue_tokens = Gauge("acarerank_queue_tokens", "tokens of the tokenized requests not yet answered, "
                                  "each counted as the engine computes it (shared part once); --max-queue-tokens "
                                  "bounds it", registry=r)
        self.token_waiting = Gauge("acarerank_requests_waiting_for_tokens", "requests tokenized and waiting, in "
                                   "arrival order, for room in --max-queue-tokens (each holds its --max-queue "
                                   "slot and its token ids meanwhile)", registry=r)
        self.batch_tokens = Histogram("acarerank_batch_tokens", "segment tokens per packed pass",
                                      buckets=_TOKEN_BUCKETS, registry=r)
        self.batch_requests = Histogram("acarerank_batch_requests", "requests sharing a packed pass",
                                        buckets=_COUNT_BUCKETS, registry=r)
        self.model_seconds = Counter("acarerank_model_seconds", "seconds the scheduler thread spent in model "
                                     "calls, by kind (prefill: a request's shared part; pass: a packed scoring "
                                     "pass; call: a setwise selection)", ["kind"], registry=r)
        self.documents = Counter("acarerank_documents_scored", "documents scored", registry=r)
        self.cancelled = Counter("acarerank_requests_cancelled", "requests whose remaining work was dropped (the "
                                 "client left, or --request-timeout passed)",
                                 registry=r)
        self.engine_failures = Counter("acarerank_engine_failures", "model-side failures by stage (pass: a packed "
                                       "scoring pass, prefill: a request's shared part, select: a selection "
                                       "step, scheduler: the scheduler iteration, tokenize: a tokenizer worker, "
                                       "engine: the engine died)", ["stage"], registry=r)
        for stage in ENGINE_FAILURE_STAGES:
            self.engine_failures.labels(stage)  # present at 0 from the start (a rate needs a first sample)
        self.failures_in_a_row = Gauge("acarerank_engine_failures_in_a_row", "failures since the last success, "
                                       "by kind (model: requests the model failed since a scoring pass or "
                                       "selection step succeeded; iteration: scheduler iterations that raised in a row)",
                                       ["kind"], registry=r)
        self.canary = Counter("acarerank_engine_canary", "canary runs after --canary-after-failures failures in "
                              "a row, by outcome (passed: the failures were the requests'; failed: the engine "
                              "died)", ["outcome"], registry=r)
        for kind in ("model", "iteration"):
            self.failures_in_a_row.labels(kind)
        for outcome in ("passed", "failed"):
            self.canary.labels(outcome)
        caches = {name: stats for name, stats in (("rerank", cache_stats), ("select", select_cache_stats))
                  if stats is not None}
        if caches:
            r.register(_CacheCollector(caches))

    def track_depth(self, depth: Callable[[], tuple]) -> None:
        """``acarerank_queue_size`` and ``acarerank_requests_running`` read ``depth()`` → ``(waiting,
        running)`` at each scrape: set once per scheduler iteration, they missed every arrival during
        a long pass and kept a failed iteration's last values while no more work came."""
        self.queue_size.set_function(lambda: depth()[0])
        self.running.set_function(lambda: depth()[1])

    def observe_pass(self, tokens: int, num_requests: int) -> None:
        self.batch_tokens.observe(tokens)
        self.batch_requests.observe(num_requests)

    def observe_response(self, endpoint: str, code: int, seconds: float) -> None:
        self.request_duration.labels(endpoint).observe(seconds)
        self.requests.labels(endpoint, str(code)).inc()
        if code == CLIENT_CLOSED:   # nobody got an answer: not an error of the server's, nor a response
            self.disconnects.labels(endpoint).inc()
        elif code >= 400:
            self.errors.labels(str(code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
