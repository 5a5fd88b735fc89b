"""Fused yes/no scoring head (Qwen3-Reranker, docs/ARCHITECTURE.md, "Scoring facts"), Triton.

For the last hidden state h of each segment (before the final RMSNorm), in one read of h:

    logit_diff = rsqrt(mean(h²) + eps) · Σ_j h_j · norm_weight_j · (w_yes_j − w_no_j)
    score      = sigmoid(logit_diff) = softmax([logit_no, logit_yes])[1]

The RMSNorm scale is a per-row scalar, so it factors out of the dot product: the sum of
squares and the dot product accumulate side by side in fp32 over H in BLOCK_H chunks and
the normalisation is applied once at the end. The 151,669-wide logits are never formed.
Each row is reduced in a fixed order by its own lanes (no atomics), so a row's score does
not depend on the other rows of the batch.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from acarerank._triton_env import interpreter_lock, triton_interpreted


@triton.jit
def _yes_no_head_kernel(Hid, NormW, WYes, WNo, Score, Diff, S, H, stride_s, stride_h, eps,
                        BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    row_ok = rows < S
    row_base = Hid + rows.to(tl.int64)[:, None] * stride_s
    sumsq = tl.zeros([BLOCK_S, BLOCK_H], dtype=tl.float32)
    dot = tl.zeros([BLOCK_S, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        cols = h0 + tl.arange(0, BLOCK_H)
        col_ok = cols < H
        x = tl.load(row_base + cols[None, :] * stride_h, mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        x = x.to(tl.float32)
        # norm weight folded into the yes−no direction (fp32, like the torch backend)
        w = tl.load(NormW + cols, mask=col_ok, other=0.0).to(tl.float32) * (
            tl.load(WYes + cols, mask=col_ok, other=0.0).to(tl.float32)
            - tl.load(WNo + cols, mask=col_ok, other=0.0).to(tl.float32))
        sumsq += x * x
        dot += x * w[None, :]
    # -- one reduction per row at the end: elementwise partial sums keep the order fixed
    inv_rms = 1.0 / tl.sqrt(tl.sum(sumsq, 1) / H + eps)
    diff = tl.sum(dot, 1) * inv_rms
    tl.store(Diff + rows, diff, mask=row_ok)
    tl.store(Score + rows, tl.sigmoid(diff), mask=row_ok)


def gpu_config(H: int) -> tuple:
    """(BLOCK_S, BLOCK_H, num_warps) on a GPU. H of Qwen3: 1024 (0.6B), 2560 (4B), 4096 (8B): 1–4
    chunks of 1024 per row; two [4, 1024] fp32 accumulators over 128 threads (no spill on sm_80 /
    sm_90: ``bench/aot_check.py``)."""
    return 4, min(1024, max(16, triton.next_power_of_2(H))), 4


def yes_no_score_triton(hidden_last, norm_weight, w_yes, w_no, eps):
    """Relevance from each segment's last hidden state (Triton). Inputs are checked by ``acarerank.ops``.

    Args:
      hidden_last: (S, H) any float dtype, any strides — hidden states before the final RMSNorm.
      norm_weight, w_yes, w_no: (H,) — final RMSNorm weight; lm_head rows of "yes" (9693) / "no" (2152).
      eps: RMSNorm epsilon.
    Returns: (score (S,) fp32, logit_diff (S,) fp32), logit_diff = logit_yes − logit_no.
    """
    S, H = hidden_last.shape
    on_gpu = hidden_last.device.type == "cuda"
    if not on_gpu and not triton_interpreted(_yes_no_head_kernel):
        raise RuntimeError(
            "yes_no_score (triton): CPU tensors need TRITON_INTERPRET=1 set before "
            "acarerank.kernels.yes_no_head is imported"
        )
    score = torch.empty(S, dtype=torch.float32, device=hidden_last.device)
    diff = torch.empty(S, dtype=torch.float32, device=hidden_last.device)
    if S == 0:
        return score, diff
    if on_gpu:
        block_s, block_h, warps = gpu_config(H)
    else:  # interpreter: fewer, larger programs are faster
        block_s, block_h, warps = 16, min(1024, max(16, triton.next_power_of_2(H))), 4
    nw, wy, wn = norm_weight.contiguous(), w_yes.contiguous(), w_no.contiguous()
    with interpreter_lock():
        _yes_no_head_kernel[(triton.cdiv(S, block_s),)](
            hidden_last, nw, wy, wn, score, diff, S, H, hidden_last.stride(0), hidden_last.stride(1), float(eps),
            BLOCK_S=block_s, BLOCK_H=block_h, num_warps=warps)
    return score, diff


__all__ = ["yes_no_score_triton", "gpu_config"]
