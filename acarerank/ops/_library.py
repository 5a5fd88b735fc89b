"""``torch.library`` registration of the public ops, so they are opaque to ``torch.compile``.

    torch.ops.acarerank.prefix_shared_attention(q, k, v, cu_seqlens, prefix_k, prefix_v,
                                                cu_prefix_lens, segment_group, softmax_scale, backend) -> out
    torch.ops.acarerank.yes_no_score(hidden_last, norm_weight, w_yes, w_no, eps, backend) -> (score, logit_diff)
    torch.ops.acarerank.topk_logprobs_core(hidden, weight, targets, k, chunk, temperature, backend)
        -> (topk_logits, topk_ids, target_logit, logsumexp)

``backend`` is the name already resolved by the public function (argument > environment >
device default, ``_backend.resolve``): the op itself never reads the environment, so a
compiled graph does not silently change backend. The implementation looks the name up in
the op module's ``IMPLEMENTATIONS`` table at run time (lazy imports).

The fake (meta) functions give the output shapes/dtypes from the inputs alone: attention
returns q's shape and dtype; the head returns two fp32 vectors of length S; the top-k core
returns [T, k] fp32 / int64 and two fp32 vectors of length T.

Inference only: no autograd formula is registered (calling backward through these ops
raises); training code that needs gradients uses the torch references.
"""
from __future__ import annotations

import torch

from . import attention as _attention
from . import yes_no as _yes_no
# the module, not the function of the same name that acarerank.ops re-exports
from .topk_logprobs import IMPLEMENTATIONS as _TOPK_IMPLEMENTATIONS


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


@torch.library.custom_op("acarerank::topk_logprobs_core", mutates_args=())
def topk_logprobs_core_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, k: int, chunk: int,
                          temperature: float, backend: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(topk_logits [T,k] fp32, topk_ids [T,k] int64, target_logit [T] fp32, logsumexp [T] fp32); chunk 0 = default."""
    fn = _TOPK_IMPLEMENTATIONS[backend]()
    return tuple(fn(hidden, weight, targets, k, chunk or None, temperature))


@topk_logprobs_core_op.register_fake
def _(hidden, weight, targets, k, chunk, temperature, backend):
    T = hidden.shape[0]
    return (hidden.new_empty(T, k, dtype=torch.float32), hidden.new_empty(T, k, dtype=torch.int64),
            hidden.new_empty(T, dtype=torch.float32), hidden.new_empty(T, dtype=torch.float32))


__all__ = ["prefix_shared_attention_op", "yes_no_score_op", "topk_logprobs_core_op"]
