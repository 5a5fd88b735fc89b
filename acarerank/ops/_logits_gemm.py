"""Where a CPU op's bf16 logits chunk takes ``acarerank::mm_bf16_f32`` (csrc/cpu/logits_gemm.cpp).

    out [M, N] fp32 = a [M, K] bf16 · b [N, K]ᵀ bf16      (fp32 products and sums)

Torch's bf16 ``mm`` on a CPU rounds its output to bf16 (``mm``'s ``out_dtype`` is CUDA-only), so
the ops that need fp32 logits of bf16 rows — the top-k core ("native") and ``linear_logprob``
(whose bf16 backward also runs its ∂hidden GEMM of bf16 ∂z here, summing the chunks in fp32) —
upcast each weight chunk and ran an fp32 GEMM, ~4.5× the time of the bf16 GEMM on a CPU with
AVX512_BF16 (docs/benchmarks.md, "Ops and kernels"). This kernel gives them the fp32 logits at
the bf16 rate where it runs.
"""
from __future__ import annotations

import torch

from . import _native


def mm_bf16_f32_fake(a, b, out):
    return None


def native_bf16_gemm_for(hidden: torch.Tensor, weight: torch.Tensor):
    """``acarerank::mm_bf16_f32(a, b, out)`` when it can take ``hidden [T, H] · weight [V, H]ᵀ``:
    both bf16 on the CPU, H even and > 0 (H = 0: the caller's GEMM, zeros), hidden's and weight's
    rows contiguous (stride 1 along H), acarerank._cpu built and the CPU with AVX512_BF16 (``_native.bf16_logits_gemm``; off under
    ``ACARERANK_CPU_BASELINE=1``) — else None: the caller's fp32 GEMM of the upcast chunk."""
    if not (hidden.dtype == weight.dtype == torch.bfloat16 and hidden.device.type == "cpu"
            and hidden.dim() == weight.dim() == 2 and hidden.shape[1] % 2 == 0 and hidden.shape[1] > 0
            and hidden.stride(1) == 1 and weight.stride(1) == 1):
        return None
    if not _native.available() or not _native.bf16_logits_gemm():
        return None
    from ._native_backend import native_kernel

    return native_kernel("mm_bf16_f32", mm_bf16_f32_fake)
