"""One way to build a reranker from user-facing options, shared by the command line and the
server: the dtype resolved from the CPU's flags when ``"auto"`` (said on stderr), the backend
preference parsed (``"triton"`` or ``"attention=triton,yes_no=cuda"``), and either a checkpoint
folder or the embedded random default (with a note that its output carries no meaning)."""
from __future__ import annotations

import sys


def load_reranker(cls, *, model, dtype, device, backend, flag: str = "--backend", **kw):
    """``cls`` (PointwiseReranker or SetwiseReranker) on ``model`` (a folder, or None for the
    embedded default); ``kw``: more constructor arguments (``max_length``, ...)."""
    from .hardware import resolve_dtype
    from .ops import parse_preference

    torch_dtype, why = resolve_dtype(dtype, device)
    print(f"dtype: {str(torch_dtype).replace('torch.', '')} ({why})", file=sys.stderr)
    preference = parse_preference(backend, flag)
    if model:
        return cls.from_pretrained(model, dtype=torch_dtype, device=device, backend=preference, **kw)
    from .model.default import DEFAULT_PRESET, NO_MEANING, build_default_model

    print(NO_MEANING.format(preset=DEFAULT_PRESET), file=sys.stderr)
    return cls(model=build_default_model(dtype=torch_dtype, device=device), backend=preference, **kw)
