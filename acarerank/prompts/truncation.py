"""Fitting a pointwise prompt into ``max_length`` tokens (docs/ARCHITECTURE.md, "Scoring facts").

Order of cuts, so that the shared part never depends on the documents:

1. The shared part (prefix + body up to ``"<Document>:"``) must leave room for the suffix
   and ``min_doc_tokens`` document tokens. Only the reasoning trace may be cut, and it
   loses its *oldest* text first (:func:`cut_oldest`). The sub-query, question and
   instruction are never cut: if they alone do not fit, the caller raises ValueError.
2. Each document is then cut from its end (:func:`cut_tail`) to whatever room is left —
   what the Qwen3-Reranker model card does to its body, so M0 matches it token for token.

These helpers know nothing of the prompt strings; :func:`acarerank.prompts.encode_pointwise`
supplies them.
"""
from __future__ import annotations

import bisect
from typing import Callable, Optional, Tuple

# Room kept for document tokens when the context is cut: retrieval passages are usually
# chunked to <= 512 tokens, so a trace never squeezes a typical passage. It also bounds the
# context at max_length - suffix - 512 = 7,671 tokens under the default 8,192 cap.
DEFAULT_MIN_DOC_TOKENS = 512


def cut_oldest(tokenizer, text: str, shared_len: Callable[[Optional[str]], int], budget: int,
               current_len: Optional[int] = None) -> Tuple[Optional[str], int]:
    """Drop the fewest whole tokens from the START of ``text`` so that ``shared_len(kept) <= budget``.

    Args:
        tokenizer: a :class:`acarerank.tokenizer.TextEncoder` (or anything ``TextEncoder.of``
            takes: a fast Hugging Face tokenizer...); its offsets give token boundaries.
        text: the reasoning trace, oldest text first.
        shared_len: length in tokens of the shared part built with a given trace (``None``: no
            trace line at all). Re-tokenizing the whole shared part is the check: a trace cut at
            a token boundary can tokenize differently inside the prompt, so counts are verified,
            never assumed.
        budget: the most tokens the shared part may take.
        current_len: ``shared_len(text)`` if the caller already has it.

    Returns:
        ``(kept, dropped)``: ``kept`` is a suffix of ``text`` cut where one of its tokens starts
        (leading whitespace stripped, so the line does not start with a blank), or ``None`` when
        no token of it fits — the caller then leaves the trace line out; ``dropped`` counts the
        tokens of ``text`` (tokenized alone) that end at or before the cut.
    """
    from ..tokenizer import TextEncoder

    _, offsets = TextEncoder.of(tokenizer).user_offsets(text)
    starts = [s for s, _ in offsets]
    ends = [e for _, e in offsets]
    n = len(starts)
    length = shared_len(text) if current_len is None else current_len
    kept, drop = text, 0
    while length > budget:
        # each dropped trace token shortens the shared part by about one token; step by the
        # excess and re-check (strictly increasing, so at most n + 1 tokenizations, ~2 in practice)
        drop += length - budget
        if drop >= n:
            return None, n
        kept = text[starts[drop]:].lstrip()
        if not kept:
            return None, n
        length = shared_len(kept)
    # tokens wholly before the cut; one the cut splits (its leading space stripped) counts as kept
    dropped = bisect.bisect_right(ends, len(text) - len(kept))
    return kept, dropped


def cut_tail(ids: list, room: int) -> Tuple[list, int]:
    """``ids`` cut from the end to at most ``room`` tokens; returns (ids, number dropped)."""
    if len(ids) <= room:
        return ids, 0
    return ids[:room], len(ids) - room
