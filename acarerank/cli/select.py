"""``acarerank select``: AdaTutoRank-style set selection over a JSONL document file.

Input lines are JSON objects with a "text" field (other fields are passed through) or
plain JSON strings. Output: one JSON object per selected document, most useful first:
{"rank", "index" (0-based line among the documents; the model names it [index + 1]),
...passed-through fields, an "id" included} — a document's own "rank" or "index" is replaced
(docs/api.md, "Setwise"); then, unless --quiet, a summary line on stderr with the raw output.
"""
from __future__ import annotations

import sys

from . import SUBCOMMANDS
from .common import (MAX_DOCUMENTS, add_model_flags, load_reranker, note_replaced_fields, print_results,
                     read_documents)


def add_parser(sub) -> None:
    p = sub.add_parser("select", help=SUBCOMMANDS["select"])
    add_model_flags(p, model_help="local HF checkpoint folder; omitted: the embedded random default "
                                  "(its selection means nothing)")
    p.add_argument("--query", required=True, help="the user question (RAG) or the agent's search query")
    p.add_argument("--docs", required=True, help="JSONL file of candidate documents ('-' for stdin)")
    p.add_argument("--intent", help="the agent's query intent (deep-research prompt, Appendix F.2)")
    p.add_argument("--max-documents", type=int, default=MAX_DOCUMENTS,
                   help=f"documents --docs may hold, refused before the tokenizer or the model loads (default "
                        f"{MAX_DOCUMENTS:,}, the server's --max-documents)")
    p.add_argument("--max-select", type=int, default=10, help="at most this many documents (default 10)")
    p.add_argument("--max-length", type=int, default=None,
                   help="prompt token cap; documents are cut evenly (default 16,000, the paper's, or the model's "
                        "maximum context length less --max-new-tokens when less; past it is refused)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="output token cap (default 64, the paper's); --max-select above 15 may need more")
    p.add_argument("--special-tokens", choices=("escape", "parse"), default="escape",
                   help="special-token strings in the query/intent/documents: plain text (escape, default) or "
                        "control tokens (parse)")
    p.add_argument("--unconstrained", action="store_true",
                   help="decode without the identifier grammar and parse the output leniently")
    p.add_argument("--quiet", action="store_true", help="no summary line on stderr")
    p.set_defaults(run=run)


def check_prompt_fits(args, texts) -> None:
    """The prompt's own failures (too many documents for --max-length, a query or intent alone
    over it), raised by the same ``build_prompt`` the selection runs, before the model loads:
    the tokenizer loads in a fraction of the model's time."""
    from ..reranker_base import checkpoint_tokenizer
    from ..setwise.prompts import DEFAULT_MAX_LENGTH, build_prompt
    from ..tokenizer import TextEncoder

    tokenizer = checkpoint_tokenizer(args.model) if args.model else None
    # unset: the paper's cap, which the model's positions can only lower (checked again once it loads)
    build_prompt(TextEncoder.of(tokenizer, args.special_tokens), args.query, texts, args.intent, args.max_select,
                 DEFAULT_MAX_LENGTH if args.max_length is None else args.max_length)


def run(args) -> int:
    from ..setwise.grammar import max_new_tokens_cap, max_output_tokens
    from .common import check_common, check_text_flags, positive

    check_common(args)
    check_text_flags(args, "--query", "--intent")
    positive("--max-select", args.max_select)
    positive("--max-new-tokens", args.max_new_tokens)
    positive("--max-documents", args.max_documents)
    docs = read_documents(args.docs, args.max_documents)
    note_replaced_fields(docs, ("rank", "index"))
    texts = [d["text"] if isinstance(d, dict) else d for d in docs]
    # free decoding (--unconstrained) runs to --max-new-tokens unless the model stops itself (a
    # random-weight one never does): past the longest selection any pool this size allows, the
    # output is no selection, and 10**22 tokens never end (SetwiseReranker applies the same cap)
    if args.max_new_tokens > max_new_tokens_cap(len(texts)):
        raise ValueError(f"--max-new-tokens must be at most {max_new_tokens_cap(len(texts)):,}, the longest selection "
                         f"of {max(MAX_DOCUMENTS, len(texts)):,} documents, got {args.max_new_tokens:,}")
    need = max_output_tokens(len(texts), args.max_select)
    if not args.unconstrained and need > args.max_new_tokens:
        raise ValueError(f"--max-select {args.max_select} over {len(texts)} documents can need {need} output tokens, "
                         f"more than --max-new-tokens {args.max_new_tokens}; raise --max-new-tokens")
    check_prompt_fits(args, texts)
    from ..setwise import SetwiseReranker

    sr = load_reranker(SetwiseReranker, args, max_new_tokens=args.max_new_tokens, special_tokens=args.special_tokens)
    sel = sr.select(args.query, texts, intent=args.intent, max_select=args.max_select,
                    constrained=not args.unconstrained)
    # no "id" of ours: the model's identifier is always index + 1, and an output "id" replaced the
    # document's own (a corpus numbered 1..n read as another document's number, with no error)
    print_results({"rank": rank, "index": i,
                   **({k: v for k, v in docs[i].items() if k not in ("rank", "index")}
                      if isinstance(docs[i], dict) else {"text": docs[i]})}
                  for rank, i in enumerate(sel.indices, 1))
    if not args.quiet:
        print(f"output {sel.text!r} ({sel.num_tokens} tokens, prompt {sel.prompt_tokens} tokens, "
              f"{'valid' if sel.valid else 'INVALID, leniently parsed'})", file=sys.stderr)
    return 0
