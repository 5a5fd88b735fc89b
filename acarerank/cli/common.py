"""What the ``score`` and ``select`` subcommands share: reading documents, loading a model."""
from __future__ import annotations

import json
import sys


def read_documents(path: str) -> list:
    """Documents from JSONL ('-' = stdin): objects with a string "text" (kept whole, for pass-through) or strings."""
    f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    docs = []
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if isinstance(item, dict):
                if not isinstance(item.get("text"), str):
                    raise ValueError(f"{path}:{n}: a JSON object needs a string field 'text'")
            elif not isinstance(item, str):
                raise ValueError(f"{path}:{n}: expected a JSON object with 'text' or a JSON string")
            docs.append(item)
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def load_reranker(cls, args, **kw):
    """``cls`` (PointwiseReranker or SetwiseReranker) as the flags ask: ``--model`` folder, or the
    embedded random default with a note on stderr that its output carries no meaning. ``kw``: more
    constructor arguments."""
    from ..hardware import resolve_dtype
    from ..ops import parse_preference

    dtype, why = resolve_dtype(args.dtype, args.device)
    print(f"dtype: {str(dtype).replace('torch.', '')} ({why})", file=sys.stderr)
    backend = parse_preference(args.backend, "--backend")  # "triton" or "attention=triton,yes_no=cuda"
    if args.model:
        return cls.from_pretrained(args.model, dtype=dtype, device=args.device, max_length=args.max_length,
                                   backend=backend, **kw)
    from ..model.default import DEFAULT_PRESET, NO_MEANING, build_default_model

    print(NO_MEANING.format(preset=DEFAULT_PRESET), file=sys.stderr)
    model = build_default_model(dtype=dtype, device=args.device)
    return cls(model=model, max_length=args.max_length, backend=backend, **kw)
