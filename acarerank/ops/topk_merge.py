"""The top-k stack's streaming half (docs/ARCHITECTURE.md, "Top-k stack"): the op
``topk_merge_update`` (alias ``topk_merge``) and the state it updates. The contract it shares
with every top-k backend (``MAX_K``, ``TopKLogprobs``, ``check_k``, ``finalize``) is the leaf
``acarerank.topk_contract``; ``topk_logprobs.py`` builds its "cpp" / "cuda" cores on this
state and imports this module, never the other way round.

The order used everywhere is (value descending, vocabulary id ascending): ties go to the
lower id, so every backend returns the same ids as a *stable* descending sort of the full
logits (``topk_logprobs_ref``; ``torch.topk``'s tie order is unspecified, so it is not the oracle).

State per row (``TopKMergeState``): the k best (logit / temperature, id) pairs so far, the
running max and Σ exp(x − max) over every logit seen, and the target's logit once its chunk
has passed. Chunks may come in any order and any widths (k may exceed a chunk); each
vocabulary column must be merged exactly once, and the state keeps a host-side record of the
merged [c0, c1) intervals to hold callers to it (a column merged twice counts its exp twice in
the log-sum-exp, a column never merged leaves its term out: both were wrong log-probs with no
error): ``topk_merge_update`` refuses a chunk overlapping columns already merged, and
finalize refuses a gap — columns in [0, highest merged id), or in [0, vocab_size) /
[lo, hi) when ``topk_merge_init`` was given ``vocab_size=`` / ``vocab_range=(lo, hi)`` (a
vocabulary shard's state). The record is a short Python list (adjacent chunks coalesce into
one interval): O(intervals) per update, nothing per element, traced as constants under
torch.compile.

    state = topk_merge_init(T, k, device, targets=targets, temperature=t, vocab_size=V)
    for c0 in range(0, V, chunk):
        topk_merge_update(state, hidden @ weight[c0:c0 + chunk].T, c0)
    res = topk_merge_finalize(state)            # TopKLogprobs, as topk_logprobs returns

Update backends (declared in ``UPDATE_OP``): "torch" (sorts; the plain version), "cpp" (csrc
CPU twin), "cuda" (csrc kernel, one thread block per row: radix select + bitonic sort).
Default: "cuda" for CUDA tensors, "cpp" on CPU when acarerank._C is built, else "torch".
``topk_merge_update`` runs through the registered custom op ``acarerank::topk_merge_update``
(it mutates the state's five tensors in place). The state's k limit is ``TOPK_MAX_K`` (4,096).
"""
from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ..topk_contract import (DEFAULT_CHUNK, MAX_K, OUTSIDE_MODES, TOPK_MAX_K, TopKLogprobs,  # noqa: F401 (re-exported)
                             check_k, default_chunk, finalize, logsumexp_of)
from . import _backend
from ._checks import check_flag, finite_real, positive_in_fp32


@dataclass
class TopKMergeState:
    """Running top-k of a [T, V] logit matrix seen chunk by chunk. All tensors contiguous.

    values:       [T, k] fp32, logits / temperature, best first; empty slots −inf
    ids:          [T, k] int32 vocabulary ids; empty slots negative (−k .. −1)
    row_max:      [T] fp32, max over every logit / temperature seen
    row_sumexp:   [T] fp64, Σ exp(x − row_max) over the same
    target_logit: [T] fp32, the target's logit / temperature (NaN until its chunk is merged)
    targets:      [T] int64 vocabulary ids, or None
    temperature:  the divisor applied to every logit
    merged:       host-side record of the columns merged so far: sorted, disjoint, non-touching
                  (c0, c1) intervals of Python ints (module doc)
    vocab_range:  (lo, hi): the columns [lo, hi) the state must cover exactly, or None (then
                  [0, highest merged id + 1))
    """
    values: torch.Tensor
    ids: torch.Tensor
    row_max: torch.Tensor
    row_sumexp: torch.Tensor
    target_logit: torch.Tensor
    targets: Optional[torch.Tensor]
    temperature: float
    merged: List[Tuple[int, int]] = field(default_factory=list)
    vocab_range: Optional[Tuple[int, int]] = None

    @property
    def rows(self) -> int:
        return self.values.shape[0]

    @property
    def k(self) -> int:
        return self.values.shape[1]

    @property
    def device(self) -> torch.device:
        return self.values.device


def _check_temperature(temperature, op: str) -> float:
    """``temperature`` as a float, checked. Under torch.compile(dynamic=True) a float argument is a
    SymFloat: comparisons only (``math.isfinite`` cannot trace one), and the message formats
    ``float(t)`` (a constant; Dynamo cannot put a SymFloat into an f-string)."""
    if isinstance(temperature, torch.Tensor) and torch.compiler.is_compiling():
        # float(tensor) reads device data: a value the trace cannot check (a data-dependent guard)
        raise TypeError(f"{op}: temperature is a tensor inside torch.compile, where its value cannot be checked "
                        f"while tracing: pass a Python float (float(t) outside the compiled function)")
    t = float(temperature)
    # t != t first: NaN compared with the bounds is an error on a SymFloat, not False
    if t != t or not positive_in_fp32(t):  # the merge divides by fp32(τ)
        raise ValueError(f"{op}: temperature must be finite and > 0 (in float32 too), got {float(t)}")
    return t


def _vocab_id(x, what: str) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"topk_merge_init: {what} must be an int, got {x!r}")
    return int(x)


def _check_vocab_range(k: int, vocab_size, vocab_range) -> Optional[Tuple[int, int]]:
    """(lo, hi) from ``vocab_size=V`` ((0, V)) or ``vocab_range=(lo, hi)``; None if neither."""
    if vocab_size is not None and vocab_range is not None:
        raise ValueError("topk_merge_init: give vocab_size= (the state covers [0, V)) or vocab_range=(lo, hi) (a "
                         "shard's [lo, hi)), not both")
    if vocab_size is not None:
        lo, hi = 0, _vocab_id(vocab_size, "vocab_size")
    elif vocab_range is not None:
        if not isinstance(vocab_range, (tuple, list)) or len(vocab_range) != 2:
            raise TypeError(f"topk_merge_init: vocab_range must be a pair (lo, hi), got {vocab_range!r}")
        lo, hi = (_vocab_id(x, "vocab_range's bounds") for x in vocab_range)
    else:
        return None
    if not 0 <= lo < hi < 2 ** 31:
        raise ValueError(f"topk_merge_init: the vocabulary columns [{lo}, {hi}) must be non-empty and lie in "
                         f"[0, 2^31)")
    if k > hi - lo:
        raise ValueError(f"topk_merge_init: k={k} > the {hi - lo} vocabulary columns [{lo}, {hi})")
    return lo, hi


def topk_merge_init(rows: int, k: int, device, targets: Optional[torch.Tensor] = None,
                    temperature: float = 1.0, *, vocab_size: Optional[int] = None,
                    vocab_range: Optional[Tuple[int, int]] = None) -> TopKMergeState:
    """Empty state for ``rows`` rows; ``targets`` [rows] int64 (ids in the vocabulary) or None.

    ``vocab_size=V``: finalize refuses the state unless every column of [0, V) was merged (a
    chunk loop that stopped early). ``vocab_range=(lo, hi)``: the state of one vocabulary shard
    — updates outside [lo, hi) are refused and finalize wants all of [lo, hi). Neither: finalize
    wants [0, the highest merged id] covered (a trailing gap is not seen).
    """
    k = check_k(k, None, "cpp", "topk_merge_init")
    temperature = _check_temperature(temperature, "topk_merge_init")
    if rows < 0:
        raise ValueError(f"topk_merge_init: rows must be >= 0, got {int(rows)}")
    vocab_range = _check_vocab_range(k, vocab_size, vocab_range)
    device = torch.device(device)
    if targets is not None:
        if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64 or targets.shape != (rows,):
            raise TypeError(f"topk_merge_init: targets must be an int64 tensor of shape [{int(rows)}], got "
                            f"{getattr(targets, 'dtype', type(targets).__name__)} "
                            f"{tuple(int(n) for n in getattr(targets, 'shape', ()))}")
        if targets.device != device:
            raise ValueError(f"topk_merge_init: targets are on {targets.device}, the state on {device}")
        targets = targets.contiguous()
    # empty slots: (−inf, −k+i) keep the "best first" order and sort below every real entry
    ids = torch.arange(-k, 0, dtype=torch.int32, device=device).expand(rows, k).contiguous()
    return TopKMergeState(
        values=torch.full((rows, k), float("-inf"), dtype=torch.float32, device=device),
        ids=ids,
        row_max=torch.full((rows,), float("-inf"), dtype=torch.float32, device=device),
        row_sumexp=torch.zeros(rows, dtype=torch.float64, device=device),
        target_logit=torch.full((rows,), float("nan"), dtype=torch.float32, device=device),
        targets=targets,
        temperature=temperature,
        vocab_range=vocab_range,
    )


# ---------------------------------------------------------------- coverage record (host side)
# The record's ints are symbolic under torch.compile(dynamic=True) when the state comes into the
# compiled function from outside (Dynamo makes an input object's ints SymInts): the messages
# format int(x) — a constant (it specialises), where a SymInt in an f-string is Dynamo's
# "BUILD_STRING type error" in place of the message. Error paths only: nothing on the happy path.
def _fmt(intervals) -> str:
    return ", ".join(f"[{int(a)}, {int(b)})" for a, b in intervals)


def _check_claim(state: TopKMergeState, c0: int, c1: int) -> None:
    """ValueError if columns [c0, c1) lie outside the state's vocab_range or overlap the record."""
    if state.vocab_range is not None:
        lo, hi = state.vocab_range
        if c0 < lo or c1 > hi:
            raise ValueError(f"topk_merge_update: chunk columns {_fmt([(c0, c1)])} lie outside the state's "
                             f"vocabulary columns {_fmt([(lo, hi)])} (topk_merge_init's vocab_size / vocab_range)")
    hit = [(a, b) for a, b in state.merged if a < c1 and c0 < b]
    if hit:
        raise ValueError(f"topk_merge_update: chunk columns {_fmt([(c0, c1)])} overlap columns {_fmt(hit)} already "
                         f"merged: a vocabulary id merged more than once counts its exp twice in the log-sum-exp (each "
                         f"column must be merged exactly once)")


def _record(merged: List[Tuple[int, int]], c0: int, c1: int) -> None:
    """Insert [c0, c1) (disjoint from ``merged``) into the sorted list, coalescing touching neighbours."""
    i = 0
    while i < len(merged) and merged[i][1] < c0:
        i += 1
    if i < len(merged) and merged[i][1] == c0:   # the left neighbour ends where the chunk starts
        c0 = merged.pop(i)[0]
    if i < len(merged) and merged[i][0] == c1:   # the right neighbour starts where it ends
        c1 = merged.pop(i)[1]
    merged.insert(i, (c0, c1))


def _check_coverage(state: TopKMergeState) -> None:
    """ValueError naming the columns never merged in [lo, hi): the vocab_range, else [0, highest merged id + 1)."""
    if state.vocab_range is not None:
        lo, hi = state.vocab_range
    elif state.merged:
        lo, hi = 0, state.merged[-1][1]
    else:
        return  # nothing merged, no size given: "k exceeds the number of logits merged" says it (rows > 0)
    if state.merged == [(lo, hi)]:
        return
    gaps, at = [], lo
    for a, b in state.merged + [(hi, hi)]:
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    # a state of one vocabulary shard (global ids from lo > 0) made without vocab_range: the columns
    # below its first are a gap only because the state cannot know where its vocabulary starts
    shard = (f"; a vocabulary shard's state: topk_merge_init(..., vocab_range=({int(state.merged[0][0])}, hi))"
             if state.vocab_range is None and gaps[0][0] == 0 else "")
    raise ValueError(f"topk_merge_finalize: vocabulary columns {_fmt(gaps[:4])}{' ...' if len(gaps) > 4 else ''} "
                     f"were never merged (of {_fmt([(lo, hi)])}): their exp terms would be missing from the "
                     f"log-sum-exp (a gap between chunks, or a chunk loop that stopped early?){shard}")


# ---------------------------------------------------------------- torch backend
def _fold_lse_torch(state: TopKMergeState, v: torch.Tensor) -> None:
    """row_max, row_sumexp <- those of (everything seen) ∪ v, v = chunk / temperature [T, n] fp32."""
    m_new = torch.maximum(state.row_max, v.amax(dim=1))
    # ±inf max: shift by 0 so exp gives 0 / inf rather than NaN from inf − inf
    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    s_new = torch.exp(v.double() - shift.double()[:, None]).sum(dim=1)
    s_old = state.row_sumexp * torch.exp(state.row_max.double() - shift.double())
    state.row_max.copy_(m_new)
    state.row_sumexp.copy_(s_old + s_new)


def _update_torch(state: TopKMergeState, logits: torch.Tensor, c0: int) -> None:
    T, n = logits.shape
    if n == 0:
        return
    v = logits.float() / state.temperature + 0.0  # + 0.0 folds −0 into +0, as the kernels' keys do
    _fold_lse_torch(state, v)
    # -- top-k of (state ∪ chunk): stable sort by id, then stable sort by value descending
    cand_v = torch.cat([state.values, v], dim=1)
    cand_id = torch.cat([state.ids.long(), torch.arange(c0, c0 + n, device=v.device).expand(T, n)], dim=1)
    # empty slots (negative ids) must rank below real entries, even real −inf ones
    by_id = torch.argsort(torch.where(cand_id < 0, cand_id + 2 ** 40, cand_id), dim=1, stable=True)
    by_val = torch.argsort(cand_v.gather(1, by_id), dim=1, descending=True, stable=True)[:, :state.k]
    pick = by_id.gather(1, by_val)
    state.values.copy_(cand_v.gather(1, pick))
    state.ids.copy_(cand_id.gather(1, pick))
    if state.targets is not None:
        inside = (state.targets >= c0) & (state.targets < c0 + n)
        col = (state.targets - c0).clamp(0, n - 1)
        state.target_logit.copy_(torch.where(inside, v.gather(1, col[:, None])[:, 0], state.target_logit))


# ---------------------------------------------------------------- declaration
UPDATE_OP = _backend.OpDecl(
    "topk_merge_update", aliases=("topk_merge",),
    backends={"torch": _backend.Backend(lambda: _update_torch),
              "cpp": _backend.lazy_backend("topk_merge_update", "cpp", "acarerank.ops._cpp", "topk_update", ("cpu",),
                                           wrap=lambda fn: functools.partial(fn, cuda=False)),
              "cuda": _backend.lazy_backend("topk_merge_update", "cuda", "acarerank.ops._cpp", "topk_update", ("cuda",),
                                            needs_cuda_build=True, wrap=lambda fn: functools.partial(fn, cuda=True))},
    defaults={"cpu": ("cpp", "torch"), "cuda": ("cuda", "torch")},
)


@torch.library.custom_op("acarerank::topk_merge_update",
                         mutates_args=("values", "ids", "row_max", "row_sumexp", "target_logit"))
def topk_merge_update_op(values: torch.Tensor, ids: torch.Tensor, row_max: torch.Tensor, row_sumexp: torch.Tensor,
                         target_logit: torch.Tensor, targets: Optional[torch.Tensor], temperature: float,
                         chunk_logits: torch.Tensor, c0: int, backend: str) -> None:
    """The registered op: the state's five tensors are updated in place; ``backend`` is resolved."""
    state = TopKMergeState(values, ids, row_max, row_sumexp, target_logit, targets, temperature)
    UPDATE_OP.impl(backend)(state, chunk_logits, c0)


@topk_merge_update_op.register_fake
def _(values, ids, row_max, row_sumexp, target_logit, targets, temperature, chunk_logits, c0, backend):
    return None


# ---------------------------------------------------------------- public API
def topk_merge_update(state: TopKMergeState, chunk_logits: torch.Tensor, c0: int, backend=None) -> None:
    """Merge ``chunk_logits`` [T, n] (fp32/fp16/bf16; vocabulary ids c0 .. c0+n−1) into ``state`` in place.

    Each column is divided by ``state.temperature`` (IEEE division, as ``logits / t`` in torch).
    ValueError, with the state untouched, when [c0, c0+n) overlaps columns already merged or
    lies outside the init's vocab_size / vocab_range.
    """
    if not isinstance(chunk_logits, torch.Tensor) or chunk_logits.dim() != 2:
        raise ValueError(f"topk_merge_update: chunk_logits must be a [T, n] tensor, got "
                         f"{tuple(int(n) for n in getattr(chunk_logits, 'shape', ())) or type(chunk_logits).__name__}")
    if not chunk_logits.is_floating_point():
        raise TypeError(f"topk_merge_update: chunk_logits must be floating point, got {chunk_logits.dtype}")
    if chunk_logits.shape[0] != state.rows:
        raise ValueError(f"topk_merge_update: chunk has {int(chunk_logits.shape[0])} rows, the state {int(state.rows)}")
    if chunk_logits.device != state.device:
        raise ValueError(f"topk_merge_update: chunk is on {chunk_logits.device}, the state on {state.device}")
    # a float c0 (2.7) was truncated by int(): every id of the chunk off by the fraction, no error
    if isinstance(c0, bool) or not isinstance(c0, (numbers.Integral, torch.SymInt)):
        raise TypeError(f"topk_merge_update: c0 must be an int (the chunk's first vocabulary id), got {c0!r}")
    # plain ints (a SymInt specialises here): the coverage record holds Python ints only
    c0, c1 = int(c0), int(c0) + int(chunk_logits.shape[1])
    if c0 < 0 or c1 >= 2 ** 31:
        raise ValueError(f"topk_merge_update: vocabulary ids {c0}..{c1} must lie in [0, 2^31)")
    if c1 > c0:  # a zero-width chunk merges nothing
        _check_claim(state, c0, c1)   # before the op mutates the state
    topk_merge_update_op(state.values, state.ids, state.row_max, state.row_sumexp, state.target_logit, state.targets,
                         state.temperature, chunk_logits, c0, UPDATE_OP.resolve(backend, state.device))
    if c1 > c0:
        _record(state.merged, c0, c1)


@torch.library.custom_op("acarerank::topk_merge_ids_lse", mutates_args=())
def topk_merge_ids_lse_op(ids: torch.Tensor, row_max: torch.Tensor, row_sumexp: torch.Tensor,
                          target_logit: torch.Tensor, has_targets: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_ids [T,k] int64, logsumexp [T] fp32) of a state's ids, row_max and row_sumexp.

    ValueError when fewer than k logits were merged into some row (a negative id: an empty
    slot), when (``has_targets``) a row's target logit is still NaN (its id in no merged
    chunk), when a row's log-sum-exp is not finite (a NaN/inf logit merged, or the row −inf
    throughout: ``topk_logprobs``' rule; NaN / −inf log-probs came out), or when an id sits twice
    in a row's top-k (a column merged twice: caught where it ranks in the top-k). All read
    the data (a host sync), so they run here, on the real tensors: as
    branches in ``topk_merge_core`` they were three graph breaks under torch.compile and a
    UserError about a data-dependent guard under fullgraph=True.
    """
    k = ids.shape[1]
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"topk_merge_finalize: k={k} exceeds the number of logits merged into some row")
    if has_targets and target_logit.numel() and bool(torch.isnan(target_logit).any()):
        raise ValueError("topk_merge_finalize: a row's target id was in no merged chunk (or its logit is NaN)")
    # a column merged twice sits twice in the top-k, side by side (same value, same id) — when it
    # ranks there; its log-sum-exp term is counted twice either way
    if ids.shape[1] > 1 and bool((ids[:, 1:] == ids[:, :-1]).any()):
        raise ValueError("topk_merge_finalize: a vocabulary id was merged more than once (each column must be "
                         "merged exactly once; overlapping chunks?)")
    lse = logsumexp_of(row_max, row_sumexp)
    bad = ~torch.isfinite(lse)
    if lse.numel() and bool(bad.any()):
        raise ValueError(f"topk_merge_finalize: the log-sum-exp of rows {bad.nonzero().flatten().tolist()[:8]} is not "
                         f"finite: a NaN/inf logit was merged, or the row is -inf throughout")
    return ids.long(), lse


@topk_merge_ids_lse_op.register_fake
def _(ids, row_max, row_sumexp, target_logit, has_targets):
    return ids.new_empty(ids.shape, dtype=torch.int64), row_max.new_empty(row_max.shape, dtype=torch.float32)


def topk_merge_core(state: TopKMergeState):
    """The core tuple of a state every vocabulary column has been merged into:
    (topk_logits [T,k] fp32, topk_ids [T,k] int64, target_logit [T] fp32, logsumexp [T] fp32).

    Raises ValueError when some columns were never merged (the state's coverage record: in
    [0, highest merged id], or in the init's vocab_size / vocab_range; host-side, no sync),
    when fewer than k logits were merged into some row, (with targets) when a row's target id
    lay in no merged chunk, when a row's log-sum-exp is not finite, or when a top-k id was
    merged twice (``topk_merge_ids_lse_op``, one registered op: no graph break under
    torch.compile). Syncs with the device for those checks.
    """
    _check_coverage(state)
    ids, lse = topk_merge_ids_lse_op(state.ids, state.row_max, state.row_sumexp, state.target_logit,
                                     state.targets is not None)
    return state.values, ids, state.target_logit, lse


def topk_merge_finalize(state: TopKMergeState, outside: str = "floor", floor: float = -20.0,
                        renormalize: bool = True) -> TopKLogprobs:
    """``finalize`` of ``topk_merge_core(state)`` with the state's targets."""
    if outside not in OUTSIDE_MODES:
        raise ValueError(f"topk_merge_finalize: outside must be one of {OUTSIDE_MODES}, got {outside!r}")
    if not finite_real(floor):  # as topk_logprobs: a NaN floor would be every outside row's log-prob
        raise ValueError(f"topk_merge_finalize: floor must be a finite number, got {floor!r}")
    check_flag("topk_merge_finalize", "renormalize", renormalize)
    return finalize(*topk_merge_core(state), state.targets, outside, floor, renormalize)


__all__ = ["TopKMergeState", "UPDATE_OP", "topk_merge_init", "topk_merge_update", "topk_merge_update_op",
           "topk_merge_ids_lse_op", "topk_merge_core", "topk_merge_finalize"]
