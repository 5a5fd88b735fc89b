"""``acarerank serve``: an HTTP rerank server with continuous batching
(docs/ARCHITECTURE.md, "A served request").

Layers, each knowing only the one below:

- ``config.py``   ``ServeConfig``: every option and its default (stdlib only; the CLI parses into it)
- ``build.py``    ``build_service(config)``: the model on its thread, the service over it
- ``front.py``    the HTTP front (uvicorn): its configuration, the descriptor limit, SIGTERM drain
- ``protocol.py`` per connection: header timeout, head size, connection cap, JSON for malformed HTTP
- ``gate.py``     ASGI middleware before the routes: drain, API key, admission (429), body size and timer
- ``app.py``      FastAPI routes, parsing, errors, /health /ready /metrics
- ``probes.py``   the one rule of what is unhealthy: ``/health`` and Ray's ``check_health``
- ``service.py``  ``RerankService``: admission (429), the rerank, score and select flows, its life and death
  ``request_checks.py``  what a schema cannot express: empty (400), too many documents (413), peers' options
  ``admission.py``       the token budget (``--max-queue-tokens``) and what a request counts in it
  ``tokenize_pool.py``   the tokenizer workers and their large lane
  ``waiting.py``         waits for the lane, the tokens and the engine (client gone: 499;
                         ``--request-timeout``: 504), the engine's errors as 500/503
  ``responses.py``       the response bodies
- ``engine.py``   the scheduler thread that owns the model: continuous batching of documents
  ``engine_faults.py``  its fault side: a failed pass narrowed to its request, the canary, dying
  ``engine_jobs.py``    its job and result types and errors (all importable from ``engine.py``)
- the step API    ``PointwiseReranker.encode / acquire_prefix / score_segments / release_prefix /
                  cache_stats`` (the prefix cache shared by all requests, kept apart by cache_salt)
- ``ray_serve.py`` the same service as Ray Serve replicas, routed by context for cache hits

Names are imported on first use (``from acarerank.server import create_app`` loads FastAPI then,
``import acarerank.server.config`` does not).
"""
import importlib

_LAZY = {"GateState": ".gate", "create_app": ".app", "RerankService": ".service", "ServeConfig": ".config",
         "build_service": ".build"}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
