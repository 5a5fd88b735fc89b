"""The prefix part of prefix-shared attention in bf16 on CPU: blocked bf16 GEMMs, fp32 softmax.

The torch backend (``attention._torch_backend``) splits each group's attention into the
prefix part (every query row against the whole shared prefix: dense, no mask, >90 % of
the attention FLOPs at reranking shapes) and each segment's small causal part, merged by
log-sum-exp. torch's fused CPU flash kernel runs at the same ~150 GFLOP/s in bf16 as in
fp32 (2-core EPYC with AVX512_BF16, q [1, 2, 13,620, 64] against 1,650 keys), while a bf16
GEMM runs at ~430. So here the prefix part is two bf16 GEMMs per (kv head, row block,
key tile) with the softmax statistics in fp32 — the flash-attention recurrence over key
tiles j (Dao et al., FlashAttention-2, Alg. 1), with raw scores s = q·kᵀ:

    m_j = max(m_{j-1}, rowmax(s_j));   p_j = exp(scale·(s_j − m_j))   (fp32, rounded to bf16 for the GEMM)
    l_j = e^{scale·(m_{j-1} − m_j)}·l_{j-1} + rowsum(p_j)             (fp32)
    acc_j = e^{scale·(m_{j-1} − m_j)}·acc_{j-1} + p_j·V_j            (fp32 accumulator)
    o = acc / l,   lse = scale·m + log l

Precision: q·kᵀ comes out of the GEMM rounded to bf16 (torch has no bf16→fp32 GEMM on
CPU), p is rounded to bf16 for the second GEMM — the same roundings as plain bf16
attention in PyTorch (``softmax(q @ kᵀ) @ v`` in bf16); tests hold it to flash-attn's rule
(error ≤ 2× that of plain bf16 PyTorch, against fp32).

Memory: the prefix K/V stay where they are, in bf16 — each kv head's [P, d] slice of the
packed [Ptot, Hkv, d] cache is a strided matrix the GEMM reads in place (no fp32 copy, no
repeat for GQA: the r query heads of a kv head are folded into the rows). The temporaries
are one [rows, key_tile] fp32 score block and its bf16 copy.

GQA layout: q rows of a group [Tg, Hq, d] → per kv head h the [Tg·r, d] matrix of its r
query heads (row t·r + i is token t, head h·r + i).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..hardware import native_bf16

#: Query rows per block and keys per tile. 512 × 2,048 keeps the fp32 score block at 4 MB
#: (L3-resident) and the per-call overhead low: the M3 workload's 1,650-token prefix is a
#: single tile, so the online rescale never runs there; deeper prefixes take several.
ROW_BLOCK = 512
KEY_TILE = 2048

#: None: use this path for bf16 on CPUs with native bf16 (``hardware.native_bf16``);
#: True/False: always / never (tests and the A/B benchmark set it).
ENABLED: Optional[bool] = None

#: Fuse each tile's softmax step (max, exp, row sum, bf16 rounding: ~5 eager passes over
#: the fp32 score block) into two inductor loops over the bf16 scores. Off until an
#: interleaved A/B run on a native-bf16 CPU shows it wins (bench/bench_cpu_bf16.py).
COMPILE_SOFTMAX = False


def use_bf16_prefix_path(q: torch.Tensor) -> bool:
    """Whether ``attention._torch_backend`` should run the prefix part here for this q."""
    if q.dtype != torch.bfloat16 or q.device.type != "cpu":
        return False
    return native_bf16()[0] if ENABLED is None else ENABLED


def prefix_attention_bf16(q: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor, scale: float,
                          row_block: int = ROW_BLOCK, key_tile: int = KEY_TILE):
    """All query rows of one group against that group's whole prefix, no mask.

    Args:
      q: [Tg, Hq, d] bf16 — the group's query rows (any strides).
      pk, pv: [P, Hkv, d] bf16, P ≥ 1, Hq % Hkv == 0 — the group's prefix K/V (views of the
        cache; read in place, unit stride on d expected, other strides free).
      scale: softmax scale.
      row_block, key_tile: block sizes (results equal up to rounding for any choice).

    Returns: (o [Tg, Hq, d] fp32, lse [Tg, Hq] fp32) with
      lse = log Σ_j exp(scale·q·k_j),  o = Σ_j exp(scale·q·k_j − lse)·v_j.
    """
    if q.dtype != torch.bfloat16 or pk.dtype != torch.bfloat16 or pv.dtype != torch.bfloat16:
        raise TypeError(f"prefix_attention_bf16: q/prefix_k/prefix_v must be bfloat16, got {q.dtype}/{pk.dtype}/{pv.dtype}")
    Tg, Hq, d = q.shape
    P, Hkv = pk.shape[0], pk.shape[1]
    if P == 0 or Hq % Hkv or pk.shape != pv.shape or pk.shape[2] != d:
        raise ValueError(f"prefix_attention_bf16: q {tuple(q.shape)} against prefix {tuple(pk.shape)} / "
                         f"{tuple(pv.shape)}: need P >= 1, matching head_dim and Hq a multiple of Hkv")
    if row_block < 1 or key_tile < 1:
        raise ValueError(f"prefix_attention_bf16: row_block and key_tile must be >= 1, got {row_block}, {key_tile}")
    r = Hq // Hkv
    M = Tg * r
    o = torch.empty(Hkv, M, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(Hkv, M, dtype=torch.float32, device=q.device)
    for h in range(Hkv):
        qh = q[:, h * r:(h + 1) * r].reshape(M, d)   # small copy of q only when strided
        kh, vh = pk[:, h], pv[:, h]                   # [P, d] strided views, no copy
        for i in range(0, M, row_block):
            _row_block(qh[i:i + row_block], kh, vh, scale, key_tile, o[h, i:i + row_block], lse[h, i:i + row_block])
    return (o.view(Hkv, Tg, r, d).permute(1, 0, 2, 3).reshape(Tg, Hq, d),
            lse.view(Hkv, Tg, r).permute(1, 0, 2).reshape(Tg, Hq))


def tile_softmax(s: torch.Tensor, m_prev: torch.Tensor, scale: float):
    """One tile's softmax step: s [m, n] bf16 raw scores, m_prev [m] fp32 running max (−inf at first)
    → (p [m, n] bf16 = exp(scale·(s − m_new)), m_new [m] fp32, rowsum(p before rounding) [m] fp32)."""
    m_new = torch.maximum(m_prev, s.amax(dim=1).float())
    # one pass bf16 → fp32 (type promotion) computing scale·s − scale·m_new, then exp in place
    p = torch.add((m_new * -scale)[:, None], s, alpha=scale).exp_()
    return p.to(torch.bfloat16), m_new, p.sum(dim=1)


@functools.lru_cache(maxsize=None)
def _compiled_tile_softmax():
    return torch.compile(tile_softmax, dynamic=True, fullgraph=True)


def _row_block(qb: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor, scale: float, key_tile: int,
               o_out: torch.Tensor, lse_out: torch.Tensor) -> None:
    """One block of rows against all keys: writes o_out [m, d] and lse_out [m] (fp32)."""
    P = kh.shape[0]
    step = _compiled_tile_softmax() if COMPILE_SOFTMAX else tile_softmax
    m = torch.full((qb.shape[0],), float("-inf"), device=qb.device)
    l = acc = None
    for j in range(0, P, key_tile):
        s = torch.mm(qb, kh[j:j + key_tile].t())                   # [m, n] bf16 GEMM
        p, m_new, rowsum = step(s, m, scale)
        pv_j = torch.mm(p, vh[j:j + key_tile])                      # [m, d] bf16 GEMM
        if acc is None:
            l, acc = rowsum, pv_j.float()
        else:
            alpha = torch.exp((m - m_new) * scale)
            l = l.mul_(alpha).add_(rowsum)
            acc = acc.mul_(alpha[:, None]).add_(pv_j)
        m = m_new
    torch.div(acc, l[:, None], out=o_out)
    torch.add(torch.log(l), m, alpha=scale, out=lse_out)  # lse = log l + scale·m
