"""SiLU(gate)·up over the fused gate_up projection output (Qwen3's SwiGLU MLP).

    x [..., 2·I] = [gate | up]  ->  y [..., I],  y = SiLU(gate)·up,  SiLU(g) = g / (1 + exp(−g))

In/out in the activation dtype (fp32 or bf16). Backends (``OP``): "torch" (``F.silu(gate) * up``
in the dtype, transformers' order: two roundings in bf16), "native" (csrc/cpu/activation.cpp:
fp32 inside, one rounding; CPU default when built). ``silu_and_mul_ref``: the formula in fp32,
rounded once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import inference_only
from ._native_backend import native_first_decl, register_op, resolve_elementwise


def _check(x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"silu_and_mul: input must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"silu_and_mul: input must be floating point, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: the last dim holds [gate | up] and must be even, got shape {tuple(x.shape)}")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Oracle: the formula in fp32, rounded once to x's dtype."""
    g, u = x.float().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def _torch_backend(x):
    g, u = x.chunk(2, dim=-1)
    return (F.silu(g) * u).contiguous()  # as the fake says, whatever x's strides


def _fake(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


OP = native_first_decl("silu_and_mul", _torch_backend, _fake, aliases=("swiglu",))


@register_op(OP, _fake)
def silu_and_mul_op(x: torch.Tensor, backend: str) -> torch.Tensor:
    """The registered op (torch.compile-opaque); ``backend`` is already resolved."""
    return OP.impl(backend)(x)


def silu_and_mul(x: torch.Tensor, backend=None) -> torch.Tensor:
    """SiLU(gate)·up (module docstring). x [..., 2·I] fp32/bf16 -> [..., I]; non-contiguous x is
    accepted (the native backend copies it once first)."""
    _check(x)
    name = resolve_elementwise(OP, backend, x.device, x.dtype)
    return inference_only("silu_and_mul", "silu_and_mul_ref", (x,),
                          lambda: silu_and_mul_op(x.contiguous() if name == "native" else x, name))
