"""Top-k truncated log-probs core (ATO teacher), Triton: logits tiles never leave the chip.

docs/ARCHITECTURE.md, "Top-k stack".

For rows t and vocabulary ids j, z_tj = (h_t · W_j) / τ. The core returns, per row, the k best
z (value desc, id asc), their ids, z at the row's target id, and logsumexp_j z_tj — the
contract of ``acarerank.ops.topk_logprobs`` — without writing [T, V] anywhere.

Stage 1, ``_topk_tiles_kernel``, grid (row blocks, vocabulary splits): each program walks
its split of the vocabulary in BLOCK_V tiles. Per tile it
  * forms the logits tile with ``tl.dot`` over H in BLOCK_H steps (fp32 accumulate; fp32
    inputs in IEEE precision, not TF32, so the result matches a torch fp32 GEMM to ~1e-6);
  * updates an online log-sum-exp (m, s) and picks up the target logit if it is in the tile;
  * packs each logit with its id into one int64 order key (``_order_key``: key(a) > key(b)
    iff a.value > b.value or equal values and a.id < b.id), takes the tile's top-KT keys with
    a bitonic top-k (sorted descending), and merges them into the running top-K (sorted
    ascending) with one elementwise max — max(ascending, descending) of two sorted lists is
    the top half of their union, as a bitonic sequence — followed by one bitonic merge.
Stage 2, ``_topk_merge_kernel``, grid (row blocks,): the same max-merge over the splits'
top-K lists (stored best first, so no flip is needed), the log-sum-exp combine, key
decoding and the stores (first k of K).

One key per candidate makes the tie rule exact and the merge branch-free; K (k rounded up
to a power of two) keys of 8 bytes per row and split are all that reach global memory.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from acarerank._triton_env import interpreter_lock, triton_interpreted
from acarerank.topk_contract import MAX_K as _LIMITS

_SENTINEL = tl.constexpr(-(2 ** 63))  # an order key below every real one (masked columns, empty slots)
MAX_K = _LIMITS["triton"]  # 512: the running top-K lives in registers, [BLOCK_T, K] int64


@triton.jit
def _order_key(x, cols):
    """int64 key of fp32 logits x [BT, BV] at vocabulary ids cols [BV] (see module docstring)."""
    x = tl.where(x == 0.0, 0.0, x)  # −0.0 ties with +0.0, as in torch comparisons
    b = x.to(tl.int32, bitcast=True)
    o = tl.where(b < 0, b ^ 0x7FFFFFFF, b)  # signed image of the float order
    return (o.to(tl.int64) << 32) + (4294967295 - cols.to(tl.int64))[None, :]


# -- bitonic networks over the last dim of [BT, N] (N a power of two), on the hypercube view
#    [2]*log2(BT·N) as in triton.language.standard.sort. The compare-and-swap takes min/max
#    over one size-2 axis instead of the library's xor_sum partner exchange: on a GPU both
#    are register shuffles, but the interpreter runs min/max in numpy and xor_sum (a custom
#    reduce) one element at a time in Python — 1000× slower, too slow to test anything.
@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
    return tl.reshape(tl.arange(0, 2), [1] * (n_dims - j - 1) + [2] + [1] * j)


@triton.jit
def _compare_swap(h, flip, i: tl.constexpr):
    n_dims: tl.constexpr = _log2(h.numel)
    lo = tl.min(h, axis=n_dims - 1 - i, keep_dims=True)
    hi = tl.max(h, axis=n_dims - 1 - i, keep_dims=True)
    right = _indicator(n_dims, i)
    return tl.where((flip ^ right).to(tl.int1), hi, lo)  # left slot: min (ascending) / max (flipped)


@triton.jit
def _bitonic_stage(h, stage: tl.constexpr, order: tl.constexpr):
    """One bitonic merge over the innermost ``stage`` dims; order 0 asc, 1 desc, 2 alternating."""
    if order == 2:
        flip = _indicator(_log2(h.numel), stage)
    else:
        flip = order
    for i in tl.static_range(stage):
        h = _compare_swap(h, flip, stage - 1 - i)
    return h


@triton.jit
def _topk_desc(x, KT: tl.constexpr):
    """The KT largest of each row of x [BT, N], sorted descending -> [BT, KT] (bitonic top-k)."""
    if KT == 1:
        return tl.max(x, axis=1, keep_dims=True)
    else:
        log_n: tl.constexpr = _log2(x.shape[1])
        log_k: tl.constexpr = _log2(KT)
        h = tl.reshape(x, [2] * _log2(x.numel))
        for i in tl.static_range(1, log_k + 1):
            h = _bitonic_stage(h, i, 2 if i < log_n else 1)
        for i in tl.static_range(log_k + 1, log_n + 1):
            h = tl.max(h, axis=_log2(h.numel) - 1 - log_k)  # keep the larger half of each pair of runs
            h = _bitonic_stage(h, log_k, 2 if i < log_n else 1)
        return tl.reshape(h, [x.shape[0], KT])


@triton.jit
def _merge_sorted(state, top, K: tl.constexpr):
    """Top-K of (state ∪ top): state [BT, K] ascending, top [BT, K] descending -> [BT, K] ascending.

    Elementwise max of an ascending and a descending list is the top half of their union, as a
    bitonic sequence; one bitonic merge (log2 K compare-swap rounds) sorts it.
    """
    m = tl.maximum(state, top)
    if K == 1:
        return m
    else:
        h = tl.reshape(m, [2] * _log2(m.numel))
        h = _bitonic_stage(h, _log2(K), 0)
        return tl.reshape(h, m.shape)


# T and the split count (chosen from T on GPU) vary per call: runtime arguments, never
# constexpr or specialized, so one compiled kernel serves every T (no recompile, no stall)
@triton.jit(do_not_specialize=["T", "NSPLIT"])
def _topk_tiles_kernel(Hid, W, Tgt, KeysOut, MaxOut, SumOut, TgtOut,
                       T, V, H, span, temperature,
                       stride_ht, stride_hh, stride_wv, stride_wh, NSPLIT,
                       K: tl.constexpr, KT: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                       HAS_TEMP: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    pid_t = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    tgt = tl.load(Tgt + rows, mask=row_ok, other=-1)
    v_lo = split * span
    v_hi = tl.minimum(v_lo + span, V)

    state = tl.full([BLOCK_T, K], _SENTINEL, tl.int64)  # running top-K keys, ascending
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_T], tl.float64)  # Σ exp(x − m) over up to 151,669 terms: fp64 across tiles
    tgt_val = tl.zeros([BLOCK_T], tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        cols64 = cols.to(tl.int64)
        # -- logits tile: [BLOCK_T, BLOCK_H] · [BLOCK_H, BLOCK_V], fp32 accumulate
        acc = tl.zeros([BLOCK_T, BLOCK_V], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            hh = h0 + tl.arange(0, BLOCK_H)
            h_ok = hh < H
            a = tl.load(Hid + rows64[:, None] * stride_ht + hh[None, :] * stride_hh,
                        mask=row_ok[:, None] & h_ok[None, :], other=0.0)
            b = tl.load(W + cols64[None, :] * stride_wv + hh[:, None] * stride_wh,
                        mask=col_ok[None, :] & h_ok[:, None], other=0.0)
            if UPCAST:  # interpreter: its tl.dot multiplies bf16 bit patterns as uint16
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_TEMP:
            acc = tl.math.div_rn(acc, temperature)  # IEEE division, as torch's x / τ
        x = tl.where(col_ok[None, :], acc, float("-inf"))
        # -- online log-sum-exp; shifted by 0 while a row has seen only −inf (logits overflowing
        #    fp32): −inf − (−inf) would be NaN, an error that depended on the tiling
        m_new = tl.maximum(m, tl.max(x, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift).to(tl.float64) + tl.sum(tl.exp(x - shift[:, None]), 1).to(tl.float64)
        m = m_new
        # -- target logit (exactly one tile of one split holds it)
        hit = cols[None, :] == tgt[:, None]
        tgt_val += tl.sum(tl.where(hit, x, 0.0), 1)
        # -- tile top-KT keys (descending), padded to K with sentinels, merged into the state
        keys = tl.where(col_ok[None, :], _order_key(x, cols), _SENTINEL)
        top = _topk_desc(keys, KT)
        if KT < K:
            # [BT, KT] -> [BT, K]: real keys first, sentinels after (still descending)
            pad = tl.arange(0, K // KT)[None, :, None] == 0
            top = tl.reshape(tl.where(pad, top[:, None, :], _SENTINEL), [BLOCK_T, K])
        state = _merge_sorted(state, top, K)

    base = rows64 * NSPLIT + split
    kk = tl.arange(0, K)
    # stored best first (slot K−1−j), so the merge stage reads a descending list as is
    tl.store(KeysOut + base[:, None] * K + (K - 1 - kk)[None, :], state, mask=row_ok[:, None])
    tl.store(MaxOut + base, m, mask=row_ok)
    tl.store(SumOut + base, s, mask=row_ok)
    mine = row_ok & (tgt >= v_lo) & (tgt < v_hi)
    tl.store(TgtOut + rows, tgt_val, mask=mine)


@triton.jit(do_not_specialize=["T", "NSPLIT"])
def _topk_merge_kernel(KeysIn, MaxIn, SumIn, TopVal, TopId, Lse, T, k, NSPLIT,
                       K: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, K)
    base = rows64 * NSPLIT
    # split 0 read back-to-front: ascending; later splits as stored: descending
    state = tl.load(KeysIn + base[:, None] * K + (K - 1 - kk)[None, :], mask=row_ok[:, None], other=_SENTINEL)
    m = tl.load(MaxIn + base, mask=row_ok, other=0.0)
    s = tl.load(SumIn + base, mask=row_ok, other=1.0)
    for sp in range(1, NSPLIT):
        nxt = tl.load(KeysIn + (base + sp)[:, None] * K + kk[None, :], mask=row_ok[:, None], other=_SENTINEL)
        state = _merge_sorted(state, nxt, K)
        m2 = tl.load(MaxIn + base + sp, mask=row_ok, other=0.0)
        s2 = tl.load(SumIn + base + sp, mask=row_ok, other=1.0)
        m_new = tl.maximum(m, m2)
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split of −inf only (s = 0): as above
        s = s * tl.exp(m - shift).to(tl.float64) + s2 * tl.exp(m2 - shift).to(tl.float64)
        m = m_new
    tl.store(Lse + rows, (m.to(tl.float64) + tl.log(s)).to(tl.float32), mask=row_ok)
    # -- decode; slot j of the ascending state is rank K−1−j
    ids = 4294967295 - (state & 4294967295)
    o = (state >> 32).to(tl.int32)
    vals = tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)
    rank = K - 1 - kk
    out = rows64[:, None] * k + rank[None, :]
    keep = row_ok[:, None] & (rank[None, :] < k)
    tl.store(TopVal + out, vals, mask=keep)
    tl.store(TopId + out, ids, mask=keep)


def gpu_tile_config(K: int, dtype: torch.dtype) -> tuple:
    """(BLOCK_T, BLOCK_V, BLOCK_H, num_warps) of ``_topk_tiles_kernel`` on a GPU, for K (k rounded
    up to a power of two, <= MAX_K) and the input dtype.

    Per thread the running top-K ([BLOCK_T, K] int64 keys, two registers each) and the tile's
    bitonic network dominate. Chosen by compiling ahead of time for sm_90 and sm_80 and reading
    the compiler's report (``bench/aot_check.py``, tests/ops/test_spill_free.py): no spill, and the
    figures are triton 3.9's (sm90). bf16/fp16: K 128 → 202 registers; K 256 → 239; K 512 with
    8 warps → 235. fp32 dots are IEEE on the FMA units, operands in registers: (16, 128, 64, 4)
    spilled 696 bytes per thread at K 128, (16, 64, 32, 8) takes 176 registers; at K 512
    (16, 32, 32, 8) takes 249. K 1,024 spilled with every tile (16 warps included: 648 bytes), so
    the backend's limit is 512 (``acarerank.ops.topk_merge.MAX_K``).
    """
    if dtype == torch.float32:
        return (16, 64, 32, 8) if K <= 128 else (16, 32, 32, 8)
    if K <= 128:
        return (16, 128, 64, 4)
    return (16, 64, 64, 4) if K <= 256 else (16, 64, 64, 8)


def gpu_merge_config(K: int) -> tuple:
    """(BLOCK_T, num_warps) of ``_topk_merge_kernel`` on a GPU: 126 / 211 / 239 registers at K
    128 / 256 / 512 (sm90, no spill; see ``gpu_tile_config``)."""
    return (16, 4) if K <= 256 else (16, 8)


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def topk_logprobs_core_triton(hidden, weight, targets, k: int, chunk, temperature: float, num_splits=None,
                              block_v_override=None):
    """Core of ``acarerank.ops.topk_logprobs`` (Triton). Inputs are checked by the op.

    Args:
      hidden: (T, H) fp32/fp16/bf16, any strides; weight: (V, H) same dtype; targets: (T,) int.
      k: 1 <= k <= min(V, 1024). chunk: unused (tiles are the kernel's own).
      num_splits: vocabulary splits of stage 1 (default: enough programs to fill the GPU while
        the split buffer stays ≤ ~1 % of [T, V] fp32; 2 under the interpreter).
      block_v_override: vocabulary tile width (a power of two >= 16; tests use it to force
        many tiles and splits on small V).
    Returns: (topk_logits (T,k) fp32 sorted (value desc, id asc), topk_ids (T,k) int64,
      target_logit (T,) fp32, lse (T,) fp32) of z = (hidden · weightᵀ) / temperature.
    """
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    on_gpu = dev.type == "cuda"
    if not on_gpu and not triton_interpreted(_topk_tiles_kernel):
        raise RuntimeError("topk_logprobs (triton): CPU tensors need TRITON_INTERPRET=1 set before "
                           "acarerank.kernels.topk_logprobs is imported")
    if k > MAX_K:  # the op checks first (acarerank.topk_contract.check_k); this guards direct calls
        raise ValueError(f"topk_logprobs (triton): k must be <= {MAX_K}, got k={k}; use backend='torch'")
    if hidden.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"topk_logprobs (triton): dtype {hidden.dtype} not supported (fp32, fp16, bf16)")
    top_v = torch.empty(T, k, dtype=torch.float32, device=dev)
    top_i = torch.empty(T, k, dtype=torch.int64, device=dev)
    tgt = torch.empty(T, dtype=torch.float32, device=dev)
    lse = torch.empty(T, dtype=torch.float32, device=dev)
    if T == 0:
        return top_v, top_i, tgt, lse
    K = triton.next_power_of_2(k)
    if on_gpu:
        block_t, block_v, block_h, nw = gpu_tile_config(K, hidden.dtype)
    else:  # interpreter: few, large programs — each tile costs ~constant Python overhead
        block_t = 32  # never a function of T: no recompile (or re-trace) as the batch changes
        block_v = max(K, min(16384, max(16, triton.next_power_of_2(V))))
        block_h = min(128, max(16, triton.next_power_of_2(H)))
        nw = 4
    block_v = block_v_override or block_v
    KT = min(K, block_v)
    row_blocks = triton.cdiv(T, block_t)
    tiles = triton.cdiv(V, block_v)
    if num_splits is None:
        if on_gpu:
            by_mem = max(1, (V * 4) // (100 * K * 8))  # split buffer ≤ 1 % of [T, V] fp32
            num_splits = max(1, min(by_mem, triton.cdiv(4 * _num_sms(dev), row_blocks)))
        else:
            num_splits = 2
    num_splits = max(1, min(int(num_splits), tiles))
    span = triton.cdiv(tiles, num_splits) * block_v
    num_splits = triton.cdiv(V, span)  # every split non-empty

    keys = torch.empty(T, num_splits, K, dtype=torch.int64, device=dev)
    mx = torch.empty(T, num_splits, dtype=torch.float32, device=dev)
    sm = torch.empty(T, num_splits, dtype=torch.float64, device=dev)
    tg = targets.to(torch.int64).contiguous()
    block_t2, nw2 = gpu_merge_config(K) if on_gpu else (32, 4)
    with interpreter_lock():
        _topk_tiles_kernel[(row_blocks, num_splits)](
            hidden, weight, tg, keys, mx, sm, tgt, T, V, H, span, float(temperature),
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
            NSPLIT=num_splits, K=K, KT=KT, BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_H=block_h,
            HAS_TEMP=temperature != 1.0, IEEE=hidden.dtype == torch.float32 or not on_gpu,
            UPCAST=not on_gpu and hidden.dtype != torch.float32, num_warps=nw)
        _topk_merge_kernel[(triton.cdiv(T, block_t2),)](
            keys, mx, sm, top_v, top_i, lse, T, k, NSPLIT=num_splits, K=K, BLOCK_T=block_t2, num_warps=nw2)
    return top_v, top_i, tgt, lse


__all__ = ["topk_logprobs_core_triton", "MAX_K", "gpu_tile_config", "gpu_merge_config"]
