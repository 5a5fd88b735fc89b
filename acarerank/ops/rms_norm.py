"""RMSNorm and fused residual-add + RMSNorm: the decoder layer's norms (Qwen3RMSNorm).

    rms_norm(x, w, eps)                     y = x / sqrt(mean(x²) + eps) · w          (over the last dim)
    fused_add_rms_norm(x, residual, w, eps) residual ← residual + x   (in place, rounded to its dtype)
                                            y = rms_norm(residual, w, eps)

Shapes: x, residual [..., H] in the activation dtype (fp32 or bf16), w [H] in the same dtype;
y has x's shape and dtype. The fused op writes the sum into ``residual`` (the residual stream of
the runner's layer, a tensor it owns) and returns only y.

Backends (``OP_RMS_NORM``, ``OP_FUSED_ADD``):
  "torch"  transformers' order: normalise in fp32, round to the dtype, then multiply by w in the
           dtype (bitwise the Qwen3 layer of transformers; the runner's eager path)
  "native" csrc/cpu/norm.cpp: fp32 throughout, one rounding per stored element, no fp32 copy of
           the activation (CPU default when acarerank._cpu is built)
``*_ref`` is the oracle: the formula in fp32, rounded once. In bf16 the two backends differ by
about one rounding (the torch order rounds twice); tests hold both to the bf16 rule against fp32.
"""
from __future__ import annotations

import torch

from ._checks import check_eps, check_float_tensors, inference_only
from ._native_backend import native_first_decl, register_op, resolve_elementwise


def _check(op: str, x, weight, residual=None):
    residual_arg = (("residual", residual),) if residual is not None else ()
    check_float_tensors(op, ("input", x), ("weight", weight), *residual_arg)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"{op}: input must have a non-empty last dim, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"{op}: weight must be [{x.shape[-1]}], got shape {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"{op}: weight dtype {weight.dtype} differs from the input's {x.dtype}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual must match the input ({tuple(x.shape)}, {x.dtype}), "
                             f"got {tuple(residual.shape)}, {residual.dtype}")
        if not residual.is_contiguous():
            raise ValueError(f"{op}: residual is updated in place and must be contiguous "
                             f"(strides {residual.stride()})")
        # (empty tensors hold no memory to share: both storages' pointers are null). Eager calls only:
        # torch.compile cannot trace a storage's data_ptr (fullgraph=True failed on it, where docs/api.md
        # says the layer ops compile so); what is lost: a compiled call with an overlapping residual
        # is not refused
        if torch.compiler.is_compiling():
            return
        if x.numel() and _storage_ptr(residual) == _storage_ptr(x):
            raise ValueError(f"{op}: residual and input must not share memory")
        # a weight inside the residual stream would be read after the add updated it
        if x.numel() and _storage_ptr(residual) == _storage_ptr(weight):
            raise ValueError(f"{op}: residual and weight must not share memory")


def _storage_ptr(t: torch.Tensor) -> int:
    """The address of ``t``'s storage; through torch.func's wrappers (vmap's batched tensors, jvp's
    and grad's tracking ones), whose own storage cannot be read (it raised NotImplementedError), that
    of the tensor they wrap."""
    F = torch._C._functorch
    while F.is_functorch_wrapped_tensor(t):
        t = F.get_unwrapped(t)
    return t.untyped_storage().data_ptr()


# -- references ---------------------------------------------------------------------------
def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Oracle: the formula in fp32, rounded once to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """Oracle, functional: (y, new residual) with the sum rounded to the dtype before the norm."""
    s = (residual.float() + x.float()).to(x.dtype)
    return rms_norm_ref(s, weight, eps), s


# -- torch backend (transformers' order) --------------------------------------------------
def _rms_norm_torch(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # contiguous, as the fake says: a permuted x gave y its strides, and torch.compile's check of
    # the op's output strides failed
    return (weight * xf.to(x.dtype)).contiguous()


def _fused_add_torch(x, residual, weight, eps):
    residual.add_(x)
    return _rms_norm_torch(residual, weight, eps)


def _fake_norm(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_fused_add(x, residual, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


OP_RMS_NORM = native_first_decl("rms_norm", _rms_norm_torch, _fake_norm, aliases=("norm",))
OP_FUSED_ADD = native_first_decl("fused_add_rms_norm", _fused_add_torch, _fake_fused_add, aliases=("add_norm",))


@register_op(OP_RMS_NORM, _fake_norm)
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str) -> torch.Tensor:
    """The registered op (torch.compile-opaque); ``backend`` is already resolved."""
    return OP_RMS_NORM.impl(backend)(x, weight, eps)


@register_op(OP_FUSED_ADD, _fake_fused_add, mutates_args=("residual",))
def fused_add_rms_norm_op(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          backend: str) -> torch.Tensor:
    """The registered op (mutates ``residual``); ``backend`` is already resolved."""
    return OP_FUSED_ADD.impl(backend)(x, residual, weight, eps)


def _contiguous_for(name: str, x: torch.Tensor) -> torch.Tensor:
    # the native kernels read rows in place; a strided view is copied once here (documented)
    return x.contiguous() if name == "native" else x


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend=None) -> torch.Tensor:
    """RMSNorm over the last dim (module docstring). x [..., H] fp32/bf16, weight [H] same dtype.

    A non-contiguous x is accepted (the native backend copies it once first).
    """
    _check("rms_norm", x, weight)
    check_eps("rms_norm", eps)
    name = resolve_elementwise(OP_RMS_NORM, backend, x.device, x.dtype)
    return inference_only("rms_norm", "rms_norm_ref", (x, weight),
                          lambda: rms_norm_op(_contiguous_for(name, x), weight.contiguous(), float(eps), name))


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                       backend=None) -> torch.Tensor:
    """``residual += x`` in place, then RMSNorm of it; returns y (module docstring).

    x, residual [..., H] same shape and dtype (residual contiguous, not sharing x's or weight's memory;
    the sharing is refused in eager calls only: torch.compile cannot read a storage's address).
    """
    _check("fused_add_rms_norm", x, weight, residual)
    check_eps("fused_add_rms_norm", eps)
    name = resolve_elementwise(OP_FUSED_ADD, backend, x.device, x.dtype)
    return inference_only("fused_add_rms_norm", "fused_add_rms_norm_ref", (x, residual, weight),
                          lambda: fused_add_rms_norm_op(_contiguous_for(name, x), residual, weight.contiguous(),
                                                        float(eps), name),
                          mutated=(("residual", residual),))
