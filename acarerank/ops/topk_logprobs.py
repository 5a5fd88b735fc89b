"""Top-k truncated teacher log-probs (ATO; docs/ARCHITECTURE.md, "Top-k stack") without materialising [T, V] logits.

For each row t with hidden state h_t, lm_head W (V×H), sampled token y_t and temperature τ:

    z_t      = (h_t · Wᵀ) / τ                                        logits of the whole vocabulary
    K_t      = the k largest entries of z_t, ordered by (value desc, id asc)   — the tie rule
    renormalize=True   log p̃(j) = z_tj − logsumexp_{i∈K_t} z_ti   for j ∈ K_t   (truncated teacher)
    renormalize=False  log p̃(j) = z_tj − logsumexp_{i<V} z_ti      for j ∈ K_t   (full-softmax values)

and the target's log-prob ``target_logprob[t] = log p̃(y_t)`` when y_t ∈ K_t. When y_t ∉ K_t
the renormalised truncated teacher gives it probability zero (log-prob −∞), which no
advantage can use, so ``outside`` makes the choice explicit:

  "floor" (default)  a fixed log-prob ``floor`` (−20.0 ≈ log 2e-9). It keeps the truncated
                     teacher's verdict ("this token is (almost) impossible") as a large but
                     finite, bounded penalty, so every sampled token still gets a distillation
                     signal and no NaN/inf reaches the loss. verl's on-policy distillation does
                     the same with ``log_prob_min_clamp`` (default −10.0), applied there as a
                     clamp_min to every log-prob; here only out-of-top-k targets are set,
                     in-top-k values are returned exact. Caveat: if the k-th renormalised
                     log-prob of a row is below ``floor`` (a very peaked teacher), an outside
                     token scores higher than an inside one — pass a lower floor or "full".
  "mask"             0.0 (a NaN-free zero contribution); callers drop those tokens with
                     ``in_topk`` (a "drop" policy). Dropping biases the signal:
                     only tokens the teacher already likes get one.
  "full"             the teacher's untruncated full-softmax log-prob z_ty − logsumexp(z_t)
                     (OPSD's choice); with renormalize=True this mixes two normalisations.

``in_topk`` is returned either way, so a caller can switch policy without recomputing.

Structure: a backend *core* that never holds [T, V] and returns

    (topk_logits [T,k] fp32 sorted by (value desc, id asc), topk_ids [T,k] int64,
     target_logit [T] fp32, logsumexp [T] fp32 over the full vocabulary)   — all of z = logits/τ

and one shared ``finalize`` (renormalisation, ``outside``, ``in_topk``; in the leaf
``acarerank.topk_contract`` with the result type, ``DEFAULT_CHUNK`` and the per-backend k
limits ``MAX_K``). Cores, declared in ``OP``: "torch" (below: per-chunk GEMM, chunk top-k,
exact merge; any k <= V), "native" (the torch core's chunks with each one's merge, log-sum-exp
and target in csrc/cpu, ``acarerank::topk_chunk_update``, and, on bf16 where the CPU has AVX512_BF16, its chunk GEMM
``acarerank::mm_bf16_f32`` and, once k are held, the rest in ``acarerank::topk_gemm_update``; any k),
"triton" (acarerank/kernels/topk_logprobs.py; k <= 512), "cpp"/"cuda"
(below: a GEMM per chunk merged into topk_merge.py's streaming state, csrc/topk_merge.*;
k <= 4,096). Defaults: "native" on CPU where acarerank._cpu loads, else "torch"; on CUDA the
cuBLAS GEMM + CUDA merge ("cuda") until the Triton core is measured faster, then "triton".
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ..topk_contract import (MAX_K, OUTSIDE_MODES, TopKLogprobs, as_int, check_k, default_chunk, finalize,
                             logsumexp_of)
from . import _backend
from ._backend import META_TOO
from ._checks import NONFINITE_LOGITS, check_flag, check_projection_inputs, check_target_range, finite_real
from .linear_logprob import fp32_math
from ._logits_gemm import mm_bf16_f32_fake as _mm_bf16_f32_fake
from ._logits_gemm import native_bf16_gemm_for
from .topk_merge import UPDATE_OP, topk_merge_init


# ----------------------------------------------------------------------------- checks
#: the bound on V: ids are int32 in the cpp/cuda cores' merge state, and 2³¹ − 1 bounds the order
#: keys' range (``order_keys``) and the native core's ids (csrc/cpu/topk_chunk_update.cpp)
MAX_IDS = 2 ** 31 - 1

def _check_inputs(hidden, weight, targets, k, chunk, temperature, backend, op="topk_logprobs"):
    """The inputs, then k against the resolved ``backend`` (name or mapping); returns its name.
    Tensors first: resolving a backend reads hidden.device (a numpy array's is the str "cpu")."""
    V = check_projection_inputs(hidden, weight, targets, op, temperature=temperature, chunk=chunk)
    if V >= MAX_IDS:  # an expanded (stride-0) weight has any number of rows for no memory
        raise ValueError(f"{op}: weight has V={V} rows; ids must stay below 2**31 - 1 (the cpp/cuda cores keep "
                         f"int32 ids, the order keys take ids below 2**31 - 1), so V must be < {MAX_IDS}")
    name = OP.resolve(backend, hidden.device)
    check_k(k, V, name, op)
    return name


def _check_result_finite(lse, op="topk_logprobs", shard=False):
    """ValueError naming the rows whose log-sum-exp is not finite (inf/NaN logits). ``shard``: a
    vocabulary shard's lse, where −inf only says that the row's logits on the shard are all −inf
    (a masked part of the vocabulary), which the other shards may make up for; NaN and +inf
    are errors there too."""
    ok = (torch.isfinite(lse) | torch.isneginf(lse)) if shard else torch.isfinite(lse)
    if lse.numel() and not ok.all():
        rows = (~ok).nonzero().flatten().tolist()[:8]
        raise ValueError(f"{op}: {NONFINITE_LOGITS} in rows {rows}")


# ----------------------------------------------------------------------------- exact order
def order_keys(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is the tie rule: key(a) > key(b) ⇔ a.value > b.value, or equal and a.id < b.id.

    values fp32, ids int64 in [0, 2³¹) (same shape). key = ord(value)·2³² + (2³²−1−id) where ord
    is the signed-int32 image of the fp32 bits made monotone (negative floats have their
    magnitude bits flipped); −0.0 is folded into +0.0 first so the two zeros tie like torch's
    comparisons. Same key as csrc/topk_merge.cuh (there as an unsigned 64-bit word).
    """
    b = (values + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns −0.0 into +0.0
    # negative floats: flip the 31 magnitude bits (b >> 31 is −1 for them, 0 otherwise); in
    # place, so the merge holds one int64 temporary per candidate rather than five
    b ^= (b >> 31) & 0x7FFFFFFF
    return b.mul_(1 << 32).add_((1 << 32) - 1).sub_(ids)


def _merge_topk(av, ai, bv, bi, k):
    """The k best of two candidate lists under the tie rule, sorted best first."""
    v = torch.cat([av, bv], dim=1)
    i = torch.cat([ai, bi], dim=1)
    kk = min(k, v.shape[1])
    pos = order_keys(v, i).topk(kk, dim=1, sorted=True).indices
    return v.gather(1, pos), i.gather(1, pos)


def _row_counts(mask, block: int = 64):
    """Per-row number of True in a [T, C] bool mask, summed 64 rows at a time: torch sums a bool
    tensor by first copying it to int64, 8 bytes per entry — 8× the mask — so a whole-chunk
    sum would be the largest temporary of the op."""
    return torch.cat([mask[r:r + block].sum(dim=1) for r in range(0, mask.shape[0], block)])


def _chunk_topk(x, kc, c0, mask):
    """Top-kc of a [T, C] logits chunk with the exact tie rule; ids are global (offset c0).

    torch.topk's choice among values tied at the kc-th place is unspecified, so rows where an
    unselected entry equals the kc-th value are redone with order keys (ties are rare in fp32
    GEMM output but common with integer-like or low-precision logits). ``mask``: a [T, C]
    bool scratch buffer.
    """
    T, C = x.shape
    vals, idx = x.topk(kc, dim=1, sorted=False)
    if kc < C:
        kth = vals.min(dim=1, keepdim=True).values
        tied = (_row_counts(torch.ge(x, kth, out=mask)) > kc).nonzero().flatten()
        # 64 rows at a time: a row's keys take 8 bytes per logit and order_keys two more int64
        # temporaries, so repairing every row at once (all-zero hidden rows tie everywhere)
        # held ~7x the [T, C] fp32 buffer (T=4,096: 270 MB against 40 MB of buffers)
        for r in range(0, tied.numel(), 64):
            rows = tied[r:r + 64]
            xr = x[rows]
            ids = torch.arange(c0, c0 + C, device=x.device).expand_as(xr)
            pos = order_keys(xr, ids).topk(kc, dim=1, sorted=False).indices
            vals[rows] = xr.gather(1, pos)
            idx[rows] = pos
    return vals, idx + c0


# ----------------------------------------------------------------------------- torch core
def _initial_state(T: int, dev):
    """The running state before the first chunk: no entries held ([T, 0] values and ids), the max
    −inf, Σ exp(z − m) 0 in fp64 (a 151,669-term sum), the target logits NaN until their chunk."""
    return (torch.empty(T, 0, dtype=torch.float32, device=dev), torch.empty(T, 0, dtype=torch.int64, device=dev),
            torch.full((T,), -math.inf, dtype=torch.float32, device=dev),
            torch.zeros(T, dtype=torch.float64, device=dev),
            torch.full((T,), math.nan, dtype=torch.float32, device=dev))


def _no_rows(k: int, dev):
    """A core's result for T = 0."""
    return (torch.empty(0, k, dtype=torch.float32, device=dev), torch.empty(0, k, dtype=torch.int64, device=dev),
            torch.empty(0, dtype=torch.float32, device=dev), torch.empty(0, dtype=torch.float32, device=dev))


def topk_logprobs_core_torch(hidden, weight, targets, k: int, chunk: Optional[int], temperature: float):
    """Chunked core: per chunk of ``chunk`` vocabulary rows, one GEMM [T,H]×[H,C] in fp32, the
    chunk's candidates, an exact merge into the running top-k, and an online log-sum-exp.

    Once a row holds k entries with k-th value θ, a chunk entry can enter only if it is > θ
    strictly: chunks come in increasing id order, so an entry equal to θ loses the tie to the
    held one. The chunk's top-k is then taken only as wide as its widest row's count of
    entries > θ (≈ k·C/c0 for random order, usually a few), and that narrow top-k needs no tie
    repair: every entry > θ is in it. Until k entries are held, or when a row has more than k
    entries > θ (logits rising with the id), the chunk's exact top-k is taken and its boundary
    ties are repaired (``_chunk_topk``): never more than k candidates per chunk. Candidates wait in a small buffer
    and are merged once ≥ k of them are pending (θ is refreshed at each merge), so the held
    top-k is re-sorted a handful of times instead of once per chunk.

    Measured (bench/bench_topk_logprobs.py, T=512, H=1024, V=151,669, k=128, fp32, 2 CPU cores):
    0.92–0.97× the time of the bare [T, V] GEMM, peak extra 13.6 MB of tensors = 2.3 % of the
    materialised path.

    Peak extra memory: one [T, C] fp32 logits buffer and one [T, C] bool buffer, both
    allocated once and reused by every chunk (the GEMM writes into the buffer: no per-chunk
    malloc/free, so no page faults or heap growth per chunk), + O(T·k) + 64·C int64 for the
    counts and ~4 · 64·C int64 for a tie repair (64 rows at a time); the log-sum-exp
    exponentiates the chunk in place. Inputs of other dtypes are upcast to fp32 one chunk at a
    time into a third reused buffer [C, H]. The "native" core (below) takes the same steps with
    the per-chunk work after the first k in C++.
    Returns (topk_logits [T,k] fp32, topk_ids [T,k] int64, target_logit [T] fp32, lse [T] fp32).
    """
    T, H = hidden.shape
    V = weight.shape[0]
    C = min(chunk or default_chunk(hidden.device), V)
    dev = hidden.device
    h = hidden if hidden.dtype == torch.float32 else hidden.float()
    tg = targets.to(torch.int64)
    run_v, run_i, m, s, tgt = _initial_state(T, dev)
    pend_v, pend_i, pending = [], [], 0  # candidates not merged yet
    if T == 0:
        return _no_rows(k, dev)
    xbuf = torch.empty(T * C, dtype=torch.float32, device=dev)
    mbuf = torch.empty(T * C, dtype=torch.bool, device=dev)
    upcast = weight.dtype != torch.float32
    wbuf = torch.empty(C * H, dtype=torch.float32, device=dev) if upcast else None
    for c0 in range(0, V, C):
        c1 = min(V, c0 + C)
        n = c1 - c0
        w = weight[c0:c1]
        x = xbuf[:T * n].view(T, n)  # [T, n] fp32
        if wbuf is not None:
            w = wbuf[:n * H].view(n, H).copy_(w)
        torch.mm(h, w.T, out=x)
        mask = mbuf[:T * n].view(T, n)
        if temperature != 1.0:
            x.div_(temperature)  # division (not × 1/τ) so every backend rounds identically
        # -- target logits that fall in this chunk
        rows = ((tg >= c0) & (tg < c1)).nonzero().flatten()
        if rows.numel():
            tgt[rows] = x[rows, tg[rows] - c0]
        # -- this chunk's candidates
        vals = None
        if run_v.shape[1] < k:
            vals, ids = _chunk_topk(x, min(k, n), c0, mask)
        else:
            kc = int(_row_counts(torch.gt(x, run_v[:, k - 1:], out=mask)).max())
            if kc > k:  # at most k of them can enter: the chunk's exact top-k, never kc (up to C) wide
                vals, ids = _chunk_topk(x, k, c0, mask)
            elif kc:
                vals, ids = x.topk(kc, dim=1, sorted=False)
                ids = ids + c0
        if vals is not None:
            pend_v.append(vals)
            pend_i.append(ids)
            pending += vals.shape[1]
        if pending and (run_v.shape[1] < k or pending >= k or c1 == V):
            run_v, run_i = _merge_topk(run_v, run_i, torch.cat(pend_v, 1), torch.cat(pend_i, 1), k)
            pend_v, pend_i, pending = [], [], 0
        # -- online log-sum-exp; x is consumed in place. The new running max is the max of the
        #    old one and this chunk's top entry (any chunk entry above it is a candidate).
        #    ±inf max: shift by 0, as topk_merge's fold (a row whose logits so far all overflowed
        #    to −inf gave −inf − (−inf) = NaN: an error or not depending on the chunk size)
        m_new = torch.maximum(m, vals.max(dim=1).values) if vals is not None else m
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        s = s * torch.exp((m - shift).double()) + x.sub_(shift[:, None]).exp_().sum(dim=1).double()
        m = m_new
    return run_v, run_i, tgt, logsumexp_of(m, s)


# ----------------------------------------------------------------------------- native core
def _topk_chunk_update_fake(x, id0, targets, run_v, run_i, m, s, tgt):
    return None


def _topk_gemm_update_fake(hidden, weight, id0, temperature, targets, run_v, run_i, m, s, tgt):
    return None


def topk_logprobs_core_native(hidden, weight, targets, k: int, chunk: Optional[int], temperature: float):
    """The torch core's chunks and results, with its per-chunk work in acarerank._cpu: until a row
    holds k logits the torch core's steps (``_chunk_topk``, ``_merge_topk``, usually the first
    chunk only), then one ``acarerank::topk_chunk_update`` per chunk — the chunk's entries above
    each row's k-th value merged into the held k in C++, the online log-sum-exp and the target's
    logit (csrc/cpu/topk_chunk_update.cpp) — where Python ran a dozen small ops, a merge by order
    keys and a ``torch.topk`` every k candidates. The entries and their order are the torch core's,
    so fp32 top-k ids are bitwise its own; log-probs agree to fp32 rounding of the log-sum-exp.
    On bf16 inputs where the CPU has AVX512_BF16 the chunk GEMM is ``acarerank::mm_bf16_f32``:
    fp32 logits straight from the bf16 rows, at the bf16 GEMM's rate (the torch core upcasts each
    chunk and runs an fp32 GEMM, ~4.5× the time on such a CPU: docs/benchmarks.md, "Ops and
    kernels"). Its products are exact in fp32; the sums differ in order (and the instruction
    flushes subnormals), so bf16 logits agree with the torch core's to fp32 rounding, as two GEMMs
    do. There, once every row holds k logits, the rest of the vocabulary goes to one
    ``acarerank::topk_gemm_update`` (csrc/cpu/topk_gemm_update.cpp): the same GEMM's logits folded
    into the state block by block while each block is in L2, never a chunk in memory; the same
    entries, the log-sum-exp summed in another grouping. Memory as the torch core's: one [T, C]
    fp32 buffer (and, upcasting, one [C, H]) reused by every chunk, the [T, k] state (and, in the
    fused op, copies of it for threads that split the vocabulary, 64 MB at most, and ~1 MB of
    blocks a thread: csrc/cpu/topk_gemm_update.cpp)."""
    from ._native_backend import native_kernel

    if hidden.dtype == torch.bfloat16 and hidden.stride(1) != 1:
        hidden = hidden.contiguous()  # the GEMM takes contiguous rows; [T, H]: small beside the weight
    gemm = native_bf16_gemm_for(hidden, weight)
    update = native_kernel("topk_chunk_update", _topk_chunk_update_fake)
    fused = native_kernel("topk_gemm_update", _topk_gemm_update_fake) if gemm is not None else None
    T, H = hidden.shape
    V = weight.shape[0]
    C = min(chunk or default_chunk(hidden.device), V)
    dev = hidden.device
    h = hidden if hidden.dtype == torch.float32 or gemm is not None else hidden.float()
    tg = targets.to(torch.int64).contiguous()
    run_v, run_i, m, s, tgt = _initial_state(T, dev)
    if T == 0:
        return _no_rows(k, dev)
    xbuf = torch.empty(T * C, dtype=torch.float32, device=dev)
    mbuf = None
    wbuf = torch.empty(C * H, dtype=torch.float32, device=dev) if weight.dtype != torch.float32 and gemm is None \
        else None
    for c0 in range(0, V, C):
        if fused is not None and run_v.shape[1] == k:  # every row holds k: the rest in one call
            fused(h, weight, c0, float(temperature), tg, run_v, run_i, m, s, tgt)
            break
        c1 = min(V, c0 + C)
        n = c1 - c0
        x = xbuf[:T * n].view(T, n)  # [T, n] fp32
        if gemm is not None:
            gemm(h, weight[c0:c1], x)
        else:
            w = weight[c0:c1] if wbuf is None else wbuf[:n * H].view(n, H).copy_(weight[c0:c1])
            torch.mm(h, w.T, out=x)
        if temperature != 1.0:
            x.div_(temperature)  # division (not × 1/τ) so every backend rounds identically
        if run_v.shape[1] == k:
            update(x, c0, tg, run_v, run_i, m, s, tgt)
            continue
        # -- filling: the torch core's steps, until every row holds k logits
        if mbuf is None:
            mbuf = torch.empty(T * C, dtype=torch.bool, device=dev)
        rows = ((tg >= c0) & (tg < c1)).nonzero().flatten()
        if rows.numel():
            tgt[rows] = x[rows, tg[rows] - c0]
        vals, ids = _chunk_topk(x, min(k, n), c0, mbuf[:T * n].view(T, n))
        run_v, run_i = _merge_topk(run_v, run_i, vals, ids, k)
        m_new = torch.maximum(m, vals.max(dim=1).values)
        shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        s = s * torch.exp((m - shift).double()) + x.sub_(shift[:, None]).exp_().sum(dim=1).double()
        m = m_new
        run_v, run_i = run_v.contiguous(), run_i.contiguous()
    return run_v, run_i, tgt, logsumexp_of(m, s)


# ----------------------------------------------------------------------------- reference
def topk_logprobs_ref(hidden, weight, targets, k: int = 128, outside: str = "floor", floor: float = -20.0,
                      renormalize: bool = True, temperature: float = 1.0) -> TopKLogprobs:
    """The one top-k oracle: materialise fp32 logits, sort by (value desc, id asc) explicitly, log_softmax in fp64.

    hidden [T, H] and weight [V, H]; or ``weight=None`` and ``hidden`` the logits [T, V]
    themselves (the streaming state's tests feed logits). targets [T] or None.
    """
    logits = hidden.float() if weight is None else hidden.float() @ weight.float().T
    if temperature != 1.0:
        logits = logits / temperature
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"topk_logprobs_ref: k={k} must be in [1, V={logits.shape[1]}]")
    # stable descending sort keeps ascending id order among equal values (torch.topk would not)
    sv, si = torch.sort(logits, dim=1, descending=True, stable=True)
    top_v, top_i = sv[:, :k].double(), si[:, :k]
    full_lse = torch.logsumexp(logits.double(), dim=1)
    norm = torch.logsumexp(top_v, dim=1) if renormalize else full_lse
    top_lp = top_v - norm[:, None]
    if targets is None:
        return TopKLogprobs(None, top_i, top_lp.float(), None)
    tg = targets.long()
    hit = top_i == tg[:, None]
    in_topk = hit.any(dim=1)
    inside = torch.where(hit, top_lp, torch.zeros_like(top_lp)).sum(1)
    full_t = logits.double().gather(1, tg[:, None])[:, 0] - full_lse
    out = {"floor": torch.full_like(inside, float(floor)), "mask": torch.zeros_like(inside), "full": full_t}[outside]
    return TopKLogprobs(torch.where(in_topk, inside, out).float(), top_i, top_lp.float(), in_topk)


# ----------------------------------------------------------------------------- cpp / cuda cores

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
    return state.values, state.ids.long(), state.target_logit, logsumexp_of(state.row_max, state.row_sumexp)


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


# ----------------------------------------------------------------------------- declaration
def _load_native():
    """The native core, once acarerank._cpu loads (BackendError naming why not: the CPU default
    then walks on to "torch")."""
    from ._native_backend import native_kernel

    native_kernel("mm_bf16_f32", _mm_bf16_f32_fake)
    native_kernel("topk_chunk_update", _topk_chunk_update_fake)
    return topk_logprobs_core_native


OP = _backend.OpDecl(
    "topk_logprobs", aliases=("topk",),
    backends={"torch": _backend.Backend(lambda: topk_logprobs_core_torch, META_TOO),
              "native": _backend.Backend(_load_native, ("cpu",)),
              "triton": _backend.lazy_backend("topk_logprobs", "triton", "acarerank.kernels.topk_logprobs",
                                              "topk_logprobs_core_triton"),
              # the cpp / cuda cores are below; what they need is the built extension
              "cpp": _backend.lazy_backend("topk_logprobs", "cpp", "acarerank.ops._cpp", "topk_update", ("cpu",),
                                           wrap=lambda _: topk_logprobs_core_cpp),
              "cuda": _backend.lazy_backend("topk_logprobs", "cuda", "acarerank.ops._cpp", "topk_update", ("cuda",),
                                            needs_cuda_build=True, wrap=lambda _: topk_logprobs_core_cuda)},
    defaults={"cpu": ("native", "torch"), "cuda": ("cuda", "triton", "torch"), "meta": ("torch",)},
)


@torch.library.custom_op("acarerank::topk_logprobs_core", mutates_args=())
def topk_logprobs_core_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, k: int, chunk: int,
                          temperature: float, backend: str, shard: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_logits [T,k] fp32, topk_ids [T,k] int64, target_logit [T] fp32, logsumexp [T] fp32); chunk 0 = default.

    The two checks that read the data — targets in [0, V), a finite log-sum-exp per row (−inf
    too with ``shard``, ``topk_logprobs_core``) — are ValueErrors raised here, on the real
    tensors: in the Python wrapper each was a host sync that torch.compile cannot trace (two
    graph breaks; a UserError about a data-dependent guard under fullgraph=True)."""
    check_target_range(targets, weight.shape[0], "topk_logprobs")
    # autocast off: under torch.autocast the cpp/cuda cores' chunk GEMM (torch.mm without out=)
    # gave bf16/fp16 logits — other top-k ids and log-probs off by ~0.05, with no error
    with fp32_math(hidden.device):
        out = tuple(OP.impl(backend)(hidden, weight, targets, k, chunk or None, temperature))
    _check_result_finite(out[3], shard=shard)
    return out


@topk_logprobs_core_op.register_fake
def _(hidden, weight, targets, k, chunk, temperature, backend, shard=False):
    T = hidden.shape[0]
    return (hidden.new_empty(T, k, dtype=torch.float32), hidden.new_empty(T, k, dtype=torch.int64),
            hidden.new_empty(T, dtype=torch.float32), hidden.new_empty(T, dtype=torch.float32))


def topk_logprobs_core(hidden, weight, targets, k: int = 128, chunk: Optional[int] = None, temperature: float = 1.0,
                       backend=None, *, shard: bool = False):
    """The local core, narrow on purpose (a vocabulary-parallel top-k builds on exactly this):

        (hidden [T, H], weight [V, H], targets [T], k, chunk, temperature)
          -> (topk_logits [T, k] fp32 sorted (value desc, id asc), topk_ids [T, k] int64,
              target_logit [T] fp32, logsumexp [T] fp32 over the V rows of ``weight``)

    all of z = (hidden · weightᵀ) / temperature. ``weight`` may be a vocabulary shard: ids are
    then local to it (add the shard's offset), and shards combine by merging the top-k lists
    under the tie rule and the log-sum-exps by logaddexp. k: within the backend's limit
    (``MAX_K``: torch/native any, triton 512, cpp/cuda 4,096), else ValueError naming the limit.
    A row with non-finite logits is a ValueError; ``shard=True`` lets a row whose logits are
    all −inf here through (logsumexp −inf, its top-k −inf in id order): the caller checks the
    combined log-sum-exp.
    """
    name = _check_inputs(hidden, weight, targets, k, chunk, temperature, backend)
    with torch.no_grad():  # the teacher is frozen: its log-probs are constants (stop-gradient)
        return topk_logprobs_core_op(hidden, weight, targets, k, chunk or 0, float(temperature), name, shard)


def topk_logprobs(hidden, weight, targets, k: int = 128, chunk: Optional[int] = None, outside: str = "floor",
                  floor: float = -20.0, renormalize: bool = True, temperature: float = 1.0,
                  backend=None, process_group=None, vocab_start: Optional[int] = None,
                  vocab_size: Optional[int] = None) -> TopKLogprobs:
    """Teacher log-probs truncated to its top-k logits, never materialising [T, V].

    Args:
      hidden: [T, H] hidden states AFTER the final RMSNorm (fp32/bf16/fp16).
      weight: [V, H] lm_head weight, same dtype and device as ``hidden``; V < 2**31 - 1.
      targets: [T] int64 (or int32) sampled token ids in [0, V).
      k: 1 <= k <= V (ATO: 128) and within the backend's limit (``MAX_K``: torch/native any,
         triton 512, cpp/cuda 4,096). chunk: vocabulary rows per GEMM (default ``DEFAULT_CHUNK`` of
         the device: 2,048 on CPU, 16,384 on CUDA; the triton core tiles on its own).
         temperature τ > 0 divides the logits before truncation.
      backend: a name, a per-op mapping or None (``acarerank.ops._backend``).
      outside: "floor" | "mask" | "full" — what a target outside the top-k gets (module doc).
      floor: the "floor" log-prob. renormalize: normalise over the top-k (True) or over V.
      process_group: a torch.distributed group over which the lm_head is split by vocabulary
        rows (Megatron's layout): ``weight`` is then this rank's rows [V_r, H], ``vocab_start``
        the id of its first row (default rank · ceil(ΣV_r / world)) and ``vocab_size`` the true
        vocabulary (rows past it are padding). Collective; same result on every rank; see
        ``acarerank.ops.vocab_parallel``. None (default): this single-process op.
    Returns: TopKLogprobs(target_logprob [T] fp32, topk_ids [T,k] int64 (best first; ties:
      lower id first), topk_logprobs [T,k] fp32, in_topk [T] bool).
    Math in fp32 (inputs upcast per chunk), inside a ``torch.autocast`` region too; the result
    does not depend on ``chunk`` except through fp32 summation order (≤ 1e-6 in log-probs).
    Not differentiable: the teacher is frozen (use ``linear_logprob`` for the policy).
    """
    k = as_int(k)   # numpy.int64(128) is 128; anything else is named by check_k
    if process_group is not None:  # every check happens collectively there, so bad input never hangs a rank
        sharded = _backend.process_group_impl("topk_logprobs")  # acarerank.ops.vocab_parallel
        return sharded(hidden, weight, targets, k, chunk, outside, floor, renormalize, temperature, backend,
                       process_group=process_group, vocab_start=vocab_start, vocab_size=vocab_size)
    if vocab_start is not None or vocab_size is not None:
        raise ValueError("topk_logprobs: vocab_start / vocab_size describe a vocabulary shard; pass process_group too")
    if outside not in OUTSIDE_MODES:
        raise ValueError(f"topk_logprobs: outside must be one of {OUTSIDE_MODES}, got {outside!r}")
    if not finite_real(floor):
        raise ValueError(f"topk_logprobs: floor must be a finite number, got {floor!r}")
    check_flag("topk_logprobs", "renormalize", renormalize)  # 1 or "no" picked a normalisation with no word
    topk_logits, topk_ids, target_logit, lse = topk_logprobs_core(hidden, weight, targets, k, chunk, temperature,
                                                                   backend)
    return finalize(topk_logits, topk_ids, target_logit, lse, targets, outside, floor, renormalize)


__all__ = ["TopKLogprobs", "OUTSIDE_MODES", "MAX_K", "OP", "topk_logprobs", "topk_logprobs_core", "topk_logprobs_ref",
           "topk_logprobs_core_op", "topk_logprobs_core_torch", "finalize", "order_keys"]
