"""``acarerank serve``: the HTTP rerank server (uvicorn) over one model.

SIGTERM drains: new API requests get 503 and ``/ready`` turns 503 at once, requests already
admitted finish (up to ``--drain-timeout`` seconds), then the process exits 0. SIGINT
(Ctrl+C) is uvicorn's usual graceful stop.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time


def add_parser(sub) -> None:
    from ..server.app import DEFAULT_MAX_BODY_BYTES
    from ..server.service import DEFAULT_MAX_DOCUMENTS, DEFAULT_MAX_QUEUE

    p = sub.add_parser("serve", help="HTTP rerank server: /v1/rerank (Cohere/Jina/vLLM/TEI bodies), /v1/select",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint folder; default: the embedded random-weight model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bfloat16 on a CPU with native bf16 (AVX512_BF16/AMX), else float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default=None, help="backend preference: torch | triton | cpp | cuda, or per op: "
                   "attention=triton,yes_no=cuda (default: ACARERANK_BACKEND, else by device)")
    p.add_argument("--max-length", type=int, default=8192, help="token cap per document prompt")
    p.add_argument("--max-batch-tokens", type=int, default=None,
                   help="segment tokens per packed pass (default: 2,048 on CPU, 16,384 on GPU)")
    p.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                   help="requests admitted and unanswered at once; one more gets 429")
    p.add_argument("--max-documents", type=int, default=DEFAULT_MAX_DOCUMENTS,
                   help="documents per request; more gets 413")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="request body cap (413)")
    p.add_argument("--cache-budget", type=int, default=None,
                   help="prefix-cache budget in tokens (needs a reranker with a prefix cache)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY'; unset: $ACARERANK_API_KEY, else open")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for in-flight requests")
    p.add_argument("--tokenize-workers", type=int, default=2, help="threads of the tokenization pool")
    p.add_argument("--log-level", default="info")
    p.set_defaults(run=run)


def model_name(args) -> str:
    """The name every response carries; the embedded default says its weights are random."""
    from ..model.default import DEFAULT_PRESET

    if args.model:
        return os.path.basename(os.path.normpath(args.model))
    return f"acarerank-default-RANDOM-WEIGHTS-{DEFAULT_PRESET}-scores-carry-no-meaning"


def _build_rerankers(args):
    """(pointwise, setwise on the same weights) as the flags ask."""
    from ..cli.common import load_reranker
    from ..pointwise import PointwiseReranker
    from ..setwise import SetwiseReranker

    kw = {"max_batch_tokens": args.max_batch_tokens}  # the reranker's own passes match the engine's
    if args.cache_budget is not None:
        kw["cache_budget_tokens"] = args.cache_budget
    rr = load_reranker(PointwiseReranker, args, **kw)
    # The setwise endpoint decodes on the same weights and the same scheduler thread.
    sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer, backend=rr.backend)
    return rr, sr


def build_service(args):
    """The ``RerankService`` the flags ask for, its model built on the thread that will run it
    (``acarerank.server.model_thread``: one OpenMP team for all model work)."""
    from ..server.model_thread import ModelThread
    from ..server.service import RerankService

    mt = ModelThread()
    try:
        rr, sr = mt.call(_build_rerankers, args)
    except BaseException:
        mt.shutdown()
        raise
    return RerankService(rr, model_name(args), setwise=sr, max_batch_tokens=rr.max_batch_tokens,
                         max_queue=args.max_queue, max_documents=args.max_documents,
                         tokenize_workers=args.tokenize_workers, model_thread=mt)


def run(args) -> int:
    import uvicorn

    from ..server.app import GateState, create_app

    api_key = args.api_key or os.environ.get("ACARERANK_API_KEY") or None  # never printed
    t0 = time.perf_counter()
    service = build_service(args)
    service.start(warmup=True)
    name = service.model_name
    print(f"acarerank serve: model {name!r} ready in {time.perf_counter() - t0:.1f} s "
          f"(max_batch_tokens {service.engine.max_batch_tokens}, max_queue {service.max_queue}, "
          f"api key {'on' if api_key else 'off'})", file=sys.stderr)
    state = GateState()
    app = create_app(service, api_key=api_key, max_body_bytes=args.max_body_bytes, state=state)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    server = DrainingServer(config, state, args.drain_timeout)
    try:
        server.run()
    finally:
        service.stop()
    return 0


class DrainingServer:
    """uvicorn's Server with SIGTERM turned into a drain (see the module docstring)."""

    def __new__(cls, config, state, drain_timeout: float):
        import uvicorn

        class _Server(uvicorn.Server):
            def handle_exit(self, sig, frame):
                if sig == signal.SIGTERM and not state.draining:
                    state.draining = True
                    threading.Thread(target=self._drain, name="acarerank-drain", daemon=True).start()
                    return
                super().handle_exit(sig, frame)

            def _drain(self):
                deadline = time.monotonic() + drain_timeout
                while state.in_flight > 0 and time.monotonic() < deadline:
                    time.sleep(0.05)
                self.should_exit = True

        return _Server(config)
