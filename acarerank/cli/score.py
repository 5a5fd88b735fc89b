"""``acarerank score``: pointwise scores of a JSONL document file, JSON lines out.

Input lines are JSON objects with a "text" field (other fields are passed through) or
plain JSON strings. Output: one JSON object per document, in input order unless --top-n
is given (then best first): {"index", "score", ...passed-through fields}.
"""
from __future__ import annotations

import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("score", help="score documents against a query (ACARe / Qwen3-Reranker)")
    p.add_argument("--model", help="local HF checkpoint folder; omitted: the embedded random default (scores mean nothing)")
    p.add_argument("--query", required=True, help="the (sub-)query")
    p.add_argument("--docs", required=True, help="JSONL file of documents ('-' for stdin)")
    p.add_argument("--question", help="the agent's original question (ACARe modes M2/M3)")
    p.add_argument("--trace-file", help="file holding the agent's reasoning trace (ACARe modes M1/M3)")
    p.add_argument("--instruction", help="override the default instruction")
    p.add_argument("--top-n", type=int, help="print only the best N, best first")
    p.add_argument("--max-length", type=int, default=8192)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", help="torch | triton | cpp | cuda (default: by device)")
    p.set_defaults(run=run)


def read_documents(path: str) -> list:
    """Documents from JSONL: objects with "text" (kept whole, for pass-through) or strings."""
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


def load_pointwise(args):
    """The reranker the flags ask for; the embedded default (with a stderr note) without --model."""
    import torch

    from ..pointwise import PointwiseReranker

    dtype = getattr(torch, args.dtype)
    if args.model:
        return PointwiseReranker.from_pretrained(args.model, dtype=dtype, device=args.device,
                                                 max_length=args.max_length, backend=args.backend)
    from ..model.default import DEFAULT_PRESET, NO_MEANING, build_default_model

    print(NO_MEANING.format(preset=DEFAULT_PRESET), file=sys.stderr)
    model = build_default_model(dtype=dtype, device=args.device)
    return PointwiseReranker(model=model, max_length=args.max_length, backend=args.backend)


def run(args) -> int:
    docs = read_documents(args.docs)
    trace = None
    if args.trace_file:
        with open(args.trace_file, encoding="utf-8") as f:
            trace = f.read()
    rr = load_pointwise(args)
    texts = [d["text"] if isinstance(d, dict) else d for d in docs]
    ranked = rr.rerank(args.query, texts, top_n=args.top_n, question=args.question, trace=trace,
                       instruction=args.instruction)
    if args.top_n is None:
        ranked.sort()  # input order
    for i, s in ranked:
        extra = {k: v for k, v in docs[i].items() if k not in ("index", "score")} if isinstance(docs[i], dict) else {}
        print(json.dumps({"index": i, "score": s, **extra}, ensure_ascii=False))
    return 0
