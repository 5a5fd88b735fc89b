"""Grouped prefix-shared attention in ONE pass (docs/ARCHITECTURE.md, "The one primitive"), Triton.

Every segment s of group g attends to all of g's prefix (no mask) and causally to its own
earlier tokens, never to other segments:

    out[t] = softmax(scale · q[t] · [prefix_k[g]; k[s_0..t]]ᵀ) · [prefix_v[g]; v[s_0..t]]

One launch covers all groups and segments. A program owns BLOCK_M query *rows* of one
segment for one KV head and streams first its group's prefix K/V tiles (unmasked but for
the last), then its own segment's K/V tiles (causal on the diagonal tiles), with one
online softmax (FlashAttention-2, Dao 2023) in fp32: no second pass, no log-sum-exp merge,
no per-segment copy of the prefix. FlashInfer/vLLM cascades and Hydragen do the same work
as a prefix pass + an own pass + a merge kernel.

GQA: the r = Hq/Hkv query heads that share a KV head are folded into the row dimension
(row = token·r + head-in-group, FlashInfer's decode trick), so each K/V tile is loaded once
for all r heads and a decode step (segment length 1) still fills r rows of a block.

Work list: (segment, first row) pairs built from cu_seqlens by a few device ops (no host
sync), heaviest block first, so no program idles on a short or empty segment
(grid = (work slots, Hkv)).

Determinism: a row's keys are visited in a fixed order (prefix tiles then own tiles, by
BLOCK_N) that depends only on its own segment and group; the config is a fixed function of
(head_dim, GQA ratio, dtype, GPU architecture) — ``attention_config``, no timing-based
autotune, so every process picks the same one and the first call does not stall; no
atomics. So a segment's output is bitwise the same whatever else is in the batch and in what
order (tests/ops/test_op_attention.py). Where its prefix ends does move the tiles:
``aligned_prefix_tokens`` says at which prefix lengths it does not.

Interpreter note (triton 3.9): the interpreter stores bfloat16 as uint16 and its ``tl.dot``
multiplies the raw bit patterns (triton-lang/triton#11584; bf16 is documented as unsupported
there). With bf16 inputs under the interpreter the kernel upcasts both dot operands to fp32
(exact for bf16 values; DOT_FP32) and does no bf16 arithmetic, only casts — the probabilities
are still rounded to bf16 before P·V, as on the GPU.
"""
from __future__ import annotations

import json
import math
import os

import torch
import triton
import triton.language as tl

from acarerank._triton_env import interpreter_lock, triton_interpreted

_LOG2E = 1.4426950408889634
_MAX_HEAD_DIM = 256


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """a @ b (+ acc) in fp32; IEEE for fp32 operands (the 1e-5 contract: no TF32 rounding)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                  lo, hi, n_limit, tok, qk_scale,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  MASK_COLS: tl.constexpr, CAUSAL: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
                  bt_row=None, stride_kb=0, stride_vb=0, PAGE: tl.constexpr = 0):
    """Online softmax over key columns [lo, hi) of one K/V stream (prefix or own segment).

    q: [BLOCK_M, BLOCK_D]; acc [BLOCK_M, BLOCK_D], l_i/m_i [BLOCK_M] fp32 (m_i in log2 units).
    MASK_COLS: columns >= n_limit are absent (tail tile). CAUSAL: row may see column c only
    if c <= tok[row] (its token index within the segment).
    PAGE > 0 (paged prefix): column c lives in block ``bt_row[c // PAGE]`` at slot
    ``c % PAGE``; k_base/v_base point at head hkv of block 0 and stride_kb/vb step one block.
    The lookup only changes the addresses, never the arithmetic or the tile order, so the
    paged stream is bitwise the packed one on the same values.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM  # all true unless head_dim was padded to a power of two >= 16
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        if PAGE > 0:
            # -- block-table lookup in the kernel: no gathered copy of the prefix
            if MASK_COLS:
                blk = tl.load(bt_row + cols // PAGE, mask=cols < n_limit, other=0).to(tl.int64)
            else:
                blk = tl.load(bt_row + cols // PAGE).to(tl.int64)
            slot = (cols % PAGE).to(tl.int64)
            k_ptrs = k_base + (blk * stride_kb + slot * stride_kt)[None, :] + offs_d[:, None] * stride_kd
            v_ptrs = v_base + (blk * stride_vb + slot * stride_vt)[:, None] + offs_d[None, :] * stride_vd
        else:
            cols64 = cols.to(tl.int64)
            k_ptrs = k_base + cols64[None, :] * stride_kt + offs_d[:, None] * stride_kd  # [BLOCK_D, BLOCK_N]
            v_ptrs = v_base + cols64[:, None] * stride_vt + offs_d[None, :] * stride_vd  # [BLOCK_N, BLOCK_D]
        if MASK_COLS:
            col_ok = cols < n_limit
            k = tl.load(k_ptrs, mask=d_ok[:, None] & col_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=d_ok[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_ok[None, :], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        # -- scores in log2 units (exp2 is one instruction; the scale folds in log2(e))
        qk = _dot(q, k, None, IEEE) * qk_scale
        if CAUSAL:
            qk = tl.where(cols[None, :] <= tok[:, None], qk, float("-inf"))
        elif MASK_COLS:
            qk = tl.where(col_ok[None, :], qk, float("-inf"))
        # -- update m_i and l_i; a tile fully masked for a row leaves it exactly unchanged
        # (alpha = 1, p = 0): every row has seen >= 1 key before such a tile. m_i starts at
        # −FLT_MAX, not −inf (the caller), so m_new is always finite: a −inf score gets p = 0 and
        # a row whose scores so far are all −inf keeps alpha = 1, p = 0, l = 0
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # -- update acc: P is rounded to V's dtype first, as flash-attn does for fp16/bf16
        p = p.to(v.dtype)
        if DOT_FP32:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        acc = _dot(p, v, acc * alpha[:, None], IEEE)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prefix_shared_attn_fwd(
    Q, K, V, PK, PV, Out, CU_SEQ, CU_PRE, SEG_GROUP, WORK, BT,
    stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_pkt, stride_pkh, stride_pkd, stride_pvt, stride_pvh, stride_pvd, stride_ot, stride_oh, stride_od,
    stride_pkb, stride_pvb, stride_btg,
    qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GQA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr, IEEE: tl.constexpr,
    PAGE: tl.constexpr = 0,
):
    """PAGE == 0: PK/PV are the packed prefixes [Ptot, Hkv, d] (CU_PRE = [G+1] offsets).
    PAGE > 0: PK/PV are pages [num_blocks, PAGE, Hkv, d], BT the [G, max_blocks] int32 block
    table, CU_PRE the [G+1] cumulative prefix lengths (only differences are read)."""
    pid = tl.program_id(0)
    hkv = tl.program_id(1)
    seg = tl.load(WORK + 2 * pid)
    row0 = tl.load(WORK + 2 * pid + 1)
    # a spare slot (seg = -1, row0 = 0) becomes an empty segment with an empty prefix: no loop
    # runs and the store is fully masked
    live = seg >= 0
    seg = tl.maximum(seg, 0)
    t0 = tl.load(CU_SEQ + seg)
    L = tl.where(live, tl.load(CU_SEQ + seg + 1) - t0, 0)
    g = tl.load(SEG_GROUP + seg)
    p0 = tl.load(CU_PRE + g)
    P = tl.where(live, tl.load(CU_PRE + g + 1) - p0, 0)

    # rows of this block: row = token·GQA + head-in-group
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = rows < L * GQA
    tok = rows // GQA
    head = hkv * GQA + rows % GQA
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    tok64 = (t0 + tok).to(tl.int64)  # int64: T·Hq·d can pass 2^31 elements
    q_ptrs = Q + tok64[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # the running max starts at the most negative finite float, not −inf: a row whose first keys
    # all score −inf (a −inf key, or a q·k past fp32's range) then keeps a finite max, where
    # −inf − (−inf) made it NaN although plain softmax gives those keys weight 0 (FlashAttention
    # checks for −inf instead: a select per row and tile, one more live vector)
    m_i = tl.full([BLOCK_M], -3.4028234663852886e38, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # -- stream 1: the group's prefix, every column visible; only the tail tile is masked
    if PAGE > 0:
        pk_base = PK + hkv * stride_pkh
        pv_base = PV + hkv * stride_pvh
    else:
        pk_base = PK + p0.to(tl.int64) * stride_pkt + hkv * stride_pkh
        pv_base = PV + p0.to(tl.int64) * stride_pvt + hkv * stride_pvh
    bt_row = BT + g.to(tl.int64) * stride_btg
    p_full = (P // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, pk_base, pv_base, stride_pkt, stride_pkd, stride_pvt, stride_pvd,
                                  0, p_full, P, tok, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                                  MASK_COLS=False, CAUSAL=False, DOT_FP32=DOT_FP32, IEEE=IEEE,
                                  bt_row=bt_row, stride_kb=stride_pkb, stride_vb=stride_pvb, PAGE=PAGE)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, pk_base, pv_base, stride_pkt, stride_pkd, stride_pvt, stride_pvd,
                                  p_full, P, P, tok, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                                  MASK_COLS=True, CAUSAL=False, DOT_FP32=DOT_FP32, IEEE=IEEE,
                                  bt_row=bt_row, stride_kb=stride_pkb, stride_vb=stride_pvb, PAGE=PAGE)

    # -- stream 2: the segment's own keys; columns < first token + 1 are visible to every
    # row of the block (no mask), the rest up to the block's last real token are causal
    k_base = K + t0.to(tl.int64) * stride_kt + hkv * stride_kh
    v_base = V + t0.to(tl.int64) * stride_vt + hkv * stride_vh
    tok_first = row0 // GQA
    tok_last = tl.minimum((row0 + BLOCK_M - 1) // GQA, L - 1)
    own_full = ((tok_first + 1) // BLOCK_N) * BLOCK_N
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                                  0, own_full, L, tok, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                                  MASK_COLS=False, CAUSAL=False, DOT_FP32=DOT_FP32, IEEE=IEEE)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_kd, stride_vt, stride_vd,
                                  own_full, tok_last + 1, L, tok, qk_scale, HEAD_DIM, BLOCK_D, BLOCK_N,
                                  MASK_COLS=True, CAUSAL=True, DOT_FP32=DOT_FP32, IEEE=IEEE)

    # l_i is 0 only for a row whose every key scored −inf: 0 / 0 = NaN there, as plain softmax
    # gives (a spare slot's rows score q = 0 against real keys: l_i > 0; they are not stored)
    out = acc / l_i[:, None]
    o_ptrs = Out + tok64[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


# -- fixed configs (docs/ARCHITECTURE.md, "Kernel configs") ------------------------------------
# Keyed "sm<major><minor>/<dtype>/d<head_dim>/gqa<r>" -> [BLOCK_M, BLOCK_N, num_warps, num_stages].
# Written by bench/tune_attention.py on a GPU (it times the candidates of ``candidate_configs``
# once, offline); a key not in the table takes ``_rule_config``. Never timed at serving time.
_TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "attention_configs.json")


def _load_table() -> dict:
    try:
        with open(_TABLE_PATH) as f:
            return {k: tuple(v) for k, v in json.load(f).items() if not k.startswith("_")}
    except FileNotFoundError:
        return {}


_TABLE = _load_table()


def _rule_config(head_dim: int, dtype: torch.dtype, arch: str = "sm90") -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) that do not spill on ``arch`` (sm80 / sm90).

    Chosen by compiling ahead of time and reading the compiler's register, stack and shared
    memory report (``bench/aot_check.py``; tests/ops/test_spill_free.py keeps every shipped config
    at zero spill bytes on sm_90 and sm_80). Figures are triton 3.9's for GQA 4:
      * bf16/fp16, d <= 128, sm90: (128, 64, 8, 2), 222 registers, 96 KB shared. On sm80 the
        same tiles spill 72 bytes per thread with two stages: one stage there (249 registers).
      * bf16/fp16, d <= 256: (64, 32, 8, 2), 214 (sm90) / 233 (sm80) registers.
      * fp32: IEEE dots run on the FMA units (no tensor cores), so both dot operands and the
        accumulator sit in registers: (64, 32, 4, 2) at d 128 spilled 8.4 KB per thread and
        (32, 32, 8, 1) 96 bytes; (32, 16, 8, 2) takes 79 registers, no spill. At d 256
        (32, 16, 8, 1) still spills on sm80: (16, 16, 8, 1), 80 registers. A correctness path.
    Shared memory stays far under the 227 KB (sm90) / 163 KB (sm80) per SM (``smem_bytes``).
    """
    if dtype == torch.float32:
        return (32, 16, 8, 2) if head_dim <= 128 else (16, 16, 8, 1)
    if head_dim <= 128:
        return (128, 64, 8, 2) if arch >= "sm90" else (128, 64, 8, 1)
    return (64, 32, 8, 2)


def candidate_configs(head_dim: int, dtype: torch.dtype) -> list:
    """What bench/tune_attention.py times: the rule's config and its non-spilling neighbours."""
    cands = [_rule_config(head_dim, dtype)]
    for bm in (64, 128):
        for bn in (32, 64, 128):
            for w in (4, 8):
                for st in (1, 2, 3):
                    c = (bm, bn, w, st)
                    if c not in cands and fits(c, head_dim, dtype):
                        cands.append(c)
    return cands


def smem_bytes(cfg: tuple, head_dim: int, dtype: torch.dtype) -> int:
    """Estimated shared memory of a config: pipelined K and V tiles + the q tile."""
    bm, bn, _, st = cfg
    bd = max(16, triton.next_power_of_2(head_dim))
    es = torch.finfo(dtype).bits // 8
    return max(1, st) * 2 * bn * bd * es + bm * bd * es


def acc_registers(cfg: tuple, head_dim: int) -> int:
    """fp32 accumulator registers per thread: BLOCK_M·BLOCK_D / (32·num_warps)."""
    bm, _, w, _ = cfg
    return bm * max(16, triton.next_power_of_2(head_dim)) // (32 * w)


def fits(cfg: tuple, head_dim: int, dtype: torch.dtype) -> bool:
    """No spill by construction: accumulator <= 64 registers/thread, shared memory <= 160 KB."""
    return acc_registers(cfg, head_dim) <= 64 and smem_bytes(cfg, head_dim, dtype) <= 160 * 1024


_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def config_key(head_dim: int, gqa: int, dtype: torch.dtype, arch: str) -> str:
    return f"{arch}/{_DTYPE_NAMES[dtype]}/d{head_dim}/gqa{gqa}"


_ARCH: dict = {}


def _arch(device: torch.device) -> str:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ARCH:
        major, minor = torch.cuda.get_device_capability(idx)
        _ARCH[idx] = f"sm{major}{minor}"
    return _ARCH[idx]


# Under the interpreter: one small config (cost is per program and per tile, in Python).
_INTERPRET_CONFIG = (32, 32, 4, 1)


def attention_config(head_dim: int, gqa: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): the table's entry, else ``_rule_config``."""
    if device.type != "cuda":
        return _INTERPRET_CONFIG
    arch = _arch(device)
    return _TABLE.get(config_key(head_dim, gqa, dtype, arch)) or _rule_config(head_dim, dtype, arch)


def aligned_prefix_tokens(head_dim: int, gqa: int, dtype: torch.dtype, device: torch.device) -> int:
    """Q: a token's output is bitwise the same whether the prefix before its segment ends at any
    multiple of Q tokens — a prefix-cache hit of k·Q tokens, an earlier prefill chunk, or none
    (the whole sequence one segment).

    The kernel tiles a row's keys from the start of its prefix and from the start of its own
    rows, and cuts a segment's rows into blocks from its first row (row = token·gqa + head). So
    where the prefix ends moves the tile boundaries (another online-softmax order) and a row's
    place in its block (where a dot rounds a row by its place: the interpreter's numpy GEMM
    does). With P a multiple of BLOCK_N and P·gqa of BLOCK_M, neither moves: Q = lcm(BLOCK_N,
    BLOCK_M / gcd(BLOCK_M, gqa)) at this config (32 under the interpreter; 64 at the sm90
    bf16 d128 GQA-2/4 rule config). The runner's batch-invariant mode starts every prefill pass
    at a multiple of it (``Qwen3Runner.prefix_align``).
    """
    block_m, block_n = attention_config(head_dim, gqa, dtype, torch.device(device))[:2]
    return math.lcm(block_n, block_m // math.gcd(block_m, gqa))


def _work_list(cu_seqlens: torch.Tensor, cu_prefix_lens: torch.Tensor, segment_group: torch.Tensor,
               total_tokens: int, gqa: int, block_m: int) -> torch.Tensor:
    """int32 [W, 2] on the metadata's device: (segment, first row) of every block, heaviest first.

    Segment s has L_s·gqa rows → ceil(L_s·gqa / block_m) blocks (none if empty). Built with a
    few small device ops and no host sync (so the op can be captured in a CUDA graph): W is
    the static bound ceil(T·gqa / block_m) + S, and slots past the real blocks are (-1, 0),
    which the kernel skips. A block's cost is its prefix length plus its last token + 1 (the
    keys it streams); sorting by it descending (stable) is longest-processing-time-first
    scheduling, so the long blocks start first and short ones fill the tail.
    """
    S = segment_group.numel()
    rows = (cu_seqlens[1:] - cu_seqlens[:-1]).long() * gqa
    nblk = (rows + block_m - 1) // block_m
    ends = torch.cumsum(nblk, 0)
    slot = torch.arange((total_tokens * gqa + block_m - 1) // block_m + S, device=cu_seqlens.device)
    seg = torch.searchsorted(ends, slot, right=True)  # == S past the last real block
    valid = seg < S
    seg_c = seg.clamp(max=S - 1)
    row0 = torch.where(valid, (slot - (ends - nblk)[seg_c]) * block_m, 0)
    plen = (cu_prefix_lens[1:] - cu_prefix_lens[:-1]).long()
    cost = plen[segment_group.long()][seg_c] + torch.minimum(row0 + block_m - 1, rows[seg_c] - 1) // gqa + 1
    order = torch.argsort(torch.where(valid, cost, -1), descending=True, stable=True)
    return torch.stack([torch.where(valid, seg, -1)[order], row0[order]], dim=1).to(torch.int32).contiguous()


def plan_work(cu_seqlens, cu_prefix_lens, segment_group, *, total_tokens: int, num_q_heads: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The work list of one batch (``_work_list`` with this config's BLOCK_M): built once per plan."""
    gqa = num_q_heads // num_kv_heads
    block_m = attention_config(head_dim, gqa, dtype, torch.device(device))[0]
    return _work_list(cu_seqlens, cu_prefix_lens, segment_group, total_tokens, gqa, block_m)


def prefix_shared_attention_triton(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, scale,
                                   work=None, host_meta=None, config=None):
    """One-pass grouped prefix-shared attention (Triton). Inputs are checked by ``acarerank.ops``.

    Args:
      q: (total_q, nheads_q, headdim); k, v: (total_q, nheads_kv, headdim) — packed segments,
        RoPE applied; fp16 / bf16 / fp32, any strides; nheads_q % nheads_kv == 0;
        headdim <= 256 (padded inside to a power of two >= 16).
      cu_seqlens: (S+1,) int32; segment s is rows cu_seqlens[s]:cu_seqlens[s+1] (may be empty).
      prefix_k, prefix_v: (total_prefix, nheads_kv, headdim), same dtype as q.
      cu_prefix_lens: (G+1,) int32; group g's prefix rows (may be empty).
      segment_group: (S,) int32; the group of each segment.
      scale: softmax scale (float).
      work: the batch's work list from ``plan_work`` (None: built here, ~20 small device ops).
      host_meta: unused (the torch backend's plan field).
      config: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of ``attention_config``'s (the
        tuning script only; a given ``work`` must have been built with the same BLOCK_M).
    Returns: out (total_q, nheads_q, headdim) in q's dtype, softmax accumulated in fp32.
    """
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"prefix_shared_attention (triton): head_dim {d} > {_MAX_HEAD_DIM} is not supported")
    on_gpu = q.device.type == "cuda"
    if not on_gpu and not triton_interpreted(_prefix_shared_attn_fwd):
        raise RuntimeError(
            "prefix_shared_attention (triton): CPU tensors need TRITON_INTERPRET=1 set before "
            "acarerank.kernels.prefix_shared_attention is imported"
        )
    out = torch.empty_like(q)
    if T == 0 or Hq == 0:
        return out
    gqa = Hq // Hkv
    config = config or attention_config(d, gqa, q.dtype, q.device)
    if work is None:
        work = _work_list(cu_seqlens, cu_prefix_lens, segment_group, T, gqa, config[0])
    if prefix_k.shape[0] == 0:
        # a valid base pointer for the (never loaded) prefix stream
        prefix_k, prefix_v = k[:0], v[:0]
    # the block-table argument is never read with PAGE=0: any int32 tensor will do
    _launch(q, k, v, prefix_k, prefix_v, out, cu_seqlens, cu_prefix_lens, segment_group, work, cu_prefix_lens,
            prefix_k.stride(), prefix_v.stride(), (0, 0, 0), scale, page=0, config=config)
    return out


def _launch(q, k, v, pk, pv, out, cu_seqlens, cu_pre, segment_group, work, bt, pk_strides, pv_strides,
            page_strides, scale, page: int, config=None):
    """Launch the one-pass kernel. pk/pv_strides: (token, head, dim) strides of the prefix
    stream; page_strides: (k block, v block, block-table row) strides (page > 0 only).

    Packed and paged calls take their config from the same ``attention_config``: the paged
    form visits the same tiles in the same order, so it is bitwise the packed one, GPU included."""
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    on_gpu = q.device.type == "cuda"
    gqa = Hq // Hkv
    block_m, block_n, num_warps, num_stages = config or attention_config(d, gqa, q.dtype, q.device)
    block_d = max(16, triton.next_power_of_2(d))
    # the kernel reads the 1-D metadata at unit stride: a strided view (every other entry of a
    # buffer) was read as other offsets and groups, wrong rows with no error; no copy when contiguous
    cu_seqlens, cu_pre, segment_group = (t.contiguous() for t in (cu_seqlens, cu_pre, segment_group))
    with interpreter_lock():
        _prefix_shared_attn_fwd[(work.shape[0], Hkv)](
            q, k, v, pk, pv, out, cu_seqlens, cu_pre, segment_group, work, bt,
            *q.stride(), *k.stride(), *v.stride(), *pk_strides, *pv_strides, *out.stride(), *page_strides,
            float(scale) * _LOG2E,
            HEAD_DIM=d, BLOCK_D=block_d, GQA=gqa, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_FP32=(not on_gpu) and q.dtype == torch.bfloat16, IEEE=q.dtype == torch.float32, PAGE=page,
            num_warps=num_warps, num_stages=num_stages)


def prefix_shared_attention_paged_triton(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens,
                                         segment_group, scale, work=None):
    """One-pass grouped prefix-shared attention with the prefix in pages (Triton).

    Args (checked and planned by ``acarerank.ops.prefix_shared_attention_paged``):
      q: (total_q, nheads_q, headdim); k, v: (total_q, nheads_kv, headdim) — the segments' own rows.
      k_cache, v_cache: (num_blocks, block_size, nheads_kv, headdim), same dtype as q, any strides.
      block_table: (G, max_blocks) int32 — group g's prefix blocks in order.
      cu_prefix_lens: (G+1,) int32 — cumulative prefix lengths (group g has P_g tokens).
      segment_group: (S,) int32; work: the plan's work list (``plan_work``; None: built here).
    Returns: out (total_q, nheads_q, headdim) in q's dtype.

    The block id of every key column is read from ``block_table`` inside the kernel: the
    prefix is never gathered. Columns are visited in the packed kernel's order with the same
    config, so the output is bitwise ``prefix_shared_attention_triton`` on the gathered prefix.
    """
    T, Hq, d = q.shape
    if d > _MAX_HEAD_DIM:
        raise ValueError(f"prefix_shared_attention_paged (triton): head_dim {d} > {_MAX_HEAD_DIM} is not supported")
    if q.device.type != "cuda" and not triton_interpreted(_prefix_shared_attn_fwd):
        raise RuntimeError(
            "prefix_shared_attention_paged (triton): CPU tensors need TRITON_INTERPRET=1 set before "
            "acarerank.kernels.prefix_shared_attention is imported"
        )
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        # the kernel steps one block id per int32 along a row: a strided view would read other ids
        raise ValueError(f"prefix_shared_attention_paged (triton): block_table must be unit-stride along its "
                         f"blocks, got strides {tuple(block_table.stride())}; pass block_table.contiguous()")
    out = torch.empty_like(q)
    if T == 0 or Hq == 0:
        return out
    if work is None:
        work = plan_work(cu_seqlens, cu_prefix_lens, segment_group, total_tokens=T, num_q_heads=Hq,
                         num_kv_heads=k.shape[1], head_dim=d, dtype=q.dtype, device=q.device)
    kc, vc = k_cache.stride(), v_cache.stride()
    _launch(q, k, v, k_cache, v_cache, out, cu_seqlens, cu_prefix_lens, segment_group, work, block_table,
            (kc[1], kc[2], kc[3]), (vc[1], vc[2], vc[3]), (kc[0], vc[0], block_table.stride(0)), scale,
            page=k_cache.shape[1])
    return out


def flops(cu_seqlens, cu_prefix_lens, segment_group, num_heads: int, head_dim: int) -> int:
    """FLOPs of the shared computation: 4·Hq·d·Σ_s (L_s·P_g + L_s(L_s+1)/2) (QKᵀ and PV, causal half)."""
    cs, cp, sg = cu_seqlens.tolist(), cu_prefix_lens.tolist(), segment_group.tolist()
    keys = 0
    for s, g in enumerate(sg):
        L = cs[s + 1] - cs[s]
        keys += L * (cp[g + 1] - cp[g]) + L * (L + 1) // 2
    return 4 * num_heads * head_dim * keys


__all__ = ["prefix_shared_attention_triton", "prefix_shared_attention_paged_triton", "plan_work", "attention_config",
           "aligned_prefix_tokens", "candidate_configs", "fits", "flops"]
