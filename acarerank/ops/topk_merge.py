"""The top-k stack's streaming half (docs/ARCHITECTURE.md, "Top-k stack"): one streaming
state, one finalize, one result type, the chunk default and the k limits, and the "cpp" /
"cuda" cores built on the state. ``topk_logprobs.py`` holds the op, its oracle and the
"torch" / "triton" cores; it imports this module, never the other way round.

The order used everywhere is (value descending, vocabulary id ascending): ties go to the
lower id, so every backend returns the same ids as a *stable* descending sort of the full
logits (``topk_logprobs_ref``; ``torch.topk``'s tie order is unspecified, so it is not the oracle).

State per row (``TopKMergeState``): the k best (logit / temperature, id) pairs so far, the
running max and Σ exp(x − max) over every logit seen, and the target's logit once its chunk
has passed. Chunks may come in any order and any widths (k may exceed a chunk); each
vocabulary column must be merged exactly once.

    state = topk_merge_init(T, k, device, targets=targets, temperature=t)
    for c0 in range(0, V, chunk):
        topk_merge_update(state, hidden @ weight[c0:c0 + chunk].T, c0)
    res = topk_merge_finalize(state)            # TopKLogprobs, as topk_logprobs returns

Update backends (declared in ``UPDATE_OP``): "torch" (sorts; the plain version), "cpp" (csrc
CPU twin), "cuda" (csrc kernel, one thread block per row: radix select + bitonic sort).
Default: "cuda" for CUDA tensors, "cpp" on CPU when acarerank._C is built, else "torch".

Finalize: ``finalize`` (torch, on [T, k] tensors) is the only one; every core and the state
end in it. k limits (``MAX_K``, enforced by ``check_k`` with the backend named): "torch" none
(k <= V), "triton" 512 (the running top-K lives in registers; at 1,024 it spills, see
``acarerank.kernels.topk_logprobs.gpu_tile_config``), "cpp"/"cuda" 4,096 (one
row's keys in 32 KB of shared memory, csrc/topk_merge.cuh kTopKMax). Chunk default
(``DEFAULT_CHUNK``, vocabulary columns per GEMM; the cores' peak extra memory is one
[T, chunk] fp32 block): 2,048 on CPU, 16,384 on CUDA (wider GEMMs keep cuBLAS busy); the
triton core tiles on its own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from collections import namedtuple
from typing import Optional

import torch

from . import _backend

#: the largest k of each top-k backend (None: k <= V only); see the module docstring
MAX_K = {"torch": None, "triton": 512, "cpp": 4096, "cuda": 4096}
TOPK_MAX_K = MAX_K["cpp"]  # the streaming state's limit (csrc kTopKMax)

#: vocabulary columns per GEMM when the caller passes chunk=None, per device type
DEFAULT_CHUNK = {"cpu": 2048, "cuda": 16384}

OUTSIDE_MODES = ("floor", "mask", "full")

TopKLogprobs = namedtuple("TopKLogprobs", ["target_logprob", "topk_ids", "topk_logprobs", "in_topk"])
TopKLogprobs.__doc__ = """The one top-k result type (T rows; log-probs of logits / temperature).

target_logprob [T] fp32 (None without targets), topk_ids [T,k] int64 best first (ties: lower
id first), topk_logprobs [T,k] fp32, in_topk [T] bool (None without targets)."""


def default_chunk(device) -> int:
    return DEFAULT_CHUNK.get(torch.device(device).type, DEFAULT_CHUNK["cpu"])


def check_k(k, V: Optional[int], backend: str, op: str) -> int:
    """k an int in [1, V] and within ``backend``'s limit (``MAX_K``); the error names both."""
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{op}: k must be an int, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"{op}: k must be >= 1, got k={k}")
    if V is not None and k > V:
        raise ValueError(f"{op}: k must be <= V, got k={k} > the vocabulary size {V}")
    limit = MAX_K.get(backend)
    if limit is not None and k > limit:
        others = ", ".join(f"{b!r} (k <= {m})" if m else f"{b!r} (any k)" for b, m in MAX_K.items() if b != backend)
        raise ValueError(f"{op}: k must be <= {limit} with the {backend!r} backend, got k={k}; use {others}")
    return k


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
    """
    values: torch.Tensor
    ids: torch.Tensor
    row_max: torch.Tensor
    row_sumexp: torch.Tensor
    target_logit: torch.Tensor
    targets: Optional[torch.Tensor]
    temperature: float

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
    t = float(temperature)
    if not (t > 0.0 and math.isfinite(t)):
        raise ValueError(f"{op}: temperature must be finite and > 0, got {temperature}")
    return t


def topk_merge_init(rows: int, k: int, device, targets: Optional[torch.Tensor] = None,
                    temperature: float = 1.0) -> TopKMergeState:
    """Empty state for ``rows`` rows; ``targets`` [rows] int64 (ids in the vocabulary) or None."""
    k = check_k(k, None, "cpp", "topk_merge_init")
    temperature = _check_temperature(temperature, "topk_merge_init")
    if rows < 0:
        raise ValueError(f"topk_merge_init: rows must be >= 0, got {rows}")
    device = torch.device(device)
    if targets is not None:
        if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64 or targets.shape != (rows,):
            raise TypeError(f"topk_merge_init: targets must be an int64 tensor of shape [{rows}], got "
                            f"{getattr(targets, 'dtype', type(targets).__name__)} {tuple(getattr(targets, 'shape', ()))}")
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
    )


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
def _load_update(name: str):
    def loader():
        try:
            from . import _cpp
        except ImportError as e:
            raise _backend.BackendError(f"topk_merge_update: {name} backend unavailable: {e}") from e
        if name == "cuda":
            _cpp.require_cuda("topk_merge_update")  # BackendError with the build's reason
        cuda = name == "cuda"
        return lambda state, logits, c0: _cpp.topk_update(state, logits, c0, cuda=cuda)
    return loader


UPDATE_OP = _backend.OpDecl(
    "topk_merge_update", aliases=("topk_merge",),
    backends={"torch": _backend.Backend(lambda: _update_torch), "cpp": _backend.Backend(_load_update("cpp"), ("cpu",)),
              "cuda": _backend.Backend(_load_update("cuda"), ("cuda",))},
    defaults={"cpu": ("cpp", "torch"), "cuda": ("cuda", "torch")},
)


# ---------------------------------------------------------------- public API
def topk_merge_update(state: TopKMergeState, chunk_logits: torch.Tensor, c0: int, backend=None) -> None:
    """Merge ``chunk_logits`` [T, n] (fp32/fp16/bf16; vocabulary ids c0 .. c0+n−1) into ``state`` in place.

    Each column is divided by ``state.temperature`` (IEEE division, as ``logits / t`` in torch).
    """
    if not isinstance(chunk_logits, torch.Tensor) or chunk_logits.dim() != 2:
        raise ValueError(f"topk_merge_update: chunk_logits must be a [T, n] tensor, got "
                         f"{tuple(getattr(chunk_logits, 'shape', ())) or type(chunk_logits).__name__}")
    if not chunk_logits.is_floating_point():
        raise TypeError(f"topk_merge_update: chunk_logits must be floating point, got {chunk_logits.dtype}")
    if chunk_logits.shape[0] != state.rows:
        raise ValueError(f"topk_merge_update: chunk has {chunk_logits.shape[0]} rows, the state {state.rows}")
    if chunk_logits.device != state.device:
        raise ValueError(f"topk_merge_update: chunk is on {chunk_logits.device}, the state on {state.device}")
    c0 = int(c0)
    if c0 < 0 or c0 + chunk_logits.shape[1] >= 2 ** 31:
        raise ValueError(f"topk_merge_update: vocabulary ids {c0}..{c0 + chunk_logits.shape[1]} must lie in [0, 2^31)")
    UPDATE_OP.impl(UPDATE_OP.resolve(backend, state.device))(state, chunk_logits, c0)


def topk_merge_core(state: TopKMergeState):
    """The core tuple of a state every vocabulary column has been merged into:
    (topk_logits [T,k] fp32, topk_ids [T,k] int64, target_logit [T] fp32, logsumexp [T] fp32).

    Raises ValueError when fewer than k logits were merged into some row, or (with targets)
    when a row's target id lay in no merged chunk. Syncs with the device for those checks.
    """
    if state.rows and int(state.ids.min()) < 0:
        raise ValueError(f"topk_merge_finalize: k={state.k} exceeds the number of logits merged into some row")
    if state.targets is not None and state.rows and bool(torch.isnan(state.target_logit).any()):
        raise ValueError("topk_merge_finalize: a row's target id was in no merged chunk (or its logit is NaN)")
    lse = (state.row_max.double() + state.row_sumexp.log()).float()
    return state.values, state.ids.long(), state.target_logit, lse


def finalize(topk_logits, topk_ids, target_logit, lse, targets, outside: str = "floor", floor: float = -20.0,
             renormalize: bool = True) -> TopKLogprobs:
    """The one finalize: core outputs -> TopKLogprobs (formulas in topk_logprobs' docstring).

    renormalize: top-k log-probs over the top-k (True) or over the vocabulary (lse). A target
    outside the top-k gets ``floor`` ("floor"), 0 ("mask") or its full-softmax log-prob
    ("full"). ``targets`` None: target_logprob and in_topk are None.
    """
    # fp64, rounded once to fp32 at the end: a log-prob of −25 has an fp32 ulp of 2e-6
    vals, lse64 = topk_logits.double(), lse.double()
    norm = torch.logsumexp(vals, dim=1) if renormalize else lse64
    topk_lp = (vals - norm[:, None]).float()
    if targets is None:
        return TopKLogprobs(None, topk_ids, topk_lp, None)
    tg = targets.to(torch.int64)
    in_topk = (topk_ids == tg[:, None]).any(dim=1)
    inside = target_logit.double() - norm  # same value as the target's top-k entry (same logit, same norm)
    if outside == "floor":
        out = torch.full_like(inside, float(floor))
    elif outside == "mask":
        out = torch.zeros_like(inside)
    else:  # "full"
        out = target_logit.double() - lse64
    return TopKLogprobs(torch.where(in_topk, inside, out).float(), topk_ids, topk_lp, in_topk)


def topk_merge_finalize(state: TopKMergeState, outside: str = "floor", floor: float = -20.0,
                        renormalize: bool = True) -> TopKLogprobs:
    """``finalize`` of ``topk_merge_core(state)`` with the state's targets."""
    if outside not in OUTSIDE_MODES:
        raise ValueError(f"topk_merge_finalize: outside must be one of {OUTSIDE_MODES}, got {outside!r}")
    return finalize(*topk_merge_core(state), state.targets, outside, floor, renormalize)


# ---------------------------------------------------------------- the cpp / cuda cores

_MM_OUT_DTYPE: dict = {}  # (device type, dtype) -> whether torch.mm(..., out_dtype=fp32) runs there


def _mm_fp32_out_supported(x: torch.Tensor) -> bool:
    key = (x.device.type, x.dtype)
    if key not in _MM_OUT_DTYPE:
        try:
            torch.mm(x[:1, :1], x[:1, :1].t(), out_dtype=torch.float32)
            _MM_OUT_DTYPE[key] = True
        except (NotImplementedError, TypeError, RuntimeError):  # CPU, or a torch without mm.dtype
            _MM_OUT_DTYPE[key] = False
    return _MM_OUT_DTYPE[key]


def _chunk_gemm(hidden: torch.Tensor):
    """w [n, H] -> fp32 logits [T, n] = hidden · wᵀ with fp32 products and sums.

    fp32 inputs: one fp32 GEMM. fp16/bf16 on CUDA: cuBLAS with fp32 output (the products of
    half-precision inputs are exact in fp32, so this equals the upcast GEMM up to summation
    order) — no [n, H] fp32 copy of the weight. Otherwise the chunk is upcast first.
    """
    if hidden.dtype == torch.float32:
        return lambda w: torch.mm(hidden, w.t())
    if hidden.is_cuda and _mm_fp32_out_supported(hidden):
        return lambda w: torch.mm(hidden, w.t(), out_dtype=torch.float32)
    h32 = hidden.float()
    return lambda w: torch.mm(h32, w.float().t())


def _core(hidden, weight, targets, k, chunk, temperature, backend):
    """Inputs checked by ``topk_logprobs_core``; one GEMM per chunk, merged into one state."""
    T, V = hidden.shape[0], weight.shape[0]
    state = topk_merge_init(T, k, hidden.device, targets=targets.long(), temperature=temperature)
    update = UPDATE_OP.impl(backend)
    chunk = min(chunk or default_chunk(hidden.device), V)
    gemm = _chunk_gemm(hidden)
    if T:
        for c0 in range(0, V, chunk):
            update(state, gemm(weight[c0:c0 + chunk]), c0)
    lse = (state.row_max.double() + state.row_sumexp.log()).float()
    return state.values, state.ids.long(), state.target_logit, lse


def topk_logprobs_core_cpp(hidden, weight, targets, k: int, chunk: Optional[int], temperature: float):
    """Top-k of ``hidden @ weight.T / temperature`` without materialising [T, V]; C++ CPU merge.

    Args:
      hidden: [T, H] float; weight: [V, H] same dtype (lm_head); targets: [T] int64/int32 in [0, V).
      k: 1 .. min(V, 4096); chunk: vocabulary columns per GEMM (None: ``default_chunk``), peak
        extra memory T × chunk fp32; temperature: > 0.
    Logits are fp32 GEMMs of the fp32-upcast inputs, one chunk at a time, then divided by the
    temperature in fp32 (IEEE division, as ``logits / temperature`` in torch).
    Returns:
      topk_logits [T, k] fp32 (logits / temperature, descending; ties: lower id first),
      topk_ids [T, k] int64, target_logit [T] fp32, logsumexp [T] fp32 (full vocabulary).
    """
    return _core(hidden, weight, targets, k, chunk, temperature, "cpp")


def topk_logprobs_core_cuda(hidden, weight, targets, k: int, chunk: Optional[int], temperature: float):
    """As ``topk_logprobs_core_cpp`` on CUDA tensors: cuBLAS GEMM per chunk + the CUDA merge kernel."""
    return _core(hidden, weight, targets, k, chunk, temperature, "cuda")
