"""Merge two partial attention results computed over disjoint key sets (cascade attention).

    out = (o_a · e^{lse_a} + o_b · e^{lse_b}) / (e^{lse_a} + e^{lse_b})
    lse = log(e^{lse_a} + e^{lse_b})

evaluated as m = max(lse_a, lse_b), w = e^{lse − m}, so nothing overflows. A part with
lse = −inf (it saw no keys) has weight 0 and its o is ignored, whatever it holds; if both
are −inf, out = 0 and lse = −inf. A NaN lse makes its row's out and lse NaN (every backend).
lse must not be +inf (flash-attn writes +inf for rows
without keys: map those to −inf first, as ``cascade.py`` does); ``validate`` refuses it.

Backends: "torch" (below), "cpp" / "cuda" (csrc/merge_states.cuh), declared in ``OP``.
Default: "cuda" for CUDA tensors when acarerank._C has CUDA, else "torch".
"""
from __future__ import annotations

import torch

from . import _backend
from ._checks import check_float_tensors, inference_only


def _check_inputs(o_a, lse_a, o_b, lse_b):
    check_float_tensors("merge_attention_states", ("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b))
    if o_a.dim() != 3:
        raise ValueError(f"merge_attention_states: o_a must be [tokens, heads, head_dim], got shape {tuple(o_a.shape)}")
    if o_a.shape[2] == 0:  # an attention output with no channels: the backends disagree (values, an error)
        raise ValueError("merge_attention_states: o_a has head_dim 0; need head_dim >= 1")
    if o_b.shape != o_a.shape:
        raise ValueError(f"merge_attention_states: o_b shape {tuple(o_b.shape)} differs from o_a {tuple(o_a.shape)}")
    if o_b.dtype != o_a.dtype:
        raise TypeError(f"merge_attention_states: o_b dtype {o_b.dtype} differs from o_a dtype {o_a.dtype}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if t.shape != o_a.shape[:2]:
            raise ValueError(f"merge_attention_states: {name} must be [{o_a.shape[0]}, {o_a.shape[1]}] "
                             f"(tokens, heads), got shape {tuple(t.shape)}")


def merge_attention_states_ref(o_a, lse_a, o_b, lse_b):
    """Oracle: the formula above in fp64. Returns (out in o_a's dtype, lse fp32)."""
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)  # both empty: weights 0, not NaN
    w_a, w_b = torch.exp(la - m), torch.exp(lb - m)
    total = w_a + w_b
    num = (torch.where(w_a[..., None] != 0, o_a.double() * w_a[..., None], torch.zeros_like(o_a, dtype=torch.float64))
           + torch.where(w_b[..., None] != 0, o_b.double() * w_b[..., None], torch.zeros_like(o_b, dtype=torch.float64)))
    out = torch.where(total[..., None] == 0, torch.zeros_like(num), num / total[..., None])
    return out.to(o_a.dtype), (m + torch.log(total)).float()


def _torch_backend(o_a, lse_a, o_b, lse_b):
    la, lb = lse_a.float(), lse_b.float()
    m = torch.maximum(la, lb)
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)
    w_a, w_b = torch.exp(la - m)[..., None], torch.exp(lb - m)[..., None]
    total = w_a + w_b
    # weight-0 parts are dropped, not multiplied: 0 · NaN would poison the sum. A NaN weight (a NaN
    # lse) is kept, so it propagates as in the cpp/cuda kernels (`> 0` made such a row 0, silently)
    num = torch.where(w_a != 0, o_a.float() * w_a, 0.0) + torch.where(w_b != 0, o_b.float() * w_b, 0.0)
    out = torch.where(total == 0, 0.0, num / total)
    # contiguous, as the fake says: an lse passed as lse.t() (or o_a a view of [H, N, d]) gave the
    # results its strides, and opcheck's fake check and torch.compile failed
    return out.to(o_a.dtype).contiguous(), (m + torch.log(total[..., 0])).contiguous()


OP = _backend.OpDecl(
    "merge_attention_states", aliases=("merge_states",),
    backends={"torch": _backend.Backend(lambda: _torch_backend),
              "cpp": _backend.lazy_backend("merge_attention_states", "cpp", "acarerank.ops._cpp", "merge_states_cpp",
                                           ("cpu",)),
              "cuda": _backend.lazy_backend("merge_attention_states", "cuda", "acarerank.ops._cpp",
                                            "merge_states_cuda", ("cuda",), needs_cuda_build=True)},
    defaults={"cpu": ("torch",), "cuda": ("cuda", "torch")},
)


@torch.library.custom_op("acarerank::merge_attention_states", mutates_args=())
def merge_attention_states_op(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor,
                              backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered op (torch.compile-opaque); ``backend`` is already resolved."""
    return tuple(OP.impl(backend)(o_a, lse_a, o_b, lse_b))


@merge_attention_states_op.register_fake
def _(o_a, lse_a, o_b, lse_b, backend):
    out = torch.empty(o_a.shape, dtype=o_a.dtype, device=o_a.device)
    return out, o_a.new_empty(o_a.shape[:2], dtype=torch.float32)


def merge_attention_states(o_a, lse_a, o_b, lse_b, backend=None, validate: bool = True):
    """Merge two attention partials over disjoint keys of the same queries.

    Args:
      o_a, o_b: [N, H, d] partial outputs (each normalised over its own keys), fp32/fp16/bf16, same dtype.
      lse_a, lse_b: [N, H] their log-sum-exp of scaled scores (any float dtype, any strides:
        flash-attn's [H, N] lse can be passed as ``lse.t()``).
      backend: "torch" | "cpp" | "cuda", a per-op mapping, or None (``ACARERANK_BACKEND`` as a
        preference, else "cuda" on CUDA when built with CUDA, else "torch").
      validate: refuse an lse of +inf (a ValueError naming the first one; the backends would
        disagree on it, each silently): one pass over lse_a and lse_b, and a host sync on CUDA.
        False skips it, for callers that map +inf to -inf themselves (``cascade.py``).
    Returns: (out [N, H, d] in o_a's dtype, lse [N, H] fp32); math in fp32 (fp64 in "cpp").
    """
    _check_inputs(o_a, lse_a, o_b, lse_b)
    if validate:
        for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
            bad = torch.isposinf(t)
            if bool(bad.any()):
                n, h = (int(i) for i in bad.nonzero()[0])
                raise ValueError(f"merge_attention_states: {name}[{n}, {h}] is +inf; a part that saw no keys must "
                                 f"have lse = -inf (flash-attn writes +inf for such rows: map it to -inf first)")
    name = OP.resolve(backend, o_a.device)
    return inference_only("merge_attention_states", "merge_attention_states_ref", (o_a, lse_a, o_b, lse_b),
                          lambda: merge_attention_states_op(o_a, lse_a, o_b, lse_b, name))
