"""Fitting a pointwise prompt into ``max_length`` tokens (docs/ARCHITECTURE.md, "Scoring facts").

Order of cuts, so that the shared part never depends on the documents:

1. The shared part (prefix + body up to ``"<Document>:"``) must leave room for the suffix
   and ``min_doc_tokens`` document tokens. Only the reasoning trace may be cut, and it
   loses its *oldest* text first (:func:`cut_oldest`), in whole chunks of
   ``TRACE_CUT_CHUNK`` of its tokens. The sub-query, question and instruction are never
   cut: if they alone do not fit, the caller raises ValueError.
2. Each document is then cut from its end (:func:`cut_tail`) to whatever room is left —
   what the Qwen3-Reranker model card does to its body, so M0 matches it token for token.

Why chunks (docs/ARCHITECTURE.md, "Paged KV and the prefix cache"): an agent calls the
reranker again and again with a trace that only grows. Cutting the fewest tokens would move the trace's start on every
call once the cap is reached, so no two calls would share anything after the question and
the prefix cache would never hit. Cutting in fixed chunks of the trace's own tokens keeps the
start where it was until the excess crosses the next chunk: consecutive calls keep an
identical prefix up to the end of the older trace. The cost is at most ``chunk - 1`` trace
tokens more than needed (512 of 8,192; the cap is the paper's, where to cut is ours).

These helpers know nothing of the prompt strings; :func:`acarerank.prompts.encode_pointwise`
supplies them.
"""
from __future__ import annotations

import bisect
import collections
from typing import Callable, Optional, Tuple

from .._validate import positive_int

# Room kept for document tokens when the context is cut: retrieval passages are usually
# chunked to <= 512 tokens, so a trace never squeezes a typical passage. It also bounds the
# context at max_length - suffix - 512 = 7,671 tokens under the default 8,192 cap.
DEFAULT_MIN_DOC_TOKENS = 512

# Trace tokens dropped at once when the context is over its share (see above); 1 = fewest.
TRACE_CUT_CHUNK = 512


def cut_oldest(tokenizer, text: str, shared_len: Callable[[Optional[str]], int], budget: int,
               current_len: Optional[int] = None, chunk: int = TRACE_CUT_CHUNK) -> Tuple[Optional[str], int]:
    """Drop the fewest whole ``chunk``s of tokens from the START of ``text`` so that
    ``shared_len(kept) <= budget`` (chunk = 1: the fewest tokens).

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
        chunk: the cut point is a multiple of ``chunk`` of ``text``'s tokens (tokenized alone),
            so a growing trace keeps its start across calls until the next chunk must go.

    Returns:
        ``(kept, dropped)``: ``kept`` is a suffix of ``text`` cut where one of its tokens starts
        (leading whitespace stripped, so the line does not start with a blank), or ``None`` when
        no token of it fits — the caller then leaves the trace line out; ``dropped`` counts the
        tokens of ``text`` (tokenized alone) that end at or before the cut.
    """
    positive_int("chunk", chunk)
    from ..tokenizer import TextEncoder

    enc = TextEncoder.of(tokenizer)
    length = shared_len(text) if current_len is None else current_len
    # Offsets of the trace's last tokens only (the cut lands there: at most ``budget`` trace tokens
    # are kept), counted piece by piece, so a huge trace never holds all of its offsets at once;
    # the full list is built only if the cut ever reaches further back.
    n, first, tail = _tail_offsets(enc, text, budget + 2 * chunk + 64)
    starts = _Shifted([s for s, _ in tail], first)
    ends = [e for _, e in tail]

    def cut_at(d: int) -> Optional[str]:
        """``text`` without its first ``d`` tokens; None when nothing is left."""
        nonlocal n, first, tail, starts, ends
        if d >= n:
            return None
        if d < first:  # further back than the kept offsets: take them all (never for a trace over by <= budget)
            n, first, tail = _tail_offsets(enc, text, None)
            starts, ends = _Shifted([s for s, _ in tail], first), [e for _, e in tail]
        return text[starts[d]:].lstrip() or None

    kept, drop, too_few = text, 0, 0   # too_few: the most tokens dropped that did not fit
    while length > budget:
        # each dropped trace token shortens the shared part by about one token; step by the
        # excess (rounded up to whole chunks) and re-check (strictly increasing, ~2 tokenizations)
        too_few = drop
        drop = -(-(drop + length - budget) // chunk) * chunk
        kept = cut_at(drop)
        if kept is None:
            break
        length = shared_len(kept)
    # A dropped token can shorten the shared part by more than one (the seam after the trace's
    # label: a trace starting with a digit costs a lone " " token; a cut inside a run of repeated
    # characters re-tokenizes shorter), so the step can overshoot: walk back while one chunk
    # fewer still fits (a whole trace dropped where 89 of its 601 tokens fitted; 1,024 tokens
    # dropped where 512 did).
    while drop - chunk > too_few:
        fewer = cut_at(drop - chunk)
        if fewer is None or shared_len(fewer) > budget:
            break
        kept, drop = fewer, drop - chunk
    if kept is None:
        return None, n
    # tokens wholly before the cut; one the cut splits (its leading space stripped) counts as kept
    dropped = first + bisect.bisect_right(ends, len(text) - len(kept))
    return kept, dropped


class _Shifted:
    """``values`` indexed from ``first`` (tokens first..first+len-1)."""

    def __init__(self, values: list, first: int):
        self.values, self.first = values, first

    def __getitem__(self, i: int):
        return self.values[i - self.first]


def _tail_offsets(enc, text: str, keep: Optional[int]) -> Tuple[int, int, list]:
    """``(n, first, offsets)``: the text's token count and the offsets of its tokens ``first..n-1``,
    the last ``keep`` of them (None: all), counted piece by piece (``TextEncoder.user_pieces``)."""
    if keep is None:
        _, offsets = enc.user_offsets(text)
        return len(offsets), 0, list(offsets)
    n, held, pieces = 0, 0, collections.deque()  # the last pieces that hold the last ``keep`` tokens
    for start, e in enc.user_pieces(text):
        n += len(e)
        pieces.append((start, e))
        held += len(e)
        while held - len(pieces[0][1]) >= keep:
            held -= len(pieces.popleft()[1])
    tail = [(a + start, b + start) for start, e in pieces for a, b in e.offsets]
    return n, n - len(tail), tail


def cut_tail(ids: list, room: int) -> Tuple[list, int]:
    """``ids`` cut from the end to at most ``room`` tokens; returns (ids, number dropped)."""
    if len(ids) <= room:
        return ids, 0
    return ids[:room], len(ids) - room
