"""The two halves of a Qwen3 decoder layer around attention, eager or fused by torch.compile.

    attn_in:      h = RMSNorm(x);  q, k, v = split(h·W_qkvᵀ + b);  q, k = RMSNorm per head;  RoPE(q, k)
    attn_out_mlp: x = x + attn·W_oᵀ;  h = RMSNorm(x);  g, u = split(h·W_guᵀ);  x + (SiLU(g)·u)·W_downᵀ

Between the GEMMs sit memory-bound element-wise passes (norms, RoPE, SiLU·up, residual
adds): eager PyTorch reads and writes the [T, ·] activations once per op. ``compiled()``
hands both halves to torch.compile (inductor's CPU C++ codegen), which fuses each run of
element-wise ops into one loop and leaves the GEMMs to ATen/oneDNN; the attention op is a
registered custom op in between, outside both graphs.

Numerics: the eager functions are the runner's reference order (transformers' Qwen3, for
bf16 parity); inductor computes bf16 element-wise chains in fp32 and rounds once per stored
tensor, which moves bf16 results by about one rounding (well inside the bf16 rule of the
tests) and fp32 results by reordering only.

Whether the compiled halves win is machine-specific; ``bench/bench_cpu_bf16.py --what layer``
measures it interleaved (eager vs compiled, same process). The runner's default stays eager
unless a caller asks (``Qwen3Runner(compile_layers=True)``).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm: normalise in fp32, cast back, then scale (transformers' order, for bf16 parity)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attn_in(x: torch.Tensor, input_norm: torch.Tensor, w_qkv: torch.Tensor, b_qkv: Optional[torch.Tensor],
            q_norm: torch.Tensor, k_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            heads: int, kv_heads: int, head_dim: int, eps: float, linear=F.linear):
    """x [T, H] → q [T, Hq, d], k [T, Hkv, d] (normed, RoPE applied), v [T, Hkv, d].

    cos, sin: [T, 1, d] in x's dtype (positions of the unshared sequence).
    """
    T = x.shape[0]
    h = rms_norm(x, input_norm, eps)
    qkv = linear(h, w_qkv, b_qkv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = rms_norm(q.view(T, heads, head_dim), q_norm, eps)
    k = rms_norm(k.view(T, kv_heads, head_dim), k_norm, eps)
    v = v.reshape(T, kv_heads, head_dim)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    return q, k, v


def attn_out_mlp(x: torch.Tensor, attn: torch.Tensor, w_o: torch.Tensor, post_norm: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, eps: float, linear=F.linear,
                 b_o: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [N, H] (residual), attn [N, Hq·d] → x after o_proj (+ b_o [H] when attention_bias), residual,
    post-norm, SwiGLU MLP, residual."""
    x = x + linear(attn, w_o, b_o)
    h = rms_norm(x, post_norm, eps)
    gate, up = linear(h, w_gate_up).chunk(2, dim=-1)
    return x + linear(F.silu(gate) * up, w_down)


@functools.lru_cache(maxsize=None)
def compiled():
    """(attn_in, attn_out_mlp) compiled once per process with dynamic token counts.

    dynamic=True: one graph serves every pass length (packed passes vary in T); the layer
    weights are arguments, so all layers share the graph too.
    """
    return (torch.compile(attn_in, dynamic=True, fullgraph=True),
            torch.compile(attn_out_mlp, dynamic=True, fullgraph=True))
