"""Qwen3's per-head q/k RMSNorm + RoPE in one pass over the QKV projection output.

    qkv [T, (Hq + 2·Hkv)·d] = [q | k | v]  ->  q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d]
    q_h ← RoPE(RMSNorm(q_h) · q_weight),  k_h ← RoPE(RMSNorm(k_h) · k_weight),  v unchanged
    RoPE (rotate-half, "neox"): x·cos + rotate_half(x)·sin,  rotate_half([x1, x2]) = [−x2, x1]

cos, sin: [T, d], the rows' rotary tables (``cat(freqs, freqs)`` at each row's position, as
transformers' Qwen3 rotary embedding builds them), fp32 or qkv's dtype. q_weight, k_weight: [d]
in qkv's dtype. Outputs are new contiguous tensors in qkv's dtype.

Backends (``OP``):
  "torch"  transformers' order (norm in fp32 then round, weight and RoPE in the dtype; the runner
           passes cos/sin already in the dtype, as transformers casts them): the eager path.
           Given fp32 tables with bf16 qkv it does RoPE in fp32 and rounds once.
  "native" csrc/cpu/qk_norm_rope.cpp: one pass per row, fp32 inside, one rounding per stored
           element; reads fp32 tables as they are (no cast) — CPU default when built
``qk_norm_rope_ref`` is the oracle: the formula in fp32, rounded once.
"""
from __future__ import annotations

import torch

from . import _backend
from ._native_backend import native_backend


def _check(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads):
    op = "qk_norm_rope"
    for name, t in (("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{op}: {name} must be floating point, got {t.dtype}")
        if t.device != qkv.device:
            raise ValueError(f"{op}: {name} is on {t.device}, qkv is on {qkv.device}")
    for name, n in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise ValueError(f"{op}: {name} must be a positive int, got {n!r}")
    d = q_weight.shape[0] if q_weight.dim() == 1 else -1
    if d <= 0 or d % 2 or k_weight.shape != (d,):
        raise ValueError(f"{op}: q_weight and k_weight must both be [head_dim] with head_dim even, got "
                         f"{tuple(q_weight.shape)} and {tuple(k_weight.shape)}")
    width = (num_heads + 2 * num_kv_heads) * d
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"{op}: qkv must be [T, {width}] (= ({num_heads} + 2·{num_kv_heads})·{d}), "
                         f"got {tuple(qkv.shape)}")
    if cos.shape != (qkv.shape[0], d) or sin.shape != cos.shape:
        raise ValueError(f"{op}: cos and sin must both be [{qkv.shape[0]}, {d}], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    if q_weight.dtype != qkv.dtype or k_weight.dtype != qkv.dtype:
        raise TypeError(f"{op}: q_weight/k_weight must be in qkv's dtype {qkv.dtype}, got {q_weight.dtype}, "
                        f"{k_weight.dtype}")
    if cos.dtype != sin.dtype or cos.dtype not in (torch.float32, qkv.dtype):
        raise TypeError(f"{op}: cos and sin must both be float32 or qkv's dtype {qkv.dtype}, got {cos.dtype}, "
                        f"{sin.dtype}")


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _split(qkv, num_heads, num_kv_heads, d):
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    return q.reshape(T, num_heads, d), k.reshape(T, num_kv_heads, d), v.reshape(T, num_kv_heads, d)


def qk_norm_rope_ref(qkv, q_weight, k_weight, cos, sin, num_heads: int, num_kv_heads: int, eps: float):
    """Oracle: the module docstring's formula in fp32, each output rounded once to qkv's dtype."""
    d = q_weight.shape[0]
    q, k, v = _split(qkv.float(), num_heads, num_kv_heads, d)
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]

    def norm_rope(x, w):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        return (x * c + _rotate_half(x) * s).to(qkv.dtype)

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v.to(qkv.dtype).contiguous()


def _torch_backend(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps):
    d = q_weight.shape[0]
    q, k, v = _split(qkv, num_heads, num_kv_heads, d)
    c, s = cos[:, None, :], sin[:, None, :]

    def norm_rope(x, w):
        xf = x.float()
        x = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        return (x * c + _rotate_half(x) * s).to(qkv.dtype)  # fp32 tables: RoPE in fp32, rounded once

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v.contiguous()


def _fake(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps):
    T, d = qkv.shape[0], q_weight.shape[0]
    return (qkv.new_empty(T, num_heads, d), qkv.new_empty(T, num_kv_heads, d), qkv.new_empty(T, num_kv_heads, d))


OP = _backend.OpDecl(
    "qk_norm_rope", aliases=("rope",),
    backends={"torch": _backend.Backend(lambda: _torch_backend),
              "native": native_backend("qk_norm_rope", "qk_norm_rope_cpu", _fake)},
    defaults={"cpu": ("native", "torch"), "cuda": ("torch",)},
)


@torch.library.custom_op("acarerank::qk_norm_rope", mutates_args=())
def qk_norm_rope_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float,
                    backend: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered op (torch.compile-opaque); ``backend`` is already resolved."""
    q, k, v = OP.impl(backend)(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps)
    if v.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr():
        v = v.clone()  # the torch backend's v is a view of qkv when it is already contiguous (T = 1)
    return q, k, v  # a custom op's outputs may not alias its inputs


@qk_norm_rope_op.register_fake
def _(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps, backend):
    return _fake(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps)


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float = 1e-6, backend=None):
    """(q, k, v) from the QKV projection output (module docstring for shapes and formula).

    Non-contiguous inputs are accepted (the native backend copies them once first).
    """
    _check(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads)
    name = OP.resolve(backend, qkv.device)
    if name == "native":
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    return qk_norm_rope_op(qkv, q_weight.contiguous(), k_weight.contiguous(), cos, sin, num_heads, num_kv_heads,
                           float(eps), name)
