"""``torch.library`` registration of the public ops, so they are opaque to ``torch.compile``.

    torch.ops.acarerank.prefix_shared_attention(q, k, v, cu_seqlens, prefix_k, prefix_v,
                                                cu_prefix_lens, segment_group, softmax_scale, backend) -> out
    torch.ops.acarerank.yes_no_score(hidden_last, norm_weight, w_yes, w_no, eps, backend) -> (score, logit_diff)

``backend`` is the name already resolved by the public function (argument > environment >
device default, ``_backend.resolve``): the op itself never reads the environment, so a
compiled graph does not silently change backend. The implementation looks the name up in
the op module's ``IMPLEMENTATIONS`` table at run time (lazy imports).

The fake (meta) functions give the output shapes/dtypes from the inputs alone: attention
returns q's shape and dtype; the head returns two fp32 vectors of length S.

Inference only: no autograd formula is registered (calling backward through these ops
raises); training code that needs gradients uses the torch references.
"""
from __future__ import annotations

import torch

from . import attention as _attention
from . import yes_no as _yes_no


@torch.library.custom_op("acarerank::prefix_shared_attention", mutates_args=())
def prefix_shared_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               prefix_k: torch.Tensor, prefix_v: torch.Tensor, cu_prefix_lens: torch.Tensor,
                               segment_group: torch.Tensor, softmax_scale: float, backend: str) -> torch.Tensor:
    fn = _attention.IMPLEMENTATIONS[backend]()
    return fn(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, softmax_scale)


@prefix_shared_attention_op.register_fake
def _(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, softmax_scale, backend):
    return torch.empty_like(q)


@torch.library.custom_op("acarerank::yes_no_score", mutates_args=())
def yes_no_score_op(hidden_last: torch.Tensor, norm_weight: torch.Tensor, w_yes: torch.Tensor, w_no: torch.Tensor,
                    eps: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    fn = _yes_no.IMPLEMENTATIONS[backend]()
    return fn(hidden_last, norm_weight, w_yes, w_no, eps)


@yes_no_score_op.register_fake
def _(hidden_last, norm_weight, w_yes, w_no, eps, backend):
    S = hidden_last.shape[0]
    return (hidden_last.new_empty(S, dtype=torch.float32), hidden_last.new_empty(S, dtype=torch.float32))


__all__ = ["prefix_shared_attention_op", "yes_no_score_op"]
