"""The MLP's gate/up projection with SiLU·up fused into its GEMM (Qwen3's SwiGLU, first half).

    gate_up_silu(x, w)   x [..., K], w = [W_g; W_u] [2·I, K] (dense, or a PackedGateUpWeight)
                         ->  y [..., I] = SiLU(x·W_gᵀ) · (x·W_uᵀ),   SiLU(g) = g / (1 + exp(−g))

Backends (``OP``), chosen once per weight, when it is prepared (``prepare_gate_up_weight``), as
the linear op's are:
  "native"  ``acarerank::gate_up_amx`` (csrc/cpu/gate_up_amx.cpp) on AMX-BF16 tiles: the weight
            packed once into the kernel's tile layout (``PackedGateUpWeight``, the only copy; a
            32-column block holds 16 gate and 16 up columns, so one tile block has both sums of
            the same outputs), SiLU·up applied to the fp32 sums and rounded once: [M, I] is
            written, never the [M, 2·I] projection, and nothing reads it back. bfloat16 only, K a
            multiple of 32, I of 16, on a CPU whose AMX tiles this process may use
            (``acarerank.ops._native.amx_tiles_kernel()``: also off with ACARERANK_CPU_AMX_TILES=0).
            The CPU default wherever it can take the weight.
  "torch"   ``silu_and_mul(linear(x, w))``: the linear op (oneDNN or F.linear) and the element-wise
            op (their own backends), the [M, 2·I] projection in between.

``resolve_gate_up_backend`` makes the choice. The default walks past "native" to "torch" where the
kernel cannot take the weight (dtype, shape, CPU) — so does a preference naming "native" for every
op (``backend="native"``: the element-wise kernels run fp32 too, this one does not); "native" asked
of this op itself (a mapping, or ACARERANK_BACKEND's) is then a BackendError naming the reason.

A ``PackedGateUpWeight`` is also a linear weight: ``linear(x, w)`` runs the same kernel without
the SiLU and gives [..., 2·I] = x·[W_g; W_u]ᵀ ([gate | up], one rounding), so every reader of the
layer's matrices (``compile_layers``, the eager layer, ``unpack()``) takes it.

Numerics (native): fp32 sums in a fixed k order whatever the row count, the row's position or the
threads (batch-invariant), SiLU·up in fp32 (its exp within 3e-6 relative), one rounding to bf16
(the "torch" backend rounds gate and up first, then the product). With G, U the exact products of
the bf16 inputs and γ_g = K·2⁻²⁴·(|x|·|W_g|ᵀ), γ_u likewise, each output y is within
    2·(1.1·γ_g·(|U| + γ_u) + |SiLU(G)|·γ_u) + (2⁻⁸ + 4e-6)·|SiLU(G)·U|
of SiLU(G)·U (tests/ops/test_op_gate_up_silu.py derives it and holds every output to it).
``gate_up_silu_ref`` is the oracle: the formula in fp64, rounded once.
"""
from __future__ import annotations

import torch

from . import _backend
from ._backend import BackendError, BackendLimitError
from ._checks import inference_only
from ._native_backend import native_kernel
from .amx_weights import AmxWeight, amx_cpu_why_not, amx_why_not, pack_gate_up, unpack_gate_up
from .linear import KernelWeight, PackedLinearWeight, linear
from .silu_and_mul import silu_and_mul

KERNEL = "gate_up_amx"


def _kernel_fake(x, packed, intermediate, silu):
    return x.new_empty(x.shape[0], intermediate if silu else 2 * intermediate)


def why_not_native(dtype: torch.dtype, in_features: int, intermediate: int) -> str:
    """Why the native kernel cannot take a [2·intermediate, in_features] weight of ``dtype`` here;
    "" when it can."""
    return amx_why_not(dtype, in_features, 2 * intermediate, 32)


class PackedGateUpWeight(AmxWeight):
    """[W_g; W_u] [2·I, K] bf16 packed once for ``acarerank::gate_up_amx``, gate and up interleaved
    (``amx_weights.pack_gate_up``; the "native" backend's form; ``unpack()``: bitwise the original)."""
    __slots__ = ()
    _pack = staticmethod(pack_gate_up)
    _unpack = staticmethod(unpack_gate_up)

    def __init__(self, weight: torch.Tensor):
        _check_weight(weight)
        why = OP.why_not("native", weight.device) or why_not_native(weight.dtype, weight.shape[1], weight.shape[0] // 2)
        super().__init__(weight, why if not why or why.startswith(OP.name) else f"{OP.name}: the native backend {why}")
        native_kernel(KERNEL, _kernel_fake)  # loaded, its fake registered: forward imports nothing

    @property
    def intermediate(self) -> int:
        return self.out_features // 2

    def forward(self, x: torch.Tensor, silu: bool) -> torch.Tensor:
        """x [..., K] (checked by the caller) -> [..., I] with SiLU·up, else [..., 2·I]."""
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > 1 and (rows.stride(1) != 1 or rows.stride(0) < self.in_features):
            rows = rows.contiguous()
        # nothing imported here, so torch.compile traces this (compile_layers) as one opaque op
        y = inference_only("gate_up_silu (AMX-packed weight)", "gate_up_silu_ref", (x,),
                           lambda: torch.ops.acarerank.gate_up_amx(rows, self.packed, self.intermediate, silu))
        return y.view(*x.shape[:-1], y.shape[-1])

    def linear_forward(self, x: torch.Tensor, bias) -> torch.Tensor:
        if bias is not None:
            raise ValueError("linear: a PackedGateUpWeight takes no bias (the MLP's gate/up projection has none)")
        return self.forward(x, silu=False)


def _load_native():
    why = amx_cpu_why_not()
    if why:
        raise BackendError(f"{OP.name}: native backend unavailable: {why}")
    native_kernel(KERNEL, _kernel_fake)
    return lambda x, w: w.forward(x, silu=True)


def _torch_backend(x, w):
    return silu_and_mul(linear(x, w))


OP = _backend.OpDecl(
    "gate_up_silu", aliases=("mlp_gate_up",),
    backends={"native": _backend.Backend(_load_native, ("cpu",)), "torch": _backend.Backend(lambda: _torch_backend)},
    defaults={"cpu": ("native", "torch"), "cuda": ("torch",)},
)


def resolve_gate_up_backend(preference, device, dtype: torch.dtype, in_features: int, intermediate: int) -> str:
    """The backend for a [2·intermediate, in_features] gate/up weight of ``dtype`` on ``device``
    under a backend preference (None: ACARERANK_BACKEND's; module docstring: where "native" cannot
    take the weight, the default and a preference naming "native" for every op walk on to "torch";
    "native" asked of this op by a mapping is a BackendLimitError naming why)."""
    device = torch.device(device)
    pref = preference if preference is not None else _backend._env_preference()
    asked = _backend.backend_for(OP.name, pref)
    if asked == "torch":
        return "torch"
    why = OP.why_not("native", device) or why_not_native(dtype, in_features, intermediate)
    if not why:
        return "native"
    if asked == "native" and not isinstance(pref, str):
        raise BackendLimitError(why if why.startswith(OP.name) else f"{OP.name}: the native backend {why}")
    return "torch"


def prepare_gate_up_weight(weight, backend: str):
    """``weight`` [2·I, K] (a tensor or another packed form with ``unpack()``) in the form
    ``backend`` reads: "native" -> ``PackedGateUpWeight`` (packed once); "torch" -> a
    ``PackedGateUpWeight`` unpacked to the dense tensor, anything else as is (the linear op's form
    is ``prepare_linear_weight``'s). The input is never modified."""
    if backend not in OP.backends:
        raise BackendError(f"gate_up_silu has no {backend!r} backend; it has: {', '.join(sorted(OP.backends))}")
    if isinstance(weight, PackedGateUpWeight):
        return weight if backend == "native" else weight.unpack()
    if backend == "native":
        return PackedGateUpWeight(weight.unpack() if isinstance(weight, (PackedLinearWeight, KernelWeight)) else weight)
    return weight


# -- reference and the op -------------------------------------------------------------------
def _check_weight(w) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"gate_up_silu: weight must be a tensor or a PackedGateUpWeight, got {type(w).__name__}")
    if w.dim() != 2 or not w.is_floating_point() or w.shape[0] % 2:
        raise ValueError(f"gate_up_silu: weight must be a 2-D floating-point [2·I, K] tensor ([W_gate; W_up]), "
                         f"got {w.dtype} shape {tuple(w.shape)}")


def _check(x, w) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"gate_up_silu: input must be a tensor, got {type(x).__name__}")
    if not isinstance(w, (PackedLinearWeight, KernelWeight)):
        _check_weight(w)
    K = w.shape[1]
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"gate_up_silu: input's last dim must be the weight's K = {K}, got input shape "
                         f"{tuple(x.shape)}")
    if x.dtype != w.dtype:
        raise TypeError(f"gate_up_silu: input dtype {x.dtype} differs from the weight's {w.dtype}")
    if x.device != w.device:
        raise ValueError(f"gate_up_silu: input is on {x.device}, the weight on {w.device}")


def gate_up_silu_ref(x: torch.Tensor, w) -> torch.Tensor:
    """Oracle: SiLU(x·W_gᵀ)·(x·W_uᵀ) in fp64, rounded once to x's dtype."""
    w = w.unpack() if isinstance(w, (PackedLinearWeight, KernelWeight)) else w
    g, u = (x.double() @ w.double().T).chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(x.dtype)


def gate_up_silu(x: torch.Tensor, w) -> torch.Tensor:
    """SiLU(x·W_gᵀ)·(x·W_uᵀ) (module docstring) on the backend ``w`` was prepared for: the native
    kernel for a ``PackedGateUpWeight``, else linear + silu_and_mul. x [..., K] (any strides),
    w [2·I, K] -> [..., I]. Bad input is a TypeError/ValueError naming it."""
    _check(x, w)
    if isinstance(w, PackedGateUpWeight):
        return w.forward(x, silu=True)
    return _torch_backend(x, w)
