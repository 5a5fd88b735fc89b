"""Exact prompt strings, ACARe context modes, the token-safe split and truncation.

``pointwise``: Qwen3-Reranker strings, :class:`ContextTemplate` (modes M1–M3),
:func:`encode_pointwise` (shared ids + per-document segments).
``truncation``: the cut rules (trace oldest-first, documents from their end).
``official``: the Qwen3-Reranker model card's own construction and scoring (test oracle,
benchmark baseline).
"""
from .official import (joint_input_ids, left_pad, official_batch_input_ids, official_format_instruction,
                       official_input_ids, official_scores)
from .pointwise import (DEFAULT_INSTRUCTION, DEFAULT_MAX_LENGTH, DEFAULT_TEMPLATE, MODES, QWEN3_RERANKER_BODY,
                        QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX, ContextTemplate, PointwiseEncoding, body_text,
                        context_mode, encode_pointwise, full_prompt_text)
from .truncation import DEFAULT_MIN_DOC_TOKENS

__all__ = [
    "QWEN3_RERANKER_PREFIX", "QWEN3_RERANKER_SUFFIX", "QWEN3_RERANKER_BODY", "DEFAULT_INSTRUCTION",
    "DEFAULT_MAX_LENGTH", "DEFAULT_MIN_DOC_TOKENS", "MODES", "ContextTemplate", "DEFAULT_TEMPLATE",
    "context_mode", "encode_pointwise", "PointwiseEncoding", "body_text", "full_prompt_text",
    "official_input_ids", "official_batch_input_ids", "official_format_instruction", "joint_input_ids",
    "official_scores", "left_pad",
]
