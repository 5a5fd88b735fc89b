"""The two transformers baselines acarerank is measured against (docs/benchmarks.md, "Latency vs reranking depth").

(a) ``OfficialTransformers`` — the Qwen3-Reranker model card's code, through the one copy
    of it in the package (``acarerank.prompts.official``, also the tests' oracle): every
    document gets its full prompt ``prefix + body + suffix`` (prefix and suffix tokenized on
    their own, the body on its own and cut from its end to ``max_length``), batches of 4
    left-padded, one forward with ``logits_to_keep=1``, softmax over the [no, yes] logits at
    the last position.
(b) ``PrefixCacheTransformers`` — what a careful transformers user writes to reuse the
    shared context: the shared part (everything up to ``"<Document>:"``) is run once and
    its KV cache reused for batches of 16 documents (right padding + attention mask over
    prefix and document, positions continuing after the prefix); the final-normed hidden
    state is gathered at each document's last real token and only the [no, yes] rows of
    ``lm_head`` are applied.

The body of modes M1–M3 is ``acarerank.prompts.body_text`` (ACARe's context template is
our data, not the model card's); the card's strings themselves are checked character for
character against the card in ``tests/prompts/test_prompts.py``.

    score = softmax([logit_no, logit_yes])[1]      (a float in [0, 1] per document)
"""
from __future__ import annotations

from typing import Sequence

import torch

from acarerank.prompts import official_batch_input_ids, official_scores
from acarerank.prompts.pointwise import (DEFAULT_MAX_LENGTH, QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX,
                                         SHARED_END, body_text)

from .._validate import positive_int


def _yes_no_ids(tokenizer):
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    if yes is None or no is None:
        raise ValueError("tokenizer has no 'yes'/'no' tokens; the baselines need the Qwen3 tokenizer")
    return yes, no


def _check_batch_size(batch_size) -> int:
    return positive_int("batch_size", batch_size)


class OfficialTransformers:
    """Provider (a): the model card's transformers path, batches of ``batch_size`` documents.

    model: transformers Qwen3ForCausalLM; tokenizer: its tokenizer (not modified).
    ``official_batch_input_ids`` builds the card's ids, ``official_scores`` runs the card's
    ``compute_logits`` over left-padded batches.
    """

    name = "transformers"
    flop_plan = "full_padded"

    def __init__(self, model, tokenizer, batch_size: int = 4, max_length: int = DEFAULT_MAX_LENGTH):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length = _check_batch_size(batch_size), max_length
        _yes_no_ids(tokenizer)

    def score(self, query: str, documents: Sequence[str], question=None, trace=None, instruction=None) -> list:
        ids = official_batch_input_ids(self.tokenizer, query, documents, instruction, self.max_length,
                                       question=question, trace=trace)
        return official_scores(self.model, self.tokenizer, ids, batch_size=self.batch_size)


def split_prompt_ids(tokenizer, query: str, documents: Sequence[str], question=None, trace=None, instruction=None,
                     max_length: int = DEFAULT_MAX_LENGTH):
    """(shared_ids, [segment_ids]) with ``shared + segment_i`` = document i's full prompt tokens.

    shared = tokens(prefix) + tokens(body up to "<Document>:"); segment = tokens(" " + doc),
    cut from its end to fit ``max_length``, + tokens(suffix) — the split at which the Qwen3
    tokenizer gives the joint tokenization (docs/ARCHITECTURE.md, "Scoring facts"). The context is not truncated
    here: a shared part over ``max_length`` is a ValueError (benchmark workloads fit).
    """
    full = body_text(query, "", question, trace, instruction)
    head = full[: full.rindex(SHARED_END) + len(SHARED_END)]
    prefix, head_ids, suffix = tokenizer([QWEN3_RERANKER_PREFIX, head, QWEN3_RERANKER_SUFFIX],
                                         add_special_tokens=False)["input_ids"]
    shared = list(prefix) + list(head_ids)
    room = max_length - len(shared) - len(suffix)
    if room < 1:
        raise ValueError(f"shared context of {len(shared)} tokens leaves no room for documents under "
                         f"max_length={max_length}")
    docs = tokenizer([" " + d for d in documents], add_special_tokens=False)["input_ids"]
    return shared, [list(d[:room]) + list(suffix) for d in docs]


class PrefixCacheTransformers:
    """Provider (b): transformers with the shared prefix's KV cache computed once per call.

    For each batch of ``batch_size`` documents a ``DynamicCache`` is built from the prefix
    K/V broadcast to the batch (transformers concatenates new K/V onto it, so the prefix
    tensors themselves are never written), documents are right-padded, the mask covers
    prefix + real document tokens, and the positions continue at the prefix length.
    """

    name = "transformers+prefix-cache"
    flop_plan = "prefix_padded"

    def __init__(self, model, tokenizer, batch_size: int = 16, max_length: int = DEFAULT_MAX_LENGTH):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_length = _check_batch_size(batch_size), max_length
        yes, no = _yes_no_ids(tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.w_no_yes = model.get_output_embeddings().weight[[no, yes]]  # [2, H]: the only logits needed

    @torch.no_grad()
    def score(self, query: str, documents: Sequence[str], question=None, trace=None, instruction=None) -> list:
        dev = self.model.device
        shared, segments = split_prompt_ids(self.tokenizer, query, documents, question, trace, instruction,
                                            self.max_length)
        P = len(shared)
        prefix_kv = _cache_kv(self._decoder(input_ids=torch.tensor([shared], device=dev), cache=None))
        scores = []
        for i in range(0, len(segments), self.batch_size):
            batch = segments[i:i + self.batch_size]
            B, lens = len(batch), [len(s) for s in batch]
            L = max(lens)
            ids = torch.full((B, L), self.pad_id, dtype=torch.long)
            mask = torch.zeros(B, P + L, dtype=torch.long)
            mask[:, :P] = 1
            for r, s in enumerate(batch):
                ids[r, : len(s)] = torch.tensor(s)
                mask[r, P: P + len(s)] = 1
            hidden = self._decoder(input_ids=ids.to(dev), attention_mask=mask.to(dev),
                                   cache=_cache_from_kv(prefix_kv, B)).last_hidden_state  # [B, L, H], normed
            last = hidden[torch.arange(B, device=dev), torch.tensor(lens, device=dev) - 1]
            logits = (last @ self.w_no_yes.T).float()  # [B, 2] = [no, yes]
            scores += torch.log_softmax(logits, dim=-1)[:, 1].exp().tolist()
        return scores

    def _decoder(self, cache, **kw):
        """The decoder stack (``model.model``) with a KV cache in or out; transformers renamed
        ``past_key_values`` to ``cache`` in 5.x, both are accepted."""
        dec = self.model.model
        if self._cache_kwarg is None:
            import inspect
            self._cache_kwarg = "cache" if "cache" in inspect.signature(dec.forward).parameters else "past_key_values"
        return dec(**kw, use_cache=True, **({self._cache_kwarg: cache} if cache is not None else {}))

    _cache_kwarg = None


def _cache_kv(out) -> list:
    """[(K, V)] per layer, each [1, Hkv, P, d], from a decoder output's cache (any 4.5x/5.x layout)."""
    cache = getattr(out, "cache", None)
    if cache is None:  # transformers 4.x name
        cache = out.past_key_values
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    if hasattr(cache, "key_cache"):
        return list(zip(cache.key_cache, cache.value_cache))
    return [tuple(kv[:2]) for kv in cache]


def _cache_from_kv(prefix_kv: list, batch: int):
    """A fresh DynamicCache holding the prefix K/V broadcast to ``batch`` rows.

    ``DynamicCache.update`` concatenates new K/V onto what it holds, so the shared prefix
    tensors are read, never written, and serve every batch.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(prefix_kv):
        cache.update(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1), i)
    return cache
