"""Adaptive Tutoring Optimization (ATO) of "AdaTutoRank: Learning to Rerank Document Sets via
Adaptive Tutoring Optimization for RAG and Deep Research" (2026), §3.4, Appendix A, C.1, C.4:
the pieces training code imports.

    rewards     parse_selection (Eq. 2, from acarerank.setwise.selection), rubric_reward (Eq. 4–6)
    hints       route_hints (Eq. 8, Algorithm 1 lines 20–35), hint_text (Fig. 3)
    rollouts    sample_rollouts (Algorithm 1 line 7): G samples of π_old per prompt, prompt computed once
    re-scoring  rescore (Algorithm 1 line 39, Eq. 9): logp_old, top-128 truncated logp_teacher, atd
    advantages  grpo_advantage (Eq. 7), ato_advantage (Eq. 10 with the format mask)
    loss        clipped_policy_loss (Eq. 11–12), with verl's aggregation modes

The ops underneath (``acarerank.ops``): ``topk_logprobs`` (teacher truncation without [T, V]
logits) and ``linear_logprob`` (policy log-probs with a chunked backward).
"""
from ..ops.linear_logprob import linear_logprob
from ..ops.topk_logprobs import topk_logprobs
from ..setwise.selection import ParsedSelection, parse_selection
from .advantages import ato_advantage, grpo_advantage
from .hints import (HINT_KINDS, HINT_REFLECTION, HINT_RUBRIC, HINT_SIBLING, format_rubrics, hint_ids, hint_text,
                    route_hints)
from .loss import AGG_MODES, agg_loss, clipped_policy_loss
from .rescore import RescoreQuery, RescoreResult, rescore, split_student_prompt
from .rollouts import Rollouts, sample_rollouts
from .reward import MALFORMED_REWARD, JudgeOutputError, rubric_reward

__all__ = [
    "parse_selection", "ParsedSelection", "rubric_reward", "JudgeOutputError", "MALFORMED_REWARD",
    "route_hints", "hint_text", "hint_ids", "format_rubrics", "HINT_KINDS", "HINT_RUBRIC", "HINT_REFLECTION",
    "HINT_SIBLING",
    "sample_rollouts", "Rollouts",
    "rescore", "RescoreQuery", "RescoreResult", "split_student_prompt",
    "grpo_advantage", "ato_advantage", "clipped_policy_loss", "agg_loss", "AGG_MODES",
    "topk_logprobs", "linear_logprob",
]
