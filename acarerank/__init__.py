"""acarerank: prefix-shared kernels and a thin API for Qwen3 LLM rerankers.

- ``PointwiseReranker`` — ACARe / Qwen3-Reranker yes/no scoring, agent context computed once.
- ``SetwiseReranker`` — AdaTutoRank bracketed-identifier selection, grammar-constrained decoding.
- ``acarerank.ato`` — ATO re-scoring ops for training code.
- ``acarerank.ops`` — the ops (torch / triton / cpp / cuda backends).
"""
from ._onednn_env import bound_onednn_caches

bound_onednn_caches()   # before anything runs a oneDNN op (acarerank/_onednn_env.py)

__version__ = "0.1.0"

_LAZY = {"PointwiseReranker": "pointwise", "ScoreRequest": "pointwise", "PrefixHandle": "pointwise", "SetwiseReranker": "setwise",
         "Selection": "setwise", "ForkedThreadPoolError": "_fork"}


def __getattr__(name):  # lazy: importing acarerank.ops must not pull in transformers
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"acarerank.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'acarerank' has no attribute {name!r}")
