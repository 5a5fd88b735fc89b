"""The runner's four layer matrices in the form its linear backend reads (docs/ARCHITECTURE.md, "Linear layers").

Per layer ``w_qkv``, ``w_o``, ``w_gate_up``, ``w_down`` are dense [N, K] tensors for the "torch"
linear backend and ``PackedLinearWeight`` (reordered once for oneDNN) for "onednn"; the norms,
biases, embedding and heads always stay dense. One copy per matrix: a packed matrix replaces the
dense one, it is never held beside it.

    weights_for_linear(weights, backend)                 a Qwen3Weights in that form; ``weights``
                                                         untouched (shared as is when already in it)
    weights_for_linear(weights, backend, in_place=True)  converts ``weights``' own LayerWeights,
                                                         one matrix at a time, so each dense matrix
                                                         is freed as soon as its packed form exists
                                                         (peak: the model + one matrix)

``in_place`` is for weights nobody else holds (``Qwen3Runner.from_pretrained`` / ``from_hf`` build
theirs); the tensors themselves are never modified, so a transformers model whose o_proj/down_proj
tensors the LayerWeights shared keeps them intact.
"""
from __future__ import annotations

import dataclasses

from ..ops.linear import PackedLinearWeight, prepare_linear_weight
from .weights import Qwen3Weights

LINEAR_FIELDS = ("w_qkv", "w_o", "w_gate_up", "w_down")


def _in_form(w, backend: str) -> bool:
    return isinstance(w, PackedLinearWeight) == (backend == "onednn")


def linear_form_matches(weights: Qwen3Weights, backend: str) -> bool:
    """Whether every layer matrix is already in ``backend``'s form."""
    return all(_in_form(getattr(L, f), backend) for L in weights.layers for f in LINEAR_FIELDS)


def weights_for_linear(weights: Qwen3Weights, backend: str, in_place: bool = False) -> Qwen3Weights:
    """``weights`` with its layer matrices in ``backend``'s form (module docstring)."""
    if linear_form_matches(weights, backend):
        return weights
    if in_place:
        for L in weights.layers:
            for f in LINEAR_FIELDS:
                setattr(L, f, prepare_linear_weight(getattr(L, f), backend))  # the dense one is dropped here
        return weights
    layers = [dataclasses.replace(L, **{f: prepare_linear_weight(getattr(L, f), backend) for f in LINEAR_FIELDS})
              for L in weights.layers]
    return dataclasses.replace(weights, layers=layers)

