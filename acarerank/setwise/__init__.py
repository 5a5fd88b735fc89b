"""Setwise reranking ("AdaTutoRank: Learning to Rerank Document Sets via Adaptive Tutoring
Optimization for RAG and Deep Research", 2026): exact prompts, identifier grammar, KV-cached greedy decoding.

``SetwiseReranker`` / ``Selection`` are the public API; ``prompts``, ``grammar`` and
``decode`` are its parts (also used by benchmarks and training code).
"""
from .grammar import GrammarState, IdentifierGrammar, IdentifierTokens
from .reranker import Selection, SetwiseReranker

__all__ = ["GrammarState", "IdentifierGrammar", "IdentifierTokens", "Selection", "SetwiseReranker"]
