"""Streaming top-k merge over vocabulary chunks: teacher top-k truncation without ever
holding ``[tokens, vocab]`` logits (DESIGN.md §6).

The order used everywhere is (value descending, vocabulary id ascending): ties go to the
lower id, so every backend returns the same ids as a *stable* descending sort of the full
logits (``topk_merge_ref``; ``torch.topk``'s tie order is unspecified, so it is not the oracle).

State per row (``TopKMergeState``): the k best (logit / temperature, id) pairs so far, the
running max and Σ exp(x − max) over every logit seen, and the target's logit once its chunk
has passed. Chunks may come in any order and any widths (k may exceed a chunk); each
vocabulary column must be merged exactly once.

    state = topk_merge_init(T, k, device, targets=targets, temperature=t)
    for c0 in range(0, V, chunk):
        topk_merge_update(state, hidden @ weight[c0:c0 + chunk].T, c0)
    res = topk_merge_finalize(state, full_logprobs=True)

Backends: "torch" (sorts; the plain version), "cpp" (csrc CPU twin), "cuda" (csrc kernel,
one thread block per row: radix select + bitonic sort). Default: "cuda" for CUDA tensors,
"cpp" on CPU when acarerank._C is built, else "torch".

``topk_logprobs_core_cpp`` / ``topk_logprobs_core_cuda`` drive the merge with the GEMM done by
torch (BLAS / cuBLAS) one vocabulary chunk at a time; ``acarerank.ops.topk_logprobs`` builds
the user-facing op on them. Peak extra memory: one [T, chunk] logits block.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from . import _backend
from ._checks import check_projection_inputs

TOPK_MAX_K = 4096  # csrc/topk_merge.cuh kTopKMax: one row's keys in 32 KB of shared memory


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


class TopKResult(NamedTuple):
    """Finalized top-k (T rows). Log-probs are of logits / temperature.

    ids:                 [T, k] int64, best first (ties: lower id first)
    topk_logits:         [T, k] fp32, logits / temperature
    logprobs:            [T, k] fp32, renormalised over the top-k: log_softmax(topk_logits)
    logprobs_full:       [T, k] fp32, over the full vocabulary (None unless asked for)
    logsumexp:           [T] fp32, over the full vocabulary
    target_logprob:      [T] fp32, target's log-prob over the full vocabulary (None without targets)
    target_logprob_topk: [T] fp32, target's log-prob under the truncated, renormalised
                         distribution; −inf when the target is outside the top-k
    target_in_topk:      [T] bool
    """
    ids: torch.Tensor
    topk_logits: torch.Tensor
    logprobs: torch.Tensor
    logprobs_full: Optional[torch.Tensor]
    logsumexp: torch.Tensor
    target_logprob: Optional[torch.Tensor]
    target_logprob_topk: Optional[torch.Tensor]
    target_in_topk: Optional[torch.Tensor]


def _check_k(k, op: str) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"{op}: k must be an int, got {type(k).__name__}")
    if not 1 <= k <= TOPK_MAX_K:
        raise ValueError(f"{op}: k={k} must be in [1, {TOPK_MAX_K}]")
    return k


def _check_temperature(temperature, op: str) -> float:
    t = float(temperature)
    if not (t > 0.0 and math.isfinite(t)):
        raise ValueError(f"{op}: temperature must be finite and > 0, got {temperature}")
    return t


def topk_merge_init(rows: int, k: int, device, targets: Optional[torch.Tensor] = None,
                    temperature: float = 1.0) -> TopKMergeState:
    """Empty state for ``rows`` rows; ``targets`` [rows] int64 (ids in the vocabulary) or None."""
    k = _check_k(k, "topk_merge_init")
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


def _finalize_torch(state: TopKMergeState, full_logprobs: bool) -> dict:
    vals = state.values.double()
    lse = state.row_max.double() + state.row_sumexp.log()
    lp = torch.log_softmax(vals, dim=1)
    out = {"logsumexp": lse.float(), "logprobs": lp.float(),
           "logprobs_full": (vals - lse[:, None]).float() if full_logprobs else None}
    if state.targets is not None:
        hit = state.ids.long() == state.targets[:, None]
        in_topk = hit.any(dim=1)
        tlp_topk = torch.where(hit, lp, torch.zeros_like(lp)).sum(1)
        out["target_logprob"] = (state.target_logit.double() - lse).float()
        out["target_logprob_topk"] = torch.where(in_topk, tlp_topk, torch.full_like(tlp_topk, float("-inf"))).float()
        out["target_in_topk"] = in_topk
    return out


# ---------------------------------------------------------------- backend tables
def _load(name: str, what: str):
    def loader():
        try:
            from . import _cpp
        except ImportError as e:
            raise _backend.BackendError(f"{what}: {name} backend unavailable: {e}") from e
        if name == "cuda" and not _cpp.has_cuda():
            _cpp.require_cuda(what)  # raises BackendError with the build's reason
        cuda = name == "cuda"
        if what == "topk_merge_update":
            return lambda state, logits, c0: _cpp.topk_update(state, logits, c0, cuda=cuda)
        return lambda state, full: _cpp.topk_finalize(state, full, cuda=cuda)
    return loader


UPDATE_IMPLEMENTATIONS = {"torch": lambda: _update_torch, "cpp": _load("cpp", "topk_merge_update"),
                          "cuda": _load("cuda", "topk_merge_update")}
FINALIZE_IMPLEMENTATIONS = {"torch": lambda: _finalize_torch, "cpp": _load("cpp", "topk_merge_finalize"),
                            "cuda": _load("cuda", "topk_merge_finalize")}


def _extension_built() -> bool:
    try:
        from . import _cpp  # noqa: F401  (import is the check)
    except ImportError:
        return False
    return True


def _pick(op: str, table: dict, backend: Optional[str], device: torch.device):
    if backend is None and not os.environ.get(_backend.ENV_VAR):
        # this op has no Triton kernel: its device default is the csrc one
        backend = "cuda" if device.type == "cuda" else ("cpp" if _extension_built() else "torch")
    name, fn = _backend.resolve(op, table, backend, device)
    _backend.check_runs_on(name, device, op)
    return fn


# ---------------------------------------------------------------- public API
def topk_merge_update(state: TopKMergeState, chunk_logits: torch.Tensor, c0: int,
                      backend: Optional[str] = None) -> None:
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
    fn = _pick("topk_merge_update", UPDATE_IMPLEMENTATIONS, backend, state.device)
    fn(state, chunk_logits, c0)


def topk_merge_finalize(state: TopKMergeState, full_logprobs: bool = False,
                        backend: Optional[str] = None) -> TopKResult:
    """Top-k ids and log-probs from a state every vocabulary column has been merged into.

    Raises ValueError when fewer than k logits were merged into some row, or (with targets)
    when a row's target id lay in no merged chunk. Syncs with the device for those checks.
    """
    if state.rows and int(state.ids.min()) < 0:
        raise ValueError(f"topk_merge_finalize: k={state.k} exceeds the number of logits merged into some row")
    if state.targets is not None and state.rows and bool(torch.isnan(state.target_logit).any()):
        raise ValueError("topk_merge_finalize: a row's target id was in no merged chunk (or its logit is NaN)")
    fn = _pick("topk_merge_finalize", FINALIZE_IMPLEMENTATIONS, backend, state.device)
    out = fn(state, bool(full_logprobs))
    has_t = state.targets is not None
    return TopKResult(
        ids=state.ids.long(), topk_logits=state.values.clone(), logprobs=out["logprobs"],
        logprobs_full=out["logprobs_full"], logsumexp=out["logsumexp"],
        target_logprob=out["target_logprob"] if has_t else None,
        target_logprob_topk=out["target_logprob_topk"] if has_t else None,
        target_in_topk=out["target_in_topk"] if has_t else None,
    )


def topk_merge_ref(logits: torch.Tensor, k: int, targets: Optional[torch.Tensor] = None,
                   temperature: float = 1.0, full_logprobs: bool = False) -> TopKResult:
    """Oracle on materialised logits [T, V]: stable descending sort (ties keep ascending id
    order, i.e. the lower id first), log-probs in fp64 rounded to fp32."""
    k = _check_k(k, "topk_merge_ref")
    v = logits.float() / _check_temperature(temperature, "topk_merge_ref")
    if k > v.shape[1]:
        raise ValueError(f"topk_merge_ref: k={k} exceeds the vocabulary width {v.shape[1]}")
    vals, ids = torch.sort(v, dim=1, descending=True, stable=True)
    vals, ids = vals[:, :k], ids[:, :k]
    lse = torch.logsumexp(v.double(), dim=1)
    lp = torch.log_softmax(vals.double(), dim=1)
    res = dict(ids=ids, topk_logits=vals, logprobs=lp.float(), logsumexp=lse.float(),
               logprobs_full=(vals.double() - lse[:, None]).float() if full_logprobs else None,
               target_logprob=None, target_logprob_topk=None, target_in_topk=None)
    if targets is not None:
        hit = ids == targets[:, None]
        in_topk = hit.any(dim=1)
        res["target_logprob"] = (v.double().gather(1, targets[:, None])[:, 0] - lse).float()
        res["target_logprob_topk"] = torch.where(
            in_topk, torch.where(hit, lp, torch.zeros_like(lp)).sum(1), torch.tensor(float("-inf"), dtype=lp.dtype)
        ).float()
        res["target_in_topk"] = in_topk
    return TopKResult(**res)


# ---------------------------------------------------------------- drivers for topk_logprobs
#: vocabulary columns per GEMM when the caller passes chunk=None: [T, chunk] fp32 is the peak
#: extra memory (T=512: 16 MB on CPU, 32 MB on GPU, where wider GEMMs keep cuBLAS busy)
DEFAULT_CHUNK = {"cpu": 8192, "cuda": 16384}

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


def _check_core(hidden, weight, targets, k, chunk, temperature, op):
    V = check_projection_inputs(hidden, weight, targets, op, temperature=temperature, chunk=chunk)
    k = _check_k(k, op)
    if k > V:
        raise ValueError(f"{op}: k={k} exceeds the vocabulary size {V}")


def _core(hidden, weight, targets, k, chunk, temperature, backend, op):
    _check_core(hidden, weight, targets, k, chunk, temperature, op)
    T, V = hidden.shape[0], weight.shape[0]
    state = topk_merge_init(T, k, hidden.device, targets=targets.long(), temperature=temperature)
    fn = _pick("topk_merge_update", UPDATE_IMPLEMENTATIONS, backend, hidden.device)
    chunk = min(chunk or DEFAULT_CHUNK.get(hidden.device.type, DEFAULT_CHUNK["cpu"]), V)
    gemm = _chunk_gemm(hidden)
    if T:
        for c0 in range(0, V, chunk):
            fn(state, gemm(weight[c0:c0 + chunk]), c0)
    lse = (state.row_max.double() + state.row_sumexp.log()).float()
    return state.values, state.ids.long(), state.target_logit, lse


def topk_logprobs_core_cpp(hidden, weight, targets, k: int, chunk: Optional[int], temperature: float):
    """Top-k of ``hidden @ weight.T / temperature`` without materialising [T, V]; C++ CPU merge.

    Args:
      hidden: [T, H] float; weight: [V, H] same dtype (lm_head); targets: [T] int64/int32 in [0, V).
      k: 1 .. min(V, 4096); chunk: vocabulary columns per GEMM (None: DEFAULT_CHUNK), peak
        extra memory T × chunk fp32; temperature: > 0.
    Logits are fp32 GEMMs of the fp32-upcast inputs, one chunk at a time, then divided by the
    temperature in fp32 (IEEE division, as ``logits / temperature`` in torch).
    Returns:
      topk_logits [T, k] fp32 (logits / temperature, descending; ties: lower id first),
      topk_ids [T, k] int64, target_logit [T] fp32, logsumexp [T] fp32 (full vocabulary).
    """
    return _core(hidden, weight, targets, k, chunk, temperature, "cpp", "topk_logprobs_core_cpp")


def topk_logprobs_core_cuda(hidden, weight, targets, k: int, chunk: Optional[int], temperature: float):
    """As ``topk_logprobs_core_cpp`` on CUDA tensors: cuBLAS GEMM per chunk + the CUDA merge kernel."""
    return _core(hidden, weight, targets, k, chunk, temperature, "cuda", "topk_logprobs_core_cuda")
