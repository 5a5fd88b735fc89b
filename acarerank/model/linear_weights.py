"""The runner's four layer matrices in the form its linear backend reads (docs/ARCHITECTURE.md, "Linear layers").

Per layer ``w_qkv``, ``w_o``, ``w_gate_up``, ``w_down`` are dense [N, K] tensors for the "torch"
linear backend and ``PackedLinearWeight`` (reordered once for oneDNN) for "onednn" — except
``w_gate_up`` where the MLP's gate/up projection runs the "native" backend of ``gate_up_silu``
(AMX tiles, SiLU·up fused): a ``PackedGateUpWeight`` then, whatever the linear backend. The norms,
biases, embedding and heads always stay dense. One copy per matrix: a packed matrix replaces the
dense one, it is never held beside it.

    weights_for_linear(weights, backend, gate_up="torch")   a Qwen3Weights in that form; ``weights``
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
from ..ops.linear import PackedLinearWeight, prepare_linear_weight
from .weights import Qwen3Weights

LINEAR_FIELDS = ("w_qkv", "w_o", "w_gate_up", "w_down")


def _fused_gate_up(field: str, gate_up: str) -> bool:
    return field == "w_gate_up" and gate_up == "native"


def _in_form(w, field: str, backend: str, gate_up: str) -> bool:
    if _fused_gate_up(field, gate_up):
        return isinstance(w, PackedGateUpWeight)
    return not isinstance(w, PackedGateUpWeight) and isinstance(w, PackedLinearWeight) == (backend == "onednn")


def _prepare(w, field: str, backend: str, gate_up: str):
    if _fused_gate_up(field, gate_up):
        return prepare_gate_up_weight(w, "native")
    return prepare_linear_weight(w, backend)


def linear_form_matches(weights: Qwen3Weights, backend: str, gate_up: str = "torch") -> bool:
    """Whether every layer matrix is already in the form ``backend`` (and, for ``w_gate_up``,
    ``gate_up``: the gate_up_silu backend) reads."""
    return all(_in_form(getattr(L, f), f, backend, gate_up) for L in weights.layers for f in LINEAR_FIELDS)


def weights_for_linear(weights: Qwen3Weights, backend: str, in_place: bool = False,
                       gate_up: str = "torch") -> Qwen3Weights:
    """``weights`` with its layer matrices in ``backend``'s form, ``w_gate_up`` in the form of
    gate_up_silu's backend ``gate_up`` (module docstring)."""
    if linear_form_matches(weights, backend, gate_up):
        return weights
    if in_place:
        for L in weights.layers:
            for f in LINEAR_FIELDS:
                setattr(L, f, _prepare(getattr(L, f), f, backend, gate_up))  # the dense one is dropped here
        return weights
    layers = [dataclasses.replace(L, **{f: _prepare(getattr(L, f), f, backend, gate_up) for f in LINEAR_FIELDS})
              for L in weights.layers]
    return dataclasses.replace(weights, layers=layers)

