"""Layer matrices packed once for the AMX GEMMs of ``acarerank._cpu`` (csrc/cpu/amx_gemm.h).

    pack_gate_up(w)     [2·I, K] = [W_g; W_u] -> 1-D, each block 16 gate then 16 up columns:
                        packed[b][s][h][kp][c][e] = w[h·I + 16b + c][32s + 2kp + e]
    unpack_gate_up      its inverse (the dense tensor, bitwise)
    amx_why_not(dtype, in_features, out_features, out_multiple)
                        why the kernels cannot take such a weight here; "" when they can

``AmxWeight`` is the base of the packed forms (``gate_up_silu.PackedGateUpWeight``): a
``linear.KernelWeight``, so ``linear(x, w)`` runs the kernel's plain epilogue and every reader of
the layer's matrices takes it; the packed tensor is the only copy. The kernels need bf16, K a
multiple of 32, and a CPU whose AMX tiles this process may use (``_native.amx_tiles_kernel()``:
also off with ACARERANK_CPU_AMX_TILES=0).
"""
from __future__ import annotations

import torch

from . import _native
from ._backend import BackendError
from .linear import KernelWeight


def pack_gate_up(w: torch.Tensor) -> torch.Tensor:
    I, K = w.shape[0] // 2, w.shape[1]
    return w.reshape(2, I // 16, 16, K // 32, 16, 2).permute(1, 3, 0, 4, 2, 5).contiguous().view(-1)


def unpack_gate_up(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    I = N // 2
    return packed.view(I // 16, K // 32, 2, 16, 16, 2).permute(2, 0, 4, 1, 3, 5).reshape(N, K)


def amx_cpu_why_not() -> str:
    """Why this process cannot run the AMX GEMMs; "" when it can (loads acarerank._cpu)."""
    try:
        _native.load()
    except BackendError as e:
        return f"needs acarerank._cpu: {e}"
    if not _native.amx_tiles_kernel():
        return (f"runs on AMX-BF16 tiles, which this process does not use (bf16 path "
                f"{_native.bf16_attention_path()!r}: no AMX, tiles not granted, or ACARERANK_CPU_AMX_TILES=0)")
    return ""


def amx_why_not(dtype: torch.dtype, in_features: int, out_features: int, out_multiple: int) -> str:
    """Why the AMX GEMMs cannot take an [out_features, in_features] weight of ``dtype`` here (the
    op's own output blocks need ``out_features % out_multiple == 0``); "" when they can."""
    if dtype != torch.bfloat16:
        return f"runs bfloat16 weights, not {dtype}"
    if in_features <= 0 or in_features % 32:
        return f"needs the input size K to be a positive multiple of 32, got {in_features}"
    if out_features <= 0 or out_features % out_multiple:
        return f"needs {out_features} output columns to be a positive multiple of {out_multiple}"
    return amx_cpu_why_not()


class AmxWeight(KernelWeight):
    """A [N, K] bf16 layer matrix packed once for an AMX GEMM; subclasses give the layout
    (``_pack``, ``_unpack``: static functions) and the plain linear (``linear_forward``)."""
    __slots__ = ("packed", "out_features", "in_features", "dtype")

    def __init__(self, weight: torch.Tensor, why: str):
        """``why``: the op's ``amx_why_not`` line for this weight ("" when it can take it)."""
        if why:
            raise BackendError(why)
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = type(self)._pack(weight.detach())

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def unpack(self) -> torch.Tensor:
        """The dense [N, K] weight (a new tensor), bitwise the original."""
        return type(self)._unpack(self.packed, self.out_features, self.in_features)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(native AMX, [{self.out_features}, {self.in_features}], {self.dtype})"
