"""The checks of a request's shape that its schema cannot express: each a 400 or 413 before any work.

Empty ``documents`` (400) and more than ``max_documents`` (413); a score request's pairing (vLLM's
rule: 1 query with N documents or N with N); a peer's option that would change the scores and that
we cannot honour (``rank_fields``, ``max_chunks_per_doc`` other than 1, ``truncation_direction:
Left``, ``truncate_prompt_tokens`` other than -1, ``use_activation: false``, vLLM's other options
off their defaults) — refused, never ignored (docs/serving.md, "Errors"); a score request's groups
(``score_groups``); and why a setwise model can serve no selection at all (``select_unavailable``),
or only tiny ones (``select_room_note``: docs/serving.md, "Selections and long inputs"). Plain
functions of the request: no state, no model.
"""
from __future__ import annotations

from typing import Optional

from .errors import APIError
from .schemas import RerankRequest, ScorePairsRequest


def check_documents(docs: list, max_documents: int) -> None:
    """At least one document (400), at most ``max_documents`` (413, ``--max-documents``)."""
    if len(docs) == 0:
        raise APIError(400, "documents is empty: send at least one document")
    if len(docs) > max_documents:
        raise APIError(413, f"{len(docs)} documents exceed the limit of {max_documents} per request "
                            f"(--max-documents)")


def check_select_output(max_new_tokens: int, n: int, max_select: int) -> None:
    """400 when a selection of ``max_select`` ids over ``n`` documents can need more output tokens than
    this server decodes (``--select-max-new-tokens``), with the most ``max_select`` it takes for
    ``n``: the client's own remedy. (The reranker's error names library and CLI settings the
    client cannot change.) Output bound: ``setwise.grammar.max_output_tokens``."""
    from ..setwise.grammar import max_output_tokens

    need = max_output_tokens(n, max_select)
    if need <= max_new_tokens:
        return
    most = (max_new_tokens - 1) // (2 + len(str(n)))   # min(s, n)·(2 + digits(n)) + 1 <= max_new_tokens
    fix = (f"send max_select of at most {most}" if most >= 1 else
           "no selection over this many documents fits it: send fewer documents")
    raise APIError(400, f"max_select={max_select} over {n} documents can need {need} output tokens, more than this "
                        f"server decodes ({max_new_tokens}, its --select-max-new-tokens): {fix}")


def check_pairs(req: ScorePairsRequest, queries: list, docs: list, max_documents: int) -> None:
    """vLLM's pairing rule: 1 query with N >= 1 documents, or N queries with N documents; then the
    rerank route's limit on documents (413)."""
    first, second = req.pair_names
    if len(queries) == 0:
        raise APIError(400, f"{first} is empty: send at least one query")
    if len(docs) == 0:
        raise APIError(400, f"{second} is empty: send at least one document")
    if len(queries) > 1 and len(queries) != len(docs):
        raise APIError(400, f"{first} has {len(queries)} texts and {second} {len(docs)}: pair them 1 to 1, "
                            f"1 to N or N to N (as many {first} as {second})")
    check_documents(docs, max_documents)


def check_peer_options(req: RerankRequest) -> None:
    """A peer's option that would change the scores is honoured or refused (400), never ignored:
    scores that silently differ from what the client asked for are worse than an error."""
    rank_fields = getattr(req, "rank_fields", None)   # the score route (ScorePairsRequest) has none
    if rank_fields is not None and any(f != "text" for f in rank_fields):
        raise APIError(400, f"rank_fields={rank_fields!r} is not supported: only each document's 'text' is "
                            f"scored; put what should be ranked into 'text'")
    chunks = getattr(req, "max_chunks_per_doc", None)
    if chunks is not None and chunks != 1:
        # Cohere v1 splits a long document into up to this many chunks and scores its best one; here a
        # document is one chunk, cut from its end: the part past the cut would go unscored unsaid
        raise APIError(400, f"max_chunks_per_doc={chunks} is not supported: each document is scored as one chunk, "
                            f"cut from its end (truncate, max_tokens_per_doc); send 1 or leave it out, and split "
                            f"long documents into several")
    direction = getattr(req, "truncation_direction", None)
    if direction is not None and direction.lower() != "right":
        raise APIError(400, f"truncation_direction={direction!r} is not supported: documents are cut "
                            f"from their end ('Right'); send truncate: false to refuse over-long inputs instead")
    for name in ("use_activation", "activation", "softmax"):
        if getattr(req, name) is False:
            raise APIError(400, f"{name}=false is not supported: this server returns relevance probabilities "
                                f"(sigmoid of the yes/no logit difference), not logits")
    if req.truncate_prompt_tokens is not None and req.truncate_prompt_tokens != -1:
        raise APIError(400, f"truncate_prompt_tokens={req.truncate_prompt_tokens} is not supported (only -1: cut to "
                            f"the model's length, which truncate: true does); send max_tokens_per_doc to cut each "
                            f"document to that many tokens")


def check_vllm_options(req) -> Optional[str]:
    """vLLM's options beyond ``check_peer_options`` (``VLLMOptions``, on the rerank and score
    routes): honoured or a 400 naming them. Returns the instruction to use:
    ``chat_template_kwargs["instruction"]`` wins over the ``instruction`` field, as vLLM merges them."""
    if req.max_tokens_per_query:
        raise APIError(400, f"max_tokens_per_query={req.max_tokens_per_query} is not supported: a query is never "
                            f"cut here; send a shorter query (max_tokens_per_doc cuts each document)")
    if req.truncation_side is not None and req.truncation_side.lower() != "right":
        raise APIError(400, f"truncation_side={req.truncation_side!r} is not supported: documents are cut from "
                            f"their end ('right'); send truncate: false to refuse over-long inputs instead")
    if req.padding is not None and req.padding != "do_not_pad":
        raise APIError(400, f"padding={req.padding!r} is not supported: prompts are never padded ('do_not_pad')")
    kwargs = req.chat_template_kwargs or {}
    other = sorted(k for k in kwargs if k != "instruction")
    if other:   # named, the first five (from a body, parsing.parse_body stops at the first)
        more = f" and {len(other) - 5} more" if len(other) > 5 else ""
        raise APIError(400, f"chat_template_kwargs {other[:5]}{more} not supported: the prompt template is fixed; "
                            f"only 'instruction' is read (as the instruction field)")
    instruction = kwargs.get("instruction", req.instruction)
    if instruction is not None and not isinstance(instruction, str):
        raise APIError(400, f"chat_template_kwargs['instruction'] must be a string, got "
                            f"{type(instruction).__name__}")
    return instruction


#: a /v1/select cap that leaves fewer tokens than this beyond the setwise template (the query, the
#: documents and their identifiers) is said at start-up (``select_room_note``): ten passages of about
#: 20 tokens, a query of ten; a model of up to ~950 positions at the default --select-max-new-tokens
SELECT_MIN_ROOM = 256


def _cap_source(setwise) -> str:
    """Where ``setwise``'s prompt cap comes from, in the flags' words."""
    limit, new = setwise.runner.max_positions, setwise.max_new_tokens
    if setwise.max_length == limit - new:
        return f"this model's maximum context length of {limit:,} tokens less --select-max-new-tokens={new:,}"
    return "--select-max-length"


def select_unavailable(setwise) -> Optional[str]:
    """Why ``setwise`` (a ``SetwiseReranker``) can serve no selection at all, or None: its prompt cap
    is under ``min_prompt_tokens()``, the template alone, so every prompt is over it whatever the
    request holds (a model of fewer than ~700 positions: its cap is its maximum context length less
    ``--select-max-new-tokens``). ``build_rerankers`` says it once at start-up; ``select`` answers
    each request with it (docs/serving.md, "Selections and long inputs")."""
    cap, need = setwise.max_length, setwise.min_prompt_tokens()
    if cap is None or cap >= need:
        return None
    limit, new = setwise.runner.max_positions, setwise.max_new_tokens
    why = _cap_source(setwise)
    if cap == limit - new:
        why += (f"; a --select-max-new-tokens of at most {limit - need:,} leaves the template room" if limit > need
                else "; serve a model of more positions")
    return (f"the setwise prompt cap of {cap:,} tokens ({why}) is under the {need:,} tokens the setwise prompt's "
            f"template alone takes (an empty query, one empty document), so no selection fits")


def select_room_note(setwise) -> Optional[str]:
    """A start-up NOTE when ``setwise``'s prompt cap holds the template but leaves fewer than
    ``SELECT_MIN_ROOM`` tokens beyond it, room = cap - ``min_prompt_tokens()``; else None. Such a
    model (~695-950 positions at the default 64 new tokens) serves selections, but only tiny ones:
    longer documents are cut to fit and a larger pool is refused (400), so the operator hears the
    room once rather than learning it from every request (docs/serving.md, "Selections and long
    inputs"). Requests are served as before."""
    cap, need = setwise.max_length, setwise.min_prompt_tokens()
    if cap is None or cap < need or cap - need >= SELECT_MIN_ROOM:
        return None
    return (f"NOTE: /v1/select has room for {cap - need:,} tokens of query and documents: the setwise prompt cap of "
            f"{cap:,} tokens ({_cap_source(setwise)}) less the {need:,} tokens of the setwise prompt's template "
            f"alone (an empty query, one empty document); the query is in the prompt twice and each document past "
            f"the first adds its identifier's tokens, so longer documents are cut to fit and a pool that cannot fit "
            f"is a 400; a smaller --select-max-new-tokens or a model of more positions leaves more")


def score_groups(queries: list) -> dict:
    """``{query: [pair indices]}`` for the pairs of a score request, in first-appearance order.

    1 query with N documents is one group (every pair); N queries with N documents make one group
    per distinct query, pair ``i`` (query ``i``, document ``i``) in its query's group, so each
    query's prefix is prefilled once, as the rerank route's is (a query's documents in one job)."""
    groups: dict = {}
    for i, q in enumerate(queries):
        groups.setdefault(q, []).append(i)
    return groups
