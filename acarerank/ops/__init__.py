"""One function per op; each picks its backend once per call (see ``_backend``).

Every op has a plain PyTorch ``*_ref`` beside it: the test oracle.
"""
from ._backend import BackendError, KNOWN_BACKENDS
from .attention import prefix_shared_attention, prefix_shared_attention_ref
from .yes_no import yes_no_score, yes_no_score_ref
from ._library import prefix_shared_attention_op, yes_no_score_op  # torch.ops.acarerank.*

__all__ = [
    "BackendError", "KNOWN_BACKENDS",
    "prefix_shared_attention", "prefix_shared_attention_ref",
    "yes_no_score", "yes_no_score_ref",
    "prefix_shared_attention_op", "yes_no_score_op",
]
