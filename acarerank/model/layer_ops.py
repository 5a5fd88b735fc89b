"""The runner's decoder layers around attention, as the element-wise ops or as torch.compile'd halves.

``OpsLayers`` (the default) runs each layer through the ops of ``acarerank.ops`` with their
backends resolved once per pass (the native CPU kernels when ``acarerank._cpu`` is built, the
torch references otherwise), carrying the residual stream between layers as vLLM does, so every
residual add is fused into the norm after it:

    layer 0:  h = rms_norm(x)                                   residual = x
    layer i:  h = fused_add_rms_norm(delta, residual)           residual += delta
              q, k, v = qk_norm_rope(h·W_qkvᵀ + b, q_norm, k_norm, cos, sin)   (+ k, v into their pages)
              ... attention (the runner) ...
              h = fused_add_rms_norm(attn·W_oᵀ + b_o, residual)  residual += attn·W_oᵀ + b_o
              delta = silu_and_mul(h·W_guᵀ)·W_downᵀ       (one gate_up_silu where W_gu is packed for it)
    end:      x = residual + delta

With the torch backends this is bitwise the eager layer of ``layer_blocks`` (transformers'
order: the same adds, norms and casts, in the same order). The native kernels compute each
element-wise step in fp32 and round once, read the fp32 RoPE tables as they are (no cast per
pass) and never make an fp32 copy of the activations.

``CompiledLayers`` is ``layer_blocks.compiled()`` (inductor fuses the element-wise work) behind
the same interface: ``Qwen3Runner(compile_layers=True)``.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..ops import backend_choice
from ..ops._native_backend import resolve_elementwise
from ..ops.gate_up_silu import PackedGateUpWeight, gate_up_silu
from ..ops.qk_norm_rope import OP as QK_NORM_ROPE
from ..ops.rms_norm import OP_FUSED_ADD, OP_RMS_NORM
from ..ops.silu_and_mul import OP as SILU_AND_MUL
from . import layer_blocks


def resolve_layer_backends(preference, device: torch.device, dtype: torch.dtype, head_dim: int) -> dict:
    """{op name: backend} for the layer's element-wise ops on ``dtype`` activations and heads of
    ``head_dim`` under a backend preference (the native kernels run float32 and bfloat16, and
    qk_norm_rope's heads up to 512: past either, the default is "torch")."""
    decls = (OP_RMS_NORM, OP_FUSED_ADD, QK_NORM_ROPE, SILU_AND_MUL)
    return {d.name: resolve_elementwise(d, backend_choice(d.name, preference), device, dtype,
                                        head_dim if d is QK_NORM_ROPE else None) for d in decls}


class OpsLayers:
    """One pass's layers through the element-wise ops (module docstring); holds the residual stream."""

    def __init__(self, backends: dict, arch, linear: Callable, cos: torch.Tensor, sin: torch.Tensor,
                 dtype: torch.dtype):
        """backends: ``resolve_layer_backends``; cos, sin: fp32 [T, d] RoPE tables of the pass."""
        self.backends = backends
        self.norm = OP_RMS_NORM.impl(backends["rms_norm"])
        self.add_norm = OP_FUSED_ADD.impl(backends["fused_add_rms_norm"])
        self.rope = QK_NORM_ROPE.impl(backends["qk_norm_rope"])
        self.silu_mul = SILU_AND_MUL.impl(backends["silu_and_mul"])
        if backends["qk_norm_rope"] != "native":  # transformers' order takes the tables in the dtype
            cos, sin = cos.to(dtype), sin.to(dtype)
        self.cos, self.sin = cos, sin
        self.a, self.linear = arch, linear
        self.residual = self.delta = None

    @property
    def writes_pages(self) -> bool:
        """Whether ``attn_in`` takes the pages: the native kernel stores the new k, v rows there in
        its own pass; on the torch references the runner's ``PagedKVCache.write`` does."""
        return self.backends["qk_norm_rope"] == "native"

    def begin(self, x: torch.Tensor) -> None:
        """x [T, H]: the embeddings (a tensor of the pass's own: it becomes the residual stream)."""
        self.residual, self.delta = x, None

    def attn_in(self, L, pages=None):
        """q, k, v of layer ``L``; ``pages`` = (k_cache, v_cache, slots): k, v are also written
        there (only when ``writes_pages``)."""
        a = self.a
        eps = a.rms_norm_eps
        h = (self.norm(self.residual, L.input_norm, eps) if self.delta is None
             else self.add_norm(self.delta, self.residual, L.input_norm, eps))
        qkv = self.linear(h, L.w_qkv, L.b_qkv)
        k_cache, v_cache, slots = pages if pages is not None else (None, None, None)
        return self.rope(qkv, L.q_norm, L.k_norm, self.cos, self.sin, a.num_heads, a.num_kv_heads, eps,
                         k_cache=k_cache, v_cache=v_cache, slots=slots)

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` of the residual stream (the last layer's asked-for rows)."""
        self.residual = self.residual[rows]

    def attn_out_mlp(self, attn: torch.Tensor, L) -> None:
        eps = self.a.rms_norm_eps
        h = self.add_norm(self.linear(attn, L.w_o, L.b_o), self.residual, L.post_norm, eps)
        w = L.w_gate_up
        # the AMX kernel's sums do not depend on the row count: no fixed tiles needed (batch-invariant)
        act = gate_up_silu(h, w) if isinstance(w, PackedGateUpWeight) else self.silu_mul(self.linear(h, w))
        self.delta = self.linear(act, L.w_down)

    def end(self) -> torch.Tensor:
        return self.residual if self.delta is None else self.residual.add_(self.delta)


class CompiledLayers:
    """``layer_blocks.compiled()`` behind ``OpsLayers``' interface (compile_layers=True)."""

    def __init__(self, arch, linear: Callable, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype):
        self.attn_in_fn, self.attn_out_mlp_fn = layer_blocks.compiled()
        self.cos, self.sin = cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]
        self.a, self.linear = arch, linear
        self.x = None
        self.writes_pages = False  # the runner writes the new rows (PagedKVCache.write)

    def begin(self, x: torch.Tensor) -> None:
        self.x = x

    def attn_in(self, L, pages=None):
        if pages is not None:
            raise ValueError("CompiledLayers does not write pages (writes_pages is False): the runner does")
        a = self.a
        return self.attn_in_fn(self.x, L.input_norm, L.w_qkv, L.b_qkv, L.q_norm, L.k_norm, self.cos, self.sin,
                               a.num_heads, a.num_kv_heads, a.head_dim, a.rms_norm_eps, linear=self.linear)

    def select(self, rows: torch.Tensor) -> None:
        self.x = self.x[rows]

    def attn_out_mlp(self, attn: torch.Tensor, L) -> None:
        self.x = self.attn_out_mlp_fn(self.x, attn, L.w_o, L.post_norm, L.w_gate_up, L.w_down, self.a.rms_norm_eps,
                                      linear=self.linear, b_o=L.b_o)

    def end(self) -> torch.Tensor:
        return self.x
