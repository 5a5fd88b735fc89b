"""Qwen3's per-head q/k RMSNorm + RoPE in one pass over the QKV projection output.

    qkv [T, (Hq + 2·Hkv)·d] = [q | k | v]  ->  q [T, Hq, d], k [T, Hkv, d], v [T, Hkv, d]
    q_h ← RoPE(RMSNorm(q_h) · q_weight),  k_h ← RoPE(RMSNorm(k_h) · k_weight),  v unchanged
    RoPE (rotate-half, "neox"): x·cos + rotate_half(x)·sin,  rotate_half([x1, x2]) = [−x2, x1]

cos, sin: [T, d], the rows' rotary tables (``cat(freqs, freqs)`` at each row's position, as
transformers' Qwen3 rotary embedding builds them), fp32 or qkv's dtype. q_weight, k_weight: [d]
in qkv's dtype. Outputs are new contiguous tensors in qkv's dtype.

Optional page write (``k_cache``, ``v_cache``, ``slots`` — all three or none): the pass also stores
each new row's k and v at flat slot ``slots[t]`` of the paged KV cache (vLLM's layout)

    k_cache, v_cache [num_blocks, block_size, Hkv, d] in qkv's dtype, contiguous (mutated)
    slots int64 [T], slots[t] = block · block_size + offset, each in [0, num_blocks · block_size)
    k_cache.view(-1, Hkv, d)[slots[t]] ← k[t],  v_cache.view(-1, Hkv, d)[slots[t]] ← v[t]

so a runner that attends to the returned k, v needs no separate cache write; the stored bits are
the returned ones. Two equal slots are an error (a caller bug; which row would win is a race), as
is any slot out of range — checked before anything is written, so the caches stay untouched.

Backends (``OP``):
  "torch"  transformers' order (norm in fp32 then round, weight and RoPE in the dtype; the runner
           passes cos/sin already in the dtype, as transformers casts them): the eager path.
           Given fp32 tables with bf16 qkv it does RoPE in fp32 and rounds once. The page write:
           ``index_copy_`` of the returned k, v (``write_pages_ref``).
  "native" csrc/cpu/qk_norm_rope.cpp: one pass per row, fp32 inside, one rounding per stored
           element; reads fp32 tables as they are (no cast); the page write in the same pass over
           the row — CPU default when built
``qk_norm_rope_ref`` is the oracle: the formula in fp32, rounded once.
"""
from __future__ import annotations

from typing import Optional

import torch

from ._checks import check_eps, check_float_tensors, inference_only
from ._native_backend import native_first_decl, register_op, resolve_elementwise


def _check(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads):
    op = "qk_norm_rope"
    check_float_tensors(op, ("qkv", qkv), ("q_weight", q_weight), ("k_weight", k_weight), ("cos", cos), ("sin", sin))
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


def _check_pages(qkv, k_cache, v_cache, slots, num_kv_heads, d):
    """The page write's inputs (module docstring); the native kernel checks the same again."""
    op = "qk_norm_rope"
    given = [t is not None for t in (k_cache, v_cache, slots)]
    if not any(given):
        return
    if not all(given):
        raise ValueError(f"{op}: k_cache, v_cache and slots go together (got {sum(given)} of the 3)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
        if t.device != qkv.device:
            raise ValueError(f"{op}: {name} is on {t.device}, qkv is on {qkv.device}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, d):
        raise ValueError(f"{op}: k_cache must be [num_blocks, block_size, {num_kv_heads}, {d}], got "
                         f"{tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        raise TypeError(f"{op}: k_cache/v_cache must be in qkv's dtype {qkv.dtype}, got {k_cache.dtype} and "
                        f"{v_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError(f"{op}: k_cache and v_cache must be contiguous (strides {k_cache.stride()} and "
                         f"{v_cache.stride()})")
    T = qkv.shape[0]
    if slots.dtype != torch.int64:
        raise TypeError(f"{op}: slots must be int64, got {slots.dtype}")
    if slots.dim() != 1 or slots.shape[0] != T:
        raise ValueError(f"{op}: slots must be [T] = [{T}], got {tuple(slots.shape)}")


def _check_page_data(op, qkv, k_cache, v_cache, slots):
    """The checks of the page write that read memory addresses and slot values: in the wrapper in
    eager calls; under torch.compile (which can trace neither) inside the registered op, when it runs."""
    ptrs = [t.untyped_storage().data_ptr() for t in (k_cache, v_cache, qkv) if t.numel()]
    if len(set(ptrs)) != len(ptrs):  # (empty tensors hold no memory to share)
        raise ValueError(f"{op}: k_cache, v_cache and qkv must not share memory")
    T, capacity = qkv.shape[0], k_cache.shape[0] * k_cache.shape[1]
    if T:
        bad = ((slots < 0) | (slots >= capacity)).nonzero()
        if bad.numel():
            t = int(bad[0])
            raise ValueError(f"{op}: slots[{t}] = {int(slots[t])} is outside the caches' [0, {capacity}) "
                             f"(num_blocks·block_size = {k_cache.shape[0]}·{k_cache.shape[1]})")
        uniq, counts = torch.unique(slots, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(f"{op}: slot {int(uniq[counts > 1][0])} appears more than once in slots "
                             f"(each new row needs its own slot)")


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


def write_pages_ref(k_cache, v_cache, slots, k, v) -> None:
    """The page write as plain PyTorch: rows k[t], v[t] [T, Hkv, d] to flat slot slots[t]."""
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def _torch_backend(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps, k_cache=None, v_cache=None,
                   slots=None):
    q, k, v = _torch_norm_rope(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps)
    if k_cache is not None:
        write_pages_ref(k_cache, v_cache, slots, k, v)
    return q, k, v


def _torch_norm_rope(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps):
    d = q_weight.shape[0]
    q, k, v = _split(qkv, num_heads, num_kv_heads, d)
    c, s = cos[:, None, :], sin[:, None, :]

    def norm_rope(x, w):
        xf = x.float()
        x = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        # fp32 tables: RoPE in fp32, rounded once; contiguous, as the fake says, whatever qkv's strides
        return (x * c + _rotate_half(x) * s).to(qkv.dtype).contiguous()

    return norm_rope(q, q_weight), norm_rope(k, k_weight), v.contiguous()


def _fake(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps, k_cache=None, v_cache=None, slots=None,
          check_pages=False):
    T, d = qkv.shape[0], q_weight.shape[0]
    return (qkv.new_empty(T, num_heads, d), qkv.new_empty(T, num_kv_heads, d), qkv.new_empty(T, num_kv_heads, d))


OP = native_first_decl("qk_norm_rope", _torch_backend, _fake, aliases=("rope",))


@register_op(OP, _fake, mutates_args=("k_cache", "v_cache"))
def qk_norm_rope_op(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float, backend: str,
                    k_cache: Optional[torch.Tensor] = None, v_cache: Optional[torch.Tensor] = None,
                    slots: Optional[torch.Tensor] = None,
                    check_pages: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The registered op (torch.compile-opaque; mutates the caches when given); ``backend`` is
    already resolved. ``check_pages``: run ``_check_page_data`` first (a compiled caller's wrapper
    could not)."""
    if check_pages and k_cache is not None:
        _check_page_data("qk_norm_rope", qkv, k_cache, v_cache, slots)
    q, k, v = OP.impl(backend)(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads, eps, k_cache=k_cache,
                               v_cache=v_cache, slots=slots)
    if v.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr():
        v = v.clone()  # the torch backend's v is a view of qkv when it is already contiguous (T = 1)
    return q, k, v  # a custom op's outputs may not alias its inputs


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, num_heads: int, num_kv_heads: int, eps: float = 1e-6, backend=None, *,
                 k_cache: Optional[torch.Tensor] = None, v_cache: Optional[torch.Tensor] = None,
                 slots: Optional[torch.Tensor] = None):
    """(q, k, v) from the QKV projection output (module docstring for shapes and formula); with
    ``k_cache``, ``v_cache``, ``slots`` the new k, v rows are also written into those pages.

    Non-contiguous qkv/cos/sin are accepted (the native backend copies them once first).
    """
    _check(qkv, q_weight, k_weight, cos, sin, num_heads, num_kv_heads)
    check_eps("qk_norm_rope", eps)
    _check_pages(qkv, k_cache, v_cache, slots, num_kv_heads, q_weight.shape[0])
    compiling = torch.compiler.is_compiling()
    if k_cache is not None and not compiling:
        _check_page_data("qk_norm_rope", qkv, k_cache, v_cache, slots)
    name = resolve_elementwise(OP, backend, qkv.device, qkv.dtype, head_dim=q_weight.shape[0])
    if name == "native":
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    return inference_only("qk_norm_rope", "qk_norm_rope_ref", (qkv, q_weight, k_weight, cos, sin, k_cache, v_cache),
                          lambda: qk_norm_rope_op(qkv, q_weight.contiguous(), k_weight.contiguous(), cos, sin,
                                                  num_heads, num_kv_heads, float(eps), name, k_cache=k_cache,
                                                  v_cache=v_cache, slots=slots, check_pages=compiling),
                          mutated=(("k_cache", k_cache), ("v_cache", v_cache)))
