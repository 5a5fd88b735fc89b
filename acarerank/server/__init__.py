"""``acarerank serve``: an HTTP rerank server with continuous batching
(docs/ARCHITECTURE.md, "A served request").

Layers, each knowing only the one below:

- ``app.py``      FastAPI routes, the gate (drain / API key / body size), errors, /metrics
- ``service.py``  checks, admission (429), tokenization pool, waiting on the engine, responses
- ``engine.py``   the scheduler thread that owns the model: continuous batching of documents
- the step API    ``PointwiseReranker.encode / acquire_prefix / score_segments / release_prefix /
                  cache_stats`` (the prefix cache shared by all requests, kept apart by cache_salt)
- ``ray_serve.py`` the same service as Ray Serve replicas, routed by context for cache hits
"""
from .app import GateState, create_app
from .service import RerankService

__all__ = ["GateState", "RerankService", "create_app"]
