"""The runner's four layer matrices in the form its linear backend reads (docs/ARCHITECTURE.md, "Linear layers").

Per layer ``w_qkv``, ``w_o``, ``w_gate_up``, ``w_down`` are dense [N, K] tensors for the "torch"
linear backend and ``PackedLinearWeight`` (reordered once for oneDNN) for "onednn" — except the
``fused`` fields, packed for an AMX GEMM of ours with its epilogue whatever the linear backend:
``w_gate_up`` as a ``PackedGateUpWeight`` (``gate_up_silu``'s "native" backend: SiLU·up fused). The norms,
biases, embedding and heads always stay dense. One copy per matrix: a packed matrix replaces the
dense one, it is never held beside it.

    weights_for_linear(weights, backend, fused=())       a Qwen3Weights in that form; ``weights``
                                                         untouched (shared as is when already in it)
    weights_for_linear(..., in_place=True)               converts ``weights``' own LayerWeights,
                                                         one matrix at a time, so each dense matrix
                                                         is freed as soon as its packed form exists
                                                         (peak: the model + one matrix)

``in_place`` is for weights nobody else holds (``Qwen3Runner.from_pretrained`` / ``from_hf`` build
theirs); the tensors themselves are never modified, so a transformers model whose o_proj/down_proj
tensors the LayerWeights shared keeps them intact.
"""
from __future__ import annotations

import dataclasses

from ..ops.gate_up_silu import PackedGateUpWeight, prepare_gate_up_weight
from ..ops.linear import KernelWeight, PackedLinearWeight, prepare_linear_weight
from .weights import Qwen3Weights

LINEAR_FIELDS = ("w_qkv", "w_o", "w_gate_up", "w_down")
#: the fields an AMX kernel of ours may take, with its packed form and how to pack for it
FUSED_FORMS = {"w_gate_up": (PackedGateUpWeight, prepare_gate_up_weight)}


def _in_form(w, field: str, backend: str, fused) -> bool:
    if field in fused:
        return isinstance(w, FUSED_FORMS[field][0])
    return not isinstance(w, KernelWeight) and isinstance(w, PackedLinearWeight) == (backend == "onednn")


def _prepare(w, field: str, backend: str, fused):
    if field in fused:
        return FUSED_FORMS[field][1](w, "native")
    return prepare_linear_weight(w, backend)


def linear_form_matches(weights: Qwen3Weights, backend: str, fused=()) -> bool:
    """Whether every layer matrix is already in the form ``backend`` reads (the ``fused`` fields:
    their AMX kernel's)."""
    return all(_in_form(getattr(L, f), f, backend, fused) for L in weights.layers for f in LINEAR_FIELDS)


def weights_for_linear(weights: Qwen3Weights, backend: str, in_place: bool = False, fused=()) -> Qwen3Weights:
    """``weights`` with its layer matrices in ``backend``'s form, the ``fused`` fields (a subset of
    ``FUSED_FORMS``) packed for their AMX kernels (module docstring)."""
    unknown = set(fused) - set(FUSED_FORMS)
    if unknown:
        raise ValueError(f"weights_for_linear: no fused form for {sorted(unknown)}; known: {sorted(FUSED_FORMS)}")
    if linear_form_matches(weights, backend, fused):
        return weights
    if in_place:
        for L in weights.layers:
            for f in LINEAR_FIELDS:
                setattr(L, f, _prepare(getattr(L, f), f, backend, fused))  # the dense one is dropped here
        return weights
    layers = [dataclasses.replace(L, **{f: _prepare(getattr(L, f), f, backend, fused) for f in LINEAR_FIELDS})
              for L in weights.layers]
    return dataclasses.replace(weights, layers=layers)
