"""The checks on what the model computes: a final hidden state it cannot score, and a score or
next-token logit that comes out NaN/inf anyway.

The score and the next token both go through the final RMSNorm, h · rsqrt(mean(h²) + eps). A
row with a NaN/inf, or whose squares overflow fp32 (max |h| beyond ~1.8e19 / sqrt(H)), makes
that NaN, or 0 and so a score of exactly 0.5 / the grammar's first allowed token — a wrong
answer with no error (transformers' forward gives the same). It happens when the weights or
the dtype overflow (a broken checkpoint, float16 activations), never for an input that a
working model can read, so it is an error of the model, not of the request (docs/input-safety.md).

A finite, scorable hidden state can still give a NaN/inf score or logit when the output layer
(lm_head's rows, a ``score.weight`` head) or the final norm weight holds NaN/inf, or their product
overflows fp32. Loading refuses non-finite weights (``weights.check_finite_weight``), but the
runner shares an in-memory model's tensors, which the caller may change later; so every score
and every greedy step is checked too (a few numbers per document or prompt, never [T, V]):
``NonFiniteOutputError``.
"""
from __future__ import annotations

import torch


class NonFiniteError(RuntimeError):
    """A number the model computed is NaN/inf (or overflows): no score or token is given from it.
    ``rows``: what it was computed for (see the subclasses)."""

    def __init__(self, message: str, rows: list):
        super().__init__(message)
        self.rows = rows


class NonFiniteHiddenError(NonFiniteError):
    """The model's final hidden state is NaN/inf, or too large for fp32's RMSNorm, at the rows
    named in the message. ``rows``: their indices in the pass (``Qwen3Runner.forward``), the items
    (``forward_segments``, ``score_segments``), the documents ((request, document) pairs from
    ``score`` / ``score_batch``), the prompts of a greedy or sampling step (query indices of
    ``select_batch``) or the rollout tokens (``ato.rescore``)."""


class NonFiniteOutputError(NonFiniteError):
    """A score (logit_yes − logit_no) or a greedy step's chosen logit is NaN/inf although the hidden
    state was finite: the output layer or final norm weight is NaN/inf, or overflows. ``rows``: the
    documents ((request, document) pairs from ``score`` / ``score_batch``; item indices from
    ``score_segments``), the prompts (query indices of ``select_batch``) or the rollout tokens
    ((rollout, token) pairs of ``ato.rescore``) it happened for."""


def nonfinite_rows(values: torch.Tensor) -> list:
    """Indices of the NaN/inf entries of ``values`` [S] (one sync; S is a few numbers per document
    or prompt: the check never reads a [T, V] tensor)."""
    bad = ~torch.isfinite(values)
    return bad.nonzero().flatten().tolist() if bool(bad.any()) else []


def check_scorable(hidden: torch.Tensor) -> None:
    """Raise ``NonFiniteHiddenError`` if any row of ``hidden`` [S, H] has a NaN/inf or a sum of
    squares beyond fp32's range (the final RMSNorm's); one [S, H] pass and one sync."""
    sq = hidden.float().pow(2).sum(-1)  # inf for any NaN-free row that overflows; NaN stays NaN
    bad = ~torch.isfinite(sq)
    if not bool(bad.any()):
        return
    rows = bad.nonzero().flatten().tolist()
    h = hidden[rows].float()
    what = "NaN" if bool(torch.isnan(h).any()) else f"max |h| = {h.abs().amax().item():.3g}"
    raise NonFiniteHiddenError(
        f"the model's final hidden state is NaN/inf or too large for fp32's RMSNorm ({what}) at {len(rows)} of "
        f"{hidden.shape[0]} row(s) of this pass (first: {rows[:5]}): its activations overflowed (broken weights, or "
        f"a dtype too narrow: try float32); no score or token is computed from it", rows)
