"""Top-k truncated log-probs core (ATO teacher, DESIGN.md §6), Triton: logits tiles never leave the chip.

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
    ``tl.topk`` (bitonic, sorted descending), and merges them into the running top-K (sorted
    ascending) with one elementwise max — max(ascending, descending) of two sorted lists is
    the top half of their union as a bitonic sequence — followed by a bitonic merge.
Stage 2, ``_topk_merge_kernel``, grid (row blocks,): the same flip-max-merge over the splits'
top-K lists, the log-sum-exp combine, key decoding and the stores (first k of K).

One key per candidate makes the tie rule exact and the merge branch-free; K (k rounded up
to a power of two) keys of 8 bytes per row and split are all that reach global memory.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

_SENTINEL = tl.constexpr(-(2 ** 63))  # an order key below every real one (masked columns, empty slots)
MAX_K = 4096


@triton.jit
def _order_key(x, cols):
    """int64 key of fp32 logits x [BT, BV] at vocabulary ids cols [BV] (see module docstring)."""
    x = tl.where(x == 0.0, 0.0, x)  # −0.0 ties with +0.0, as in torch comparisons
    b = x.to(tl.int32, bitcast=True)
    o = tl.where(b < 0, b ^ 0x7FFFFFFF, b)  # signed image of the float order
    return (o.to(tl.int64) << 32) + (4294967295 - cols.to(tl.int64))[None, :]


@triton.jit
def _merge_sorted(state, top, K: tl.constexpr):
    """Top-K of (state ∪ top): state [BT, K] ascending, top [BT, K] descending -> [BT, K] ascending."""
    return tl.sort(tl.maximum(state, top), dim=1)


@triton.jit
def _topk_tiles_kernel(Hid, W, Tgt, KeysOut, MaxOut, SumOut, TgtOut,
                       T, V, H, span, temperature,
                       stride_ht, stride_hh, stride_wv, stride_wh,
                       K: tl.constexpr, KT: tl.constexpr, NSPLIT: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                       HAS_TEMP: tl.constexpr, IEEE: tl.constexpr):
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
    s = tl.zeros([BLOCK_T], tl.float32)
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
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_TEMP:
            acc = tl.math.div_rn(acc, temperature)  # IEEE division, as torch's x / τ
        x = tl.where(col_ok[None, :], acc, float("-inf"))
        # -- online log-sum-exp
        m_new = tl.maximum(m, tl.max(x, 1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), 1)
        m = m_new
        # -- target logit (exactly one tile of one split holds it)
        hit = cols[None, :] == tgt[:, None]
        tgt_val += tl.sum(tl.where(hit, x, 0.0), 1)
        # -- tile top-KT keys (descending), padded to K with sentinels, merged into the state
        keys = tl.where(col_ok[None, :], _order_key(x, cols), _SENTINEL)
        top = tl.topk(keys, KT, dim=1)
        if KT < K:
            # [BT, KT] -> [BT, K]: real keys first, sentinels after (still descending)
            pad = tl.arange(0, K // KT)[None, :, None] == 0
            top = tl.reshape(tl.where(pad, top[:, None, :], _SENTINEL), [BLOCK_T, K])
        state = _merge_sorted(state, top, K)

    base = rows64 * NSPLIT + split
    kk = tl.arange(0, K)
    tl.store(KeysOut + base[:, None] * K + kk[None, :], state, mask=row_ok[:, None])
    tl.store(MaxOut + base, m, mask=row_ok)
    tl.store(SumOut + base, s, mask=row_ok)
    mine = row_ok & (tgt >= v_lo) & (tgt < v_hi)
    tl.store(TgtOut + rows, tgt_val, mask=mine)


@triton.jit
def _topk_merge_kernel(KeysIn, MaxIn, SumIn, TopVal, TopId, Lse, T, k,
                       K: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    rows64 = rows.to(tl.int64)
    kk = tl.arange(0, K)
    base = rows64 * NSPLIT
    state = tl.load(KeysIn + base[:, None] * K + kk[None, :], mask=row_ok[:, None], other=_SENTINEL)
    m = tl.load(MaxIn + base, mask=row_ok, other=0.0)
    s = tl.load(SumIn + base, mask=row_ok, other=1.0)
    for sp in range(1, NSPLIT):
        nxt = tl.load(KeysIn + (base + sp)[:, None] * K + kk[None, :], mask=row_ok[:, None], other=_SENTINEL)
        state = _merge_sorted(state, tl.flip(nxt, 1), K)
        m2 = tl.load(MaxIn + base + sp, mask=row_ok, other=0.0)
        s2 = tl.load(SumIn + base + sp, mask=row_ok, other=1.0)
        m_new = tl.maximum(m, m2)
        s = s * tl.exp(m - m_new) + s2 * tl.exp(m2 - m_new)
        m = m_new
    tl.store(Lse + rows, m + tl.log(s), mask=row_ok)
    # -- decode, best first
    best = tl.flip(state, 1)
    ids = 4294967295 - (best & 4294967295)
    o = (best >> 32).to(tl.int32)
    vals = tl.where(o < 0, o ^ 0x7FFFFFFF, o).to(tl.float32, bitcast=True)
    out = rows64[:, None] * k + kk[None, :]
    keep = row_ok[:, None] & (kk[None, :] < k)
    tl.store(TopVal + out, vals, mask=keep)
    tl.store(TopId + out, ids, mask=keep)


def _kernel_is_interpreted() -> bool:
    return type(_topk_tiles_kernel).__name__ == "InterpretedFunction"


def _num_sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def topk_logprobs_core_triton(hidden, weight, targets, k: int, chunk, temperature: float, num_splits=None):
    """Core of ``acarerank.ops.topk_logprobs`` (Triton). Inputs are checked by the op.

    Args:
      hidden: (T, H) fp32/fp16/bf16, any strides; weight: (V, H) same dtype; targets: (T,) int.
      k: 1 <= k <= min(V, 4096). chunk: unused (tiles are the kernel's own).
      num_splits: vocabulary splits of stage 1 (default: enough programs to fill the GPU while
        the split buffer stays ≤ ~1 % of [T, V] fp32; 2 under the interpreter so the merge
        stage always runs).
    Returns: (topk_logits (T,k) fp32 sorted (value desc, id asc), topk_ids (T,k) int64,
      target_logit (T,) fp32, lse (T,) fp32) of z = (hidden · weightᵀ) / temperature.
    """
    T, H = hidden.shape
    V = weight.shape[0]
    dev = hidden.device
    on_gpu = dev.type == "cuda"
    if not on_gpu and not (os.environ.get("TRITON_INTERPRET", "0") == "1" and _kernel_is_interpreted()):
        raise RuntimeError("topk_logprobs (triton): CPU tensors need TRITON_INTERPRET=1 set before "
                           "acarerank.kernels.topk_logprobs is imported")
    if k > MAX_K:
        raise ValueError(f"topk_logprobs (triton): k={k} exceeds the kernel's maximum {MAX_K}; use backend='torch'")
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
        block_t, block_h = 16, 64
        block_v = 128 if K <= 128 else 64
        nw = 4 if K <= 256 else 8
    else:  # interpreter: few, large programs (each tile costs ~constant Python overhead)
        block_t = min(64, max(16, triton.next_power_of_2(T)))
        block_v = max(1024, K) if V >= 1024 else max(16, triton.next_power_of_2(V))
        block_h = min(128, max(16, triton.next_power_of_2(H)))
        nw = 4
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
    sm = torch.empty(T, num_splits, dtype=torch.float32, device=dev)
    tg = targets.to(torch.int64).contiguous()
    _topk_tiles_kernel[(row_blocks, num_splits)](
        hidden, weight, tg, keys, mx, sm, tgt, T, V, H, span, float(temperature),
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        K=K, KT=KT, NSPLIT=num_splits, BLOCK_T=block_t, BLOCK_V=block_v, BLOCK_H=block_h,
        HAS_TEMP=temperature != 1.0, IEEE=hidden.dtype == torch.float32, num_warps=nw)
    block_t2 = 16 if on_gpu else min(64, max(16, triton.next_power_of_2(T)))
    _topk_merge_kernel[(triton.cdiv(T, block_t2),)](
        keys, mx, sm, top_v, top_i, lse, T, k, K=K, NSPLIT=num_splits, BLOCK_T=block_t2, num_warps=nw)
    return top_v, top_i, tgt, lse


__all__ = ["topk_logprobs_core_triton", "MAX_K"]
