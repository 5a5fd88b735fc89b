"""One function per op; each picks its backend once per call (see ``_backend``).

Every op has a plain PyTorch ``*_ref`` beside it: the test oracle.
"""
from ._backend import BackendError, KNOWN_BACKENDS
from .attention import prefix_shared_attention, prefix_shared_attention_ref
from .yes_no import yes_no_score, yes_no_score_ref
from .merge_states import merge_attention_states, merge_attention_states_ref
from .topk_merge import (TopKMergeState, TopKResult, topk_merge_finalize, topk_merge_init, topk_merge_ref,
                         topk_merge_update)
from .topk_logprobs import TopKLogprobs, topk_logprobs, topk_logprobs_ref
from .linear_logprob import linear_logprob, linear_logprob_ref
from .vocab_parallel import VocabShard
from ._library import prefix_shared_attention_op, yes_no_score_op  # torch.ops.acarerank.*

__all__ = [
    "BackendError", "KNOWN_BACKENDS",
    "prefix_shared_attention", "prefix_shared_attention_ref",
    "yes_no_score", "yes_no_score_ref",
    "merge_attention_states", "merge_attention_states_ref",
    "TopKMergeState", "TopKResult", "topk_merge_init", "topk_merge_update", "topk_merge_finalize", "topk_merge_ref",
    "TopKLogprobs", "topk_logprobs", "topk_logprobs_ref", "linear_logprob", "linear_logprob_ref", "VocabShard",
    "prefix_shared_attention_op", "yes_no_score_op",
]
