"""The step API the engine drives, on top of today's ``PointwiseReranker`` (no prefix cache).

The scheduler thread (``engine.py``) calls exactly five operations:

    enc    = steps.encode(request)                 # tokenization only; thread-safe
    handle = steps.acquire_prefix(enc)             # prefill enc.shared_ids, pin its KV
    scores = steps.score_segments([(handle, segment_ids), ...])   # ONE packed forward
    steps.release_prefix(handle)                   # idempotent
    steps.cache_stats()                            # counters + gauges (dict)

``PointwiseReranker`` gains the same five methods with a cross-request prefix cache (paged
KV); until then this adapter provides them: every request prefills its own shared part
(``cached_tokens`` is 0), and a pass concatenates the per-layer K/V of the groups it
touches into one ``KVCache``. Scores equal ``PointwiseReranker.score`` of the same request
(≤ 1e-6 in fp32; only the packing of the pass differs).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..model.runner import KVCache
from ..ops import backend_for, yes_no_score
from ..prompts import encode_pointwise


@dataclass(eq=False)
class PrefixHandle:
    """One request's prefilled shared part. ``cache``: a one-group ``KVCache``; None once released."""
    cache: Optional[KVCache]
    prompt_tokens: int            # shared + all segment tokens
    cached_tokens: int = 0        # shared tokens served from a cache (none here)
    computed_tokens: int = 0      # shared tokens prefilled for this request
    released: bool = field(default=False)


class StepAdapter:
    """The engine's step API over a ``PointwiseReranker`` (see the module docstring)."""

    def __init__(self, reranker):
        self.rr = reranker
        self._lock = threading.Lock()  # guards the counters (encode runs in a thread pool)
        self._stats = dict(lookup_tokens=0, hit_tokens=0, computed_tokens=0, evicted_tokens=0)
        self._resident = 0
        # The last pass's concatenated cache, reused while the same handles stay in the pass
        # (a deep request spans many passes with the same single group).
        self._packed_key: tuple = ()
        self._packed: Optional[KVCache] = None

    # -- the five operations ---------------------------------------------------------------
    def encode(self, request):
        """Tokenize one ``ScoreRequest`` as the reranker does (truncation included)."""
        rr = self.rr
        if callable(getattr(rr, "encode", None)):  # the reranker's own rule, whenever it has one
            return rr.encode(request)
        return encode_pointwise(rr.tokenizer, request.query, request.documents, question=request.question,
                                trace=request.trace, instruction=request.instruction, max_length=rr.max_length,
                                template=rr.template, min_doc_tokens=rr.min_doc_tokens)

    def acquire_prefix(self, enc) -> PrefixHandle:
        n = len(enc.shared_ids)
        cache = self.rr.runner.prefill([enc.shared_ids])
        with self._lock:
            self._stats["lookup_tokens"] += n
            self._stats["computed_tokens"] += n
            self._resident += n
        return PrefixHandle(cache=cache, prompt_tokens=n + sum(len(s) for s in enc.segment_ids),
                            cached_tokens=0, computed_tokens=n)

    def score_segments(self, items: Sequence) -> list:
        """Scores of ``[(handle, segment_ids), ...]`` in item order, from one packed forward."""
        if len(items) == 0:
            return []
        handles, group_of = [], {}
        for h, _ in items:
            if h.released or h.cache is None:
                raise ValueError("score_segments: a prefix handle was already released")
            if id(h) not in group_of:
                group_of[id(h)] = len(handles)
                handles.append(h)
        cache = self._pack(handles)
        rr = self.rr
        hidden = rr.runner.forward(cache, [seg for _, seg in items], [group_of[id(h)] for h, _ in items],
                                   output="last")
        s, _ = yes_no_score(hidden, rr.runner.final_norm_weight, rr._w_yes, rr._w_no,
                            eps=rr.runner.arch.rms_norm_eps,
                            backend=backend_for("yes_no_score", rr.backend))
        return s.tolist()

    def release_prefix(self, handle: PrefixHandle) -> None:
        if handle.released:
            return
        handle.released = True
        n = handle.cache.lengths[0] if handle.cache is not None else 0
        handle.cache = None
        if any(h is handle for h in self._packed_key):
            self._packed_key, self._packed = (), None
        with self._lock:
            self._resident -= n

    def cache_stats(self) -> dict:
        with self._lock:
            return dict(self._stats, resident_tokens=self._resident, budget_tokens=0)

    # -- internals ---------------------------------------------------------------------------
    def _pack(self, handles: list) -> KVCache:
        """One ``KVCache`` holding the groups of ``handles`` in order (per-layer K/V concatenated)."""
        key = tuple(handles)
        if len(handles) == 1:
            return handles[0].cache
        if self._packed is not None and len(key) == len(self._packed_key) and all(
                a is b for a, b in zip(key, self._packed_key)):
            return self._packed
        caches = [h.cache for h in handles]
        lengths = [c.lengths[0] for c in caches]
        acc = [0]
        for n in lengths:
            acc.append(acc[-1] + n)
        dev = caches[0].cu_prefix_lens.device
        packed = KVCache(k=[torch.cat([c.k[i] for c in caches]) for i in range(len(caches[0].k))],
                         v=[torch.cat([c.v[i] for c in caches]) for i in range(len(caches[0].v))],
                         lengths=lengths, cu_prefix_lens=torch.tensor(acc, dtype=torch.int32, device=dev))
        self._packed_key, self._packed = key, packed
        return packed
