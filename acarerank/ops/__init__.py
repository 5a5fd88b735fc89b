"""The ops: one module per op, each declaring itself once (input check, ``*_ref`` oracle, fake
impl, backends by device, ``torch.library`` registration) — docs/ARCHITECTURE.md, "Ops".

Backend choice (``_backend``): an op's ``backend=`` takes a name or a per-op mapping;
``backend_for`` / ``per_op_backends`` map one preference (a name, or
``{"attention": "triton", "yes_no": "cuda"}``) to each op; ``available_backends(op, device)``
lists what runs here. Importing this package registers ``torch.ops.acarerank.*``.
"""
from ._backend import (KNOWN_BACKENDS, BackendError, BackendLimitError, available_backends, backend_choice, backend_for,
                       parse_preference, per_op_backends, triton_interpreted)
from ._checks import InferenceOnlyError
from .attention import (AttentionPlan, plan_prefix_shared_attention, prefix_shared_attention,
                        prefix_shared_attention_op, prefix_shared_attention_ref)
from .yes_no import yes_no_score, yes_no_score_op, yes_no_score_ref
from .paged_attention import (PagedAttentionPlan, plan_prefix_shared_attention_paged, prefix_shared_attention_paged,
                              prefix_shared_attention_paged_op, prefix_shared_attention_paged_ref)
from .merge_states import merge_attention_states, merge_attention_states_op, merge_attention_states_ref
from ..topk_contract import MAX_K, TopKLogprobs, finalize
from .topk_merge import (TopKMergeState, topk_merge_core, topk_merge_finalize, topk_merge_init, topk_merge_update,
                         topk_merge_update_op)
from .topk_logprobs import topk_logprobs, topk_logprobs_core, topk_logprobs_core_op, topk_logprobs_ref
from .linear_logprob import linear_logprob, linear_logprob_op, linear_logprob_ref
from .vocab_parallel import VocabShard  # also registers the process_group= paths (_backend)
from .rms_norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_ref
from .silu_and_mul import silu_and_mul, silu_and_mul_ref
from .linear import PackedLinearWeight, linear, linear_ref, prepare_linear_weight
from .gate_up_silu import PackedGateUpWeight, gate_up_silu, gate_up_silu_ref, prepare_gate_up_weight

__all__ = [
    "BackendError", "BackendLimitError", "InferenceOnlyError", "KNOWN_BACKENDS", "available_backends", "backend_choice", "backend_for",
    "parse_preference",
    "per_op_backends", "triton_interpreted",
    "AttentionPlan", "plan_prefix_shared_attention", "prefix_shared_attention", "prefix_shared_attention_op",
    "prefix_shared_attention_ref",
    "yes_no_score", "yes_no_score_op", "yes_no_score_ref",
    "PagedAttentionPlan", "plan_prefix_shared_attention_paged", "prefix_shared_attention_paged",
    "prefix_shared_attention_paged_op", "prefix_shared_attention_paged_ref",
    "merge_attention_states", "merge_attention_states_op", "merge_attention_states_ref",
    "MAX_K", "TopKLogprobs", "TopKMergeState", "finalize", "topk_merge_core", "topk_merge_finalize",
    "topk_merge_init", "topk_merge_update", "topk_merge_update_op",
    "topk_logprobs", "topk_logprobs_core", "topk_logprobs_core_op", "topk_logprobs_ref",
    "linear_logprob", "linear_logprob_op", "linear_logprob_ref", "VocabShard",
    "rms_norm", "rms_norm_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref", "qk_norm_rope", "qk_norm_rope_ref",
    "silu_and_mul", "silu_and_mul_ref", "linear", "linear_ref", "prepare_linear_weight", "PackedLinearWeight",
    "gate_up_silu", "gate_up_silu_ref", "prepare_gate_up_weight", "PackedGateUpWeight",
]
