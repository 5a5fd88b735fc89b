"""``acarerank score``: pointwise scores of a JSONL document file, JSON lines out.

Input lines are JSON objects with a "text" field (other fields are passed through) or
plain JSON strings. Output: one JSON object per document, in input order unless --top-n
is given (then best first): {"index", "score", "text", ...passed-through fields} (as ``select``).
Every failure is one line on stderr (exit 2: bad usage/input, 1: runtime); flags and files are
checked before the model loads.
"""
from __future__ import annotations

import sys

from . import SUBCOMMANDS
from .common import (MAX_DOCUMENTS, add_model_flags, load_reranker, note_replaced_fields, print_results,
                     read_documents)


def add_parser(sub) -> None:
    p = sub.add_parser("score", help=SUBCOMMANDS["score"])
    add_model_flags(p, model_help="local HF checkpoint folder; omitted: the embedded random default "
                                  "(scores mean nothing)")
    p.add_argument("--query", required=True, help="the (sub-)query")
    p.add_argument("--docs", required=True, help="JSONL file of documents ('-' for stdin)")
    p.add_argument("--question", help="the agent's original question (ACARe modes M2/M3)")
    p.add_argument("--trace-file", help="file holding the agent's reasoning trace (ACARe modes M1/M3)")
    p.add_argument("--instruction", help="override the default instruction")
    p.add_argument("--top-n", type=int, help="print only the best N, best first")
    p.add_argument("--max-documents", type=int, default=MAX_DOCUMENTS,
                   help=f"documents --docs may hold, refused before loading (default {MAX_DOCUMENTS:,}, "
                        "the server's --max-documents)")
    p.add_argument("--max-length", type=int, default=None,
                   help="token cap per document prompt (default 8192, or the model's maximum context length when "
                        "less; past it is refused)")
    p.add_argument("--min-doc-tokens", type=int, default=None,
                   help="document tokens kept free when the context is cut (default 512, at most max-length/2); "
                        "lower it to run short --max-length with long context")
    p.add_argument("--special-tokens", choices=("escape", "parse"), default="escape",
                   help="special-token strings in the query/context/documents: plain text (escape, default) or "
                        "control tokens as the model card does (parse)")
    p.set_defaults(run=run)


def run(args) -> int:
    from .common import check_common, check_text_flags, positive, read_text_file

    check_common(args)
    check_text_flags(args, "--query", "--question", "--instruction")
    positive("--top-n", args.top_n)
    positive("--max-documents", args.max_documents)
    positive("--min-doc-tokens", args.min_doc_tokens)
    if args.min_doc_tokens is not None and args.max_length is not None and args.min_doc_tokens >= args.max_length:
        # the exact fit (the template's own tokens too) needs the tokenizer, after loading
        raise ValueError(f"--min-doc-tokens {args.min_doc_tokens} leaves no room in --max-length {args.max_length}: "
                         "the prompt's fixed strings need tokens too; lower it or raise --max-length")
    if args.docs == "-" and args.trace_file == "-":  # --docs would read all of stdin, the trace none: M0, no sign
        raise ValueError("--docs - and --trace-file - cannot both read stdin: give one of them a file")
    docs = read_documents(args.docs, args.max_documents)
    note_replaced_fields(docs, ("index", "score"))
    trace = read_text_file(args.trace_file, "--trace-file") if args.trace_file else None
    _note_blank_context(args.question, args.trace_file, trace)
    from ..pointwise import PointwiseReranker

    rr = load_reranker(PointwiseReranker, args, min_doc_tokens=args.min_doc_tokens, special_tokens=args.special_tokens)
    texts = [d["text"] if isinstance(d, dict) else d for d in docs]
    ranked = rr.rerank(args.query, texts, top_n=args.top_n, question=args.question, trace=trace,
                       instruction=args.instruction)
    if args.top_n is None:
        ranked.sort()  # input order
    print_results({"index": i, "score": s,
                   **({k: v for k, v in docs[i].items() if k not in ("index", "score")}
                      if isinstance(docs[i], dict) else {"text": docs[i]})}
                  for i, s in ranked)
    return 0


def _note_blank_context(question, trace_file, trace) -> None:
    """One NOTE on stderr for a context flag given with no text in it: the API reads "" and
    whitespace as absent (docs/api.md), so an empty --trace-file scored a different ACARe mode
    (M0 for M1, M2 for M3) with no sign in the output — an agent's first step with an empty trace
    is a fair use, so it is a note, not an error."""
    blank = [name for name, given, value in (("--question", question is not None, question),
                                              (f"--trace-file {trace_file!r}", trace_file, trace))
             if given and not value.strip()]
    if blank:
        has_question, has_trace = bool(question and question.strip()), bool(trace and trace.strip())
        mode = "M" + str(int(has_trace) + 2 * int(has_question))
        print(f"NOTE: {' and '.join(blank)} {'hold' if len(blank) > 1 else 'holds'} no text: "
              f"scored without {'them' if len(blank) > 1 else 'it'} (ACARe mode {mode})", file=sys.stderr)
