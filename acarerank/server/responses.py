"""The response bodies: what each endpoint sends back once its engine work is done.

The shapes are docs/serving.md's "Endpoints" table: a rerank's results best first (ties in input
order), Cohere's, Jina's and vLLM's dict or TEI's bare list; a score request's pairs in input
order (vLLM's ``ScoreResponse``); a selection's ids and indices. Plain functions of the request
and the engine's results.
"""
from __future__ import annotations

import math
import time

from .schemas import RerankRequest, ScorePairsRequest

DOCS_PER_SEARCH_UNIT = 100       # Cohere bills one search unit per query with up to 100 documents


def rerank_body(req: RerankRequest, docs: list, result, rid: str, model_name: str):
    """One rerank's body from its ``ScoreResult``: ``results`` best first, ties in input order, cut
    to ``top_n``; TEI's list for a ``texts`` body."""
    scores = result.scores
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    if req.top_n:
        order = order[:req.top_n]
    if req.is_tei:
        return [dict(index=i, score=scores[i], **({"text": docs[i]} if req.return_text else {}))
                for i in order]
    results = [dict(index=i, relevance_score=scores[i],
                    **({"document": req.response_document(i)} if req.return_documents else {})) for i in order]
    return dict(id=rid, model=model_name, results=results,
                usage=dict(prompt_tokens=result.prompt_tokens, total_tokens=result.prompt_tokens,
                           cached_tokens=result.cached_tokens),
                meta=dict(billed_units=dict(search_units=math.ceil(len(docs) / DOCS_PER_SEARCH_UNIT))))


def score_body(req: ScorePairsRequest, num_pairs: int, groups: dict, results: list, rid: str,
               model_name: str) -> dict:
    """One score request's body: ``data[i].score`` is pair ``i``'s, gathered from its group's
    ``ScoreResult`` (``groups``: ``score_groups``' ``{query: [pair indices]}``, ``results`` in
    the same order), in input order; ``usage`` sums the groups'."""
    scores = [0.0] * num_pairs
    for idx, result in zip(groups.values(), results):
        for i, s in zip(idx, result.scores):
            scores[i] = s
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return dict(id=f"score-{req.request_id if req.request_id is not None else rid}", object="list",
                created=int(time.time()), model=model_name,
                data=[dict(index=i, object="score", score=s) for i, s in enumerate(scores)],
                usage=dict(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens, completion_tokens=0,
                           cached_tokens=sum(r.cached_tokens for r in results)))


def select_body(sel, rid: str, model_name: str) -> dict:
    """One selection's body from the engine's result (ids 1-based as emitted, indices 0-based)."""
    return dict(id=rid, model=model_name, ids=sel.ids, indices=sel.indices, text=sel.text,
                valid=sel.valid, usage=dict(prompt_tokens=sel.prompt_tokens, completion_tokens=sel.num_tokens,
                                            total_tokens=sel.prompt_tokens + sel.num_tokens))
