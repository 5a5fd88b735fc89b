"""``build_service(config)``: the ``RerankService`` a ``ServeConfig`` asks for, used by the CLI
and the Ray Serve replicas alike (nothing here imports ``acarerank.cli``).

The model is built on the thread that will run it (``model_thread.py``: one OpenMP team for
all model work), and the setwise reranker shares its weights (``/v1/select``).
"""
from __future__ import annotations

import os
import sys

from .config import ServeConfig


def model_name(config: ServeConfig) -> str:
    """The name every response carries; the embedded default says its weights are random."""
    if config.model:
        return os.path.basename(os.path.normpath(config.model))
    from ..model.default import DEFAULT_PRESET

    return f"acarerank-default-RANDOM-WEIGHTS-{DEFAULT_PRESET}-scores-carry-no-meaning"


def build_rerankers(config: ServeConfig):
    """(pointwise, setwise on the same weights) as ``config`` asks; notes on stderr say the dtype
    and, for the embedded default, that its scores carry no meaning."""
    from ..loading import load_reranker
    from ..model import ContextLengthError
    from ..pointwise import PointwiseReranker
    from ..setwise import SetwiseReranker

    # unset caps are the rerankers' "auto" (the paper's, bounded by the model's positions); a set one
    # past the model's positions is their ContextLengthError, so the server does not start
    kw = dict(max_length="auto" if config.max_length is None else config.max_length,
              max_batch_tokens=config.max_batch_tokens)  # the reranker's own passes match the engine's
    if config.cache_budget is not None:
        kw["cache_budget_tokens"] = config.cache_budget
    try:
        rr = load_reranker(PointwiseReranker, model=config.model, dtype=config.dtype, device=config.device,
                           backend=config.backend, **kw)
    except ContextLengthError as e:  # the constructor names its argument; the user gave a flag
        raise ContextLengthError(f"--max-length: {e}") from None
    # The setwise endpoint decodes on the same weights and the same scheduler thread. Its prompt
    # cache has the same budget: without one it would take the device default (8 GiB on a GPU)
    # on the first /v1/select, whatever --cache-budget the deployment was sized with.
    try:
        sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer, backend=rr.backend,
                             max_length="auto" if config.select_max_length is None else config.select_max_length,
                             max_new_tokens=config.select_max_new_tokens,
                             **{k: v for k, v in kw.items() if k == "cache_budget_tokens"})
    except ContextLengthError as e:
        raise ContextLengthError(f"--select-max-length / --select-max-new-tokens: {e}") from None
    from .request_checks import select_room_note
    from .service import select_unavailable

    unavailable = select_unavailable(sr)
    if unavailable is not None and config.select_max_length is not None:  # the operator's own cap: a usage error
        raise ValueError(f"--select-max-length {config.select_max_length:,}: {unavailable}; every /v1/select would "
                         f"be refused: give at least {sr.min_prompt_tokens():,}, or leave it out")
    # one line on the /v1/select cap: unavailable, or little room (either names the cap), or the cap's own
    select_note = (f"NOTE: /v1/select is unavailable: {unavailable}; each /v1/select is answered 400 "
                   f"(context_length), /v1/rerank and /score are served" if unavailable is not None else
                   select_room_note(sr) or sr.default_cap_line("--select-max-length", "--select-max-new-tokens"))
    for note in (rr.default_cap_line("--max-length"), select_note):
        if note:  # a short model's caps are below the documented defaults: said at start-up
            print(note, file=sys.stderr)
    return rr, sr


def build_service(config: ServeConfig):
    """The ``RerankService`` of ``config`` (not started), its model built on its ``ModelThread``."""
    from .model_thread import ModelThread
    from .service import RerankService

    mt = ModelThread()
    try:
        rr, sr = mt.call(build_rerankers, config)
    except BaseException:
        mt.shutdown()
        raise
    return RerankService(rr, model_name(config), setwise=sr, max_batch_tokens=rr.max_batch_tokens,
                         max_queue=config.max_queue, max_queue_tokens=config.max_queue_tokens,
                         token_wait_timeout=config.token_wait_timeout,
                         max_documents=config.max_documents,
                         tokenize_workers=config.tokenize_workers, model_thread=mt,
                         canary_after_failures=config.canary_after_failures, request_timeout=config.request_timeout,
                         max_pass_timeout=config.max_pass_timeout)
