"""The decoder's linear layers on weights prepared once: F.linear, or oneDNN on a reordered weight.

    linear(x, weight, bias)      x [..., K], weight [N, K] (or its packed form), bias [N] or None
                                 ->  y [..., N] = x·Wᵀ + b   in x's dtype (fp32 accumulation)

Backends (``OP``), chosen once per weight, when it is prepared (``prepare_linear_weight``):
  "torch"  ``F.linear`` on the dense weight (MKL sgemm in fp32 on CPU, cuBLAS on CUDA); the
           weight stays the tensor it was.
  "onednn" ``torch.ops.mkldnn._linear_pointwise`` on the weight reordered once into oneDNN's
           blocked layout (``torch.ops.mkldnn._reorder_linear_weight``, as vLLM's CPU linear and
           inductor's CPU weight freezing do); the weight becomes a ``PackedLinearWeight``, the
           only copy (``unpack()`` gives the dense tensor back, bitwise). CPU only. The CPU
           default where the reorder works for the weight's dtype (``onednn_why_unavailable``,
           probed once per dtype); elsewhere the default is "torch" and the probe's one line
           says why (bf16 needs AVX512BW/VL/DQ or AVX_NE_CONVERT).

``linear`` runs whatever the weight was prepared for: nothing is reordered per call, and a packed
weight serves any row count (M = 0, 1, 7, 4097, strided x alike). A weight packed for a kernel of
ours (a ``KernelWeight``: ``gate_up_silu.PackedGateUpWeight``, the MLP's gate/up matrix on AMX
tiles) runs that kernel.

Numerics: both backends accumulate in fp32 and round once per output; oneDNN's blocked K order
differs from MKL's, so fp32 results differ by rounding only, each within K·2⁻²⁴·(|x|·|W|ᵀ + |b|)
of the exact value (measured at the 0.6B shapes, K 1,024–3,072, unit-scale outputs: max|Δ| vs
F.linear 4e-6–8e-6). ``linear_ref`` is the oracle: the formula in fp64, rounded once.

Not an ``acarerank::`` custom op of its own: F.linear is aten's. The oneDNN call is registered as
``acarerank::linear_onednn`` only so that torch.compile'd layers (``compile_layers=True``) can
call it: inductor cannot lower ``mkldnn._linear_pointwise`` with an mkldnn weight as a graph input,
and an opaque custom op with a fake (meta) kernel keeps the weight out of the graph.
"""
from __future__ import annotations

import functools
from typing import Optional, Union

import torch
import torch.nn.functional as F

from . import _backend
from ._checks import inference_only

#: the row count oneDNN is told to expect when it picks the weight's blocked layout (any row count
#: runs on it): the lower of the two row counts the layout was measured at (512, 2,048);
#: `bench/bench_cpu_linear.py` times the op with this hint beside a reorder for each row count.
PACK_ROWS_HINT = 512


class PackedForm:
    """What a packed form of a layer matrix [N, K] says of itself (``PackedLinearWeight``,
    ``KernelWeight``): ``shape`` and ``device``, from its ``out_features``, ``in_features`` and
    ``packed`` tensor."""
    __slots__ = ()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def device(self) -> torch.device:
        return self.packed.device


class PackedLinearWeight(PackedForm):
    """A linear weight [N, K] reordered once for oneDNN (the "onednn" backend's form of it).

    ``packed`` is an opaque mkldnn tensor (its storage cannot be read; ``nbytes`` is the dense
    size it was made from). ``unpack()`` returns the dense [N, K] tensor, bitwise the original.
    """
    __slots__ = ("packed", "out_features", "in_features", "dtype")

    def __init__(self, weight: torch.Tensor):
        if weight.device.type != "cpu":
            raise ValueError(f"linear: the onednn backend packs CPU weights, got one on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features * self.packed.element_size()

    def unpack(self) -> torch.Tensor:
        """The dense [N, K] weight (a new tensor)."""
        return self.packed.to_dense()

    def __repr__(self) -> str:
        return f"PackedLinearWeight(onednn, [{self.out_features}, {self.in_features}], {self.dtype})"


class KernelWeight(PackedForm):
    """A layer matrix [N, K] packed for a native kernel of ours (``gate_up_silu.PackedGateUpWeight``):
    ``linear`` calls its ``linear_forward(x, bias)``; ``shape``, ``dtype``, ``device`` and
    ``unpack()`` (the dense tensor, bitwise) as ``PackedLinearWeight``'s."""
    __slots__ = ()

    def linear_forward(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError


Weight = Union[torch.Tensor, PackedLinearWeight, KernelWeight]


# -- reference and backends -----------------------------------------------------------------
def linear_ref(x: torch.Tensor, weight: Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Oracle: x·Wᵀ + b in fp64, rounded once to x's dtype."""
    w = weight.unpack() if isinstance(weight, (PackedLinearWeight, KernelWeight)) else weight
    y = x.double() @ w.double().T
    return (y if bias is None else y + bias.double()).to(x.dtype)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    # oneDNN reads the bias as a dense vector whatever its strides (b[::2]: another bias, no error;
    # an expanded one: reads past its one element, a segfault at 4M outputs)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None if bias is None else bias.contiguous(), "none", [], "")


def _load_onednn():
    if not torch.backends.mkldnn.is_available():
        raise _backend.BackendError("linear: onednn backend unavailable: this torch was built without oneDNN "
                                    "(torch.backends.mkldnn.is_available() is False)")
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        raise _backend.BackendError("linear: onednn backend unavailable: this torch has no "
                                    "torch.ops.mkldnn._reorder_linear_weight")
    return _onednn_linear


OP = _backend.OpDecl(
    "linear", aliases=("gemm",),
    backends={"torch": _backend.Backend(lambda: F.linear),
              "onednn": _backend.Backend(_load_onednn, ("cpu",))},
    defaults={"cpu": ("onednn", "torch"), "cuda": ("torch",)},
)


@torch.library.custom_op("acarerank::linear_onednn", mutates_args=())
def linear_onednn_op(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
                     out_features: int) -> torch.Tensor:
    """The oneDNN call as an opaque op (module docstring: torch.compile); ``packed`` is mkldnn."""
    return _onednn_linear(x, packed, bias)


@linear_onednn_op.register_fake
def _(x, packed, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


# -- choice ---------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def onednn_why_unavailable(dtype: torch.dtype) -> str:
    """One line saying why the "onednn" backend cannot run ``dtype`` weights here; "" when it can.

    Probed once per dtype: a 16×16 weight reordered and multiplied (oneDNN refuses a dtype its
    CPU lacks the instructions for at the reorder, e.g. bf16 without AVX512BW/VL/DQ or AVX_NE_CONVERT).
    """
    why = OP.why_not("onednn", torch.device("cpu"))
    if why is not None:
        return why
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"linear: onednn backend: {dtype} weights are not supported (float32, bfloat16, float16)"
    try:
        w = torch.ones(16, 16, dtype=dtype, device="cpu")
        y = _onednn_linear(torch.ones(1, 16, dtype=dtype, device="cpu"), PackedLinearWeight(w).packed, None)
    except RuntimeError as e:
        return f"linear: onednn backend cannot run {dtype} on this CPU: {str(e).splitlines()[0]}"
    if not torch.equal(y, torch.full((1, 16), 16.0, dtype=dtype, device="cpu")):
        return f"linear: onednn backend gave a wrong {dtype} result on a probe; not used"
    return ""


def resolve_linear_backend(preference, device, dtype: torch.dtype) -> tuple:
    """(backend, reason): the linear backend for weights of ``dtype`` on ``device`` under a backend
    preference (a name or a per-op mapping, ``acarerank.ops.backend_for``; None = ACARERANK_BACKEND,
    else the device default).

    The device default takes "onednn" on CPU when ``onednn_why_unavailable(dtype)`` is "", else
    "torch" with that line as ``reason`` ("" when nothing fell back). "onednn" asked for by name
    (argument, mapping or environment) where it cannot run ``dtype`` is a BackendError with the line.
    """
    device = torch.device(device)
    asked = _backend.backend_choice(OP.name, preference)
    # the name asked of this op: the preference's, or, with none given, ACARERANK_BACKEND's entry
    explicit = asked if preference is not None else _backend.backend_for(OP.name, _backend._env_preference())
    name = OP.resolve(asked, device)
    if name == "onednn":
        why = onednn_why_unavailable(dtype)
        if why:
            if explicit == "onednn":
                raise _backend.BackendError(why)
            return "torch", why
    return name, ""


def prepare_linear_weight(weight: Weight, backend: str) -> Weight:
    """``weight`` [N, K] in the form ``backend`` reads: "onednn" -> ``PackedLinearWeight``
    (reordered once), "torch" -> the dense tensor (a packed one is unpacked). Already in that form:
    returned as is. The input is never modified."""
    if backend not in OP.backends:
        raise _backend.BackendError(f"linear has no {backend!r} backend; it has: {', '.join(sorted(OP.backends))}")
    if isinstance(weight, KernelWeight):
        weight = weight.unpack()
    if backend == "onednn":
        if isinstance(weight, PackedLinearWeight):
            return weight
        _check_weight(weight)
        OP.impl("onednn")
        why = onednn_why_unavailable(weight.dtype)
        if why:
            raise _backend.BackendError(why)
        return PackedLinearWeight(weight)
    return weight.unpack() if isinstance(weight, PackedLinearWeight) else weight


# -- the op ---------------------------------------------------------------------------------
def _check_weight(w) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"linear: weight must be a tensor or a PackedLinearWeight, got {type(w).__name__}")
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"linear: weight must be a 2-D floating-point [N, K] tensor, got {w.dtype} "
                         f"shape {tuple(w.shape)}")


def _check(x, weight, bias) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"linear: input must be a tensor, got {type(x).__name__}")
    if not isinstance(weight, (PackedLinearWeight, KernelWeight)):
        _check_weight(weight)
    N, K = weight.shape
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"linear: input's last dim must be the weight's K = {K}, got input shape {tuple(x.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"linear: input dtype {x.dtype} differs from the weight's {weight.dtype}")
    if x.device != weight.device:
        what = ("the oneDNN-packed weight" if isinstance(weight, PackedLinearWeight) else
                "the packed weight" if isinstance(weight, KernelWeight) else "the weight")
        raise ValueError(f"linear: input is on {x.device}, {what} on {weight.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (N,):
            raise ValueError(f"linear: bias must be a [{N}] tensor, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if bias.dtype != x.dtype or bias.device != x.device:
            raise TypeError(f"linear: bias is {bias.dtype} on {bias.device}, the input {x.dtype} on {x.device}")


def linear(x: torch.Tensor, weight: Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x·Wᵀ + b on the backend ``weight`` was prepared for (module docstring).

    x [..., K] (any strides), weight [N, K] dense, ``PackedLinearWeight`` or ``KernelWeight``,
    bias [N] or None, all one dtype and device -> y [..., N]. Bad input is a TypeError/ValueError
    naming it.
    """
    _check(x, weight, bias)
    if isinstance(weight, KernelWeight):
        return weight.linear_forward(x, bias)
    if isinstance(weight, PackedLinearWeight):
        return inference_only("linear (oneDNN-packed weight)", "linear with the dense weight (F.linear) or linear_ref",
                              (x, bias), lambda: linear_onednn_op(x, weight.packed, bias, weight.out_features))
    return F.linear(x, weight, bias)
