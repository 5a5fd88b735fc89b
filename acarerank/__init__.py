"""acarerank: prefix-shared kernels and a thin API for Qwen3 LLM rerankers.

Pointwise (ACARe / Qwen3-Reranker): ``PointwiseReranker``.
"""
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing acarerank.ops must not pull in transformers
    if name == "PointwiseReranker":
        from .pointwise import PointwiseReranker
        return PointwiseReranker
    raise AttributeError(f"module 'acarerank' has no attribute {name!r}")
