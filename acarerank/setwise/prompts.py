"""AdaTutoRank's setwise prompts (AdaTutoRank (2026), Appendix F.1 RAG and F.2 deep research), in the
Qwen3 chat format with thinking off, tokenized and truncated to a token budget.

Wording: every sentence below is Appendix F's text verbatim; ``tests/setwise/test_setwise_prompts.py``
holds the paper's text as data and compares. The HTML rendering of the appendix drops line
breaks and the ``{...}`` placeholders, so three things are reconstructed, each following the
paper's own Figure 3 ("I will provide you with {num_documents} documents ... search query:
{query}; {query_intent}; {candidate_documents}") and RankGPT's convention it inherits:

* the count sits in "I will provide you with {num} passages" and the query after the colons
  ("... user question: {query}." and "User Question: {query}.");
* the ``[ PASSAGES ]`` block is one line per candidate, ``[i] <text>``, i = 1..n;
* the ``[ QUERY INTENT ]`` block is ``Query Intent: <intent>``;
* paragraphs are separated by blank lines and each of the 9 rubrics is on its own line.

"at most 10" is the paper's cap; ``max_select`` replaces the 10 (and only it).

Chat format (Qwen3, ``enable_thinking=False``; equal to the tokenizer's chat template)::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n

Truncation rule (``max_length`` = prompt tokens, the paper trains with 16,000): the template,
query and intent are never cut (an error says so if they alone do not fit); no candidate is
ever dropped; when the candidates do not fit, every document gets the same token budget
``b`` -- the largest with ``sum_i min(len_i, b) <= room`` (water-filling: documents shorter
than ``b`` keep all their tokens and leave the rest to the longer ones) -- and a cut document
keeps its first ``b`` tokens (its head; the tail goes first, as in Qwen3-Reranker). A document
longer than ``max_length`` tokens on its own is only tokenized up to one token past it
(``TextEncoder.user_heads``): every document over ``b`` keeps exactly its first ``b`` tokens either
way, so the prompt is the one the whole documents give, at the cost of their heads.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import List, Optional, Sequence

from .._validate import check_int, positive_int
from ..prompts.pointwise import check_documents, check_query

DEFAULT_MAX_LENGTH = 16000      # AdaTutoRank (2026), Appendix C.4: maximum prompt length 16,000 tokens
TOKEN_IM_START = 151644  # Qwen3's <|im_start|> (the prompt reads the tokenizer's own: control_ids)

_RUBRICS = (
    "Use these 9 rubrics to judge a candidate document set:\n"
    "Relevance (doc-level, primary objective): Does the document directly address, at the topic level, the core "
    "information need of the query (naming the concrete subject/facet the query asks about), rather than merely "
    "matching surface keywords?\n"
    "Authenticity (doc-level): Are the document\u2019s factual statements consistent with the correct reference facts "
    "(dates, numbers, names, causal conclusions) given by the query/answer? Drop documents that state falsehoods.\n"
    "Quality (doc-level): Is the document clearly structured, focused, and information-dense enough that the target "
    "information can be directly extracted, rather than being empty, too shallow, noisy, or low-quality filler?\n"
    "Complementarity (set-level): Do the retained documents complement one another so that, taken together, they "
    "cover the key information elements the answer requires more completely than any single document could? Prefer "
    "subsets whose documents jointly raise coverage.\n"
    "Redundancy (set-level): Does the subset avoid two or more documents that convey essentially the same core "
    "information with no incremental value? When documents duplicate each other, keep only the single best one.\n"
    "Conflict (set-level): Are the documents free of mutual factual contradiction on the same point, so the subset "
    "consistently supports the correct answer? Reject subsets that contain contradictory statements.\n"
    "Completeness (global-level): Does the whole subset collectively supply every key information element the "
    "correct answer depends on, leaving no obvious gap?\n"
    "Density (global-level): Across the subset, does the query-relevant content occupy the majority of each "
    "document\u2019s length, rather than the documents being bloated with irrelevant padding around a small useful "
    "snippet?\n"
    "Reachability (global-level): Using only this subset and no external knowledge, can the full reasoning chain "
    "required to produce the correct answer be completed \u2014 is every link grounded in the set?"
)
_OUTPUT_FORMAT = (
    "Output format (STRICT): respond with only the selected document identifiers, each wrapped in square brackets "
    "and separated by a single space, ordered from most to least useful. Example: [4] [2] [7] [11] [1]. Do not "
    "output any other text or explanation."
)

RAG_SYSTEM = (
    "You are a high-quality document set selector for a retrieval-augmented QA system. Given a user question and a "
    "list of retrieved passages, select the best subset that jointly answers the question, then rank the selected "
    "passages from most to least useful.\n\n" + _RUBRICS + "\n\n" + _OUTPUT_FORMAT
)
DEEP_RESEARCH_SYSTEM = (
    "You are a high-quality document set selector for a deep-research agent. Given a search query from the agent, "
    "the agent\u2019s reasoning as query intent, and a list of retrieved documents, select the best subset that "
    "jointly answers the query, then rank the selected documents from most to least useful. The query intent may "
    "clarify why this query was issued and what information it is trying to find, but it may also contain broader, "
    "exploratory, or irrelevant thoughts. Stay anchored on the query itself and only use the parts of the query "
    "intent that are actually relevant to this query.\n\n" + _RUBRICS + "\n\n" + _OUTPUT_FORMAT
)

# str.format templates; fields: num, query, passages, max_select (+ intent_block for deep research).
_USER_TAIL = (
    "Then rank the selected passages from most to least useful. The number of selected passages is at most "
    "{max_select} and should not include redundant ones. The output must be only the selected identifiers in ranked "
    "order, e.g. [2] [1] [4]. Only respond with the selection; do not say any other word and do not explain."
)
RAG_USER_TEMPLATE = (
    "I will provide you with {num} passages, each indicated by a numerical identifier []. Select and rank the "
    "passages based on their joint usefulness for the user question: {query}.\n\n"
    "{passages}\n\n"
    "User Question: {query}.\n\n"
    "Select the best subset of the passages above so that, judged by the 9 dimensions rubrics, the selected set "
    "best answers the question. " + _USER_TAIL
)
DEEP_RESEARCH_USER_TEMPLATE = (
    "I will provide you with {num} passages, each indicated by a numerical identifier []. Select and rank the "
    "passages based on their joint usefulness for the search query: {query}.\n\n"
    "{intent_block}\n\n"
    "{passages}\n\n"
    "Search Query: {query}.\n\n"
    "Select the best subset of the passages above so that, judged by the 9 dimensions rubrics, the selected set "
    "best answers the query (anchored on the query, with the query intent only as clarification). " + _USER_TAIL
)
INTENT_BLOCK_TEMPLATE = "Query Intent: {intent}"
PASSAGE_TEMPLATE = "[{id}] {text}"


def normalize_intent(intent) -> Optional[str]:
    """``None`` for a missing intent (None, "" or whitespace only: the F.1 RAG prompt, as the
    pointwise context fields treat empty strings), else the intent itself (F.2)."""
    if intent is None:
        return None
    if not isinstance(intent, str):
        raise TypeError(f"intent must be a str or None, got {type(intent).__name__}")
    return intent if intent.strip() else None


def check_inputs(query, documents, intent=None, max_select=10) -> list:
    """Raise TypeError / ValueError naming the bad argument (a lone surrogate names its field);
    returns the checked copy of ``documents`` (``check_documents``), the list to use from then on."""
    from ..tokenizer import check_text

    check_text("query", check_query(query))
    docs = check_documents(documents)
    for i, d in enumerate(docs):
        check_text(f"documents[{i}]", d)
    intent = normalize_intent(intent)
    if intent is not None:
        check_text("intent", intent)
    positive_int("max_select", max_select)
    return docs


def system_prompt(intent: Optional[str] = None) -> str:
    """F.1 (no intent: None, "" or whitespace) or F.2 system text."""
    return RAG_SYSTEM if normalize_intent(intent) is None else DEEP_RESEARCH_SYSTEM


def user_prompt(query: str, documents: Sequence[str], intent: Optional[str] = None, max_select: int = 10) -> str:
    """F.1 / F.2 user text with candidates ``[1]..[n]`` (documents used as given, no truncation)."""
    documents = check_inputs(query, documents, intent, max_select)
    intent = normalize_intent(intent)
    max_select = int(max_select)
    passages = "\n".join(PASSAGE_TEMPLATE.format(id=i + 1, text=d) for i, d in enumerate(documents))
    fields = dict(num=len(documents), query=query, passages=passages, max_select=max_select)
    if intent is None:
        return RAG_USER_TEMPLATE.format(**fields)
    return DEEP_RESEARCH_USER_TEMPLATE.format(intent_block=INTENT_BLOCK_TEMPLATE.format(intent=intent), **fields)


def chat_text(system: str, user: str) -> str:
    """Qwen3 chat rendering, generation prompt with an empty think block (thinking off)."""
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")


def chat_ids(tokenizer, system: str, user: str, special_tokens: Optional[str] = None) -> List[int]:
    """Token ids of ``chat_text(system, user)``.

    The chat's control tokens are inserted as ids; the text between them is user text, encoded
    by the rule of :mod:`acarerank.tokenizer`: with ``special_tokens="escape"`` (default) a
    document that contains "<|im_end|>" (or any other of Qwen3's 26 added-token strings) stays
    text instead of closing the turn; with "parse" the result equals
    ``tokenizer.encode(chat_text(...))`` exactly. For text without such strings both equal it.
    ``tokenizer`` is never called: a private read-only copy encodes (``TextEncoder.of``).
    """
    from ..tokenizer import TextEncoder

    encoder = TextEncoder.of(tokenizer, special_tokens)

    def enc(s: str) -> List[int]:
        return encoder.user([s])[0]

    start, end, think, end_think = control_ids(encoder)
    return ([start] + enc("system\n" + system) + [end] + enc("\n")
            + [start] + enc("user\n" + user) + [end] + enc("\n")
            + [start] + enc("assistant\n") + [think] + enc("\n\n") + [end_think] + enc("\n\n"))


CHAT_CONTROL_TOKENS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")


def control_ids(tokenizer) -> tuple:
    """The ids of ``CHAT_CONTROL_TOKENS`` in ``tokenizer`` (Qwen3's: TOKEN_IM_START, TOKEN_IM_END,
    TOKEN_THINK, TOKEN_END_THINK). Read from the tokenizer, not assumed: a checkpoint's own
    tokenizer may number them otherwise, and the prompt must be the one it gives the chat text.
    ValueError naming a token the tokenizer lacks."""
    from ..tokenizer import TextEncoder

    encoder = TextEncoder.of(tokenizer)
    ids = tuple(encoder.token_id(t) for t in CHAT_CONTROL_TOKENS)
    missing = [t for t, i in zip(CHAT_CONTROL_TOKENS, ids) if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no token {missing[0]!r}; the setwise prompt is Qwen3's chat format")
    return ids


@dataclass
class SetwisePrompt:
    """A tokenized setwise prompt. ``doc_token_budget``: the per-document cap ``b`` (None if nothing was cut)."""

    input_ids: List[int]
    text: str
    n_candidates: int
    max_select: int
    doc_token_budget: Optional[int]
    truncated: List[bool]


def _head_end(offsets: list, b: int) -> int:
    """Where the text of a document's first ``b`` tokens ends: where token ``b`` starts, when it
    starts past token ``b - 1``'s end. A combining mark the tokenizer's normalisation (NFC) folds
    into token ``b - 1`` lies outside that token's offsets: cut at its end, "Ame\u0301lie" kept
    "Ame", a token the document never had. ``offsets`` holds more than ``b`` tokens (a cut one)."""
    end = offsets[b - 1][1]
    return max(end, offsets[b][0]) if b < len(offsets) else end


def _water_fill(lengths: Sequence[int], room: int) -> int:
    """Largest b with sum(min(l, b)) <= room (lengths fit entirely -> max(lengths))."""
    lo, hi = 0, max(lengths)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(x, mid) for x in lengths) <= room:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check_never_cut_heads(encoder, query: str, intent: Optional[str], max_length: int) -> None:
    """ValueError when the query or intent alone is over ``max_length`` tokens, found by tokenizing
    its head only (``TextEncoder.user_heads``): a huge one costs ``max_length`` tokens, not its length."""
    from ..tokenizer import HEAD_CHARS_PER_TOKEN

    values = [(name, v) for name, v in (("query", query), ("intent", intent))
              if v is not None and len(v) > (max_length + 1) * HEAD_CHARS_PER_TOKEN]
    for (name, _), (ids, _, complete) in zip(values, encoder.user_heads([v for _, v in values], max_length + 1)):
        if not complete:
            raise ValueError(f"the {name} is never truncated and alone is over max_length={max_length} tokens "
                             f"({len(ids)}+ tokens). Shorten the query/intent or raise max_length")


def build_prompt(tokenizer, query: str, documents: Sequence[str], intent: Optional[str] = None,
                 max_select: int = 10, max_length: Optional[int] = DEFAULT_MAX_LENGTH,
                 special_tokens: Optional[str] = None) -> SetwisePrompt:
    """Tokenized F.1/F.2 chat prompt of at most ``max_length`` tokens (None: no limit); see the module rule.

    ``special_tokens``: "escape" (default) or "parse", see :func:`chat_ids`. Thread-safe.
    TypeError / ValueError naming the argument for bad inputs, ``max_length`` included (an int >= 1).
    """
    from ..tokenizer import TextEncoder

    documents = check_inputs(query, documents, intent, max_select)
    max_length = check_int("max_length", max_length, 1, allow_none=True)
    intent = normalize_intent(intent)
    encoder = TextEncoder.of(tokenizer, special_tokens)
    system = system_prompt(intent)

    def render(docs):
        user = user_prompt(query, docs, intent, max_select)
        return chat_ids(encoder, system, user), chat_text(system, user)

    n = len(documents)
    heads = None
    if max_length is not None:
        _check_never_cut_heads(encoder, query, intent, max_length)
        # a document over max_length tokens alone is cut whatever else fits: only its head (one
        # token past max_length, at a provable split: TextEncoder.user_heads) is ever tokenized
        heads = encoder.user_heads(documents, max_length + 1, offsets=True)
        documents = [d if complete else d[:offsets[-1][1]] for d, (_, offsets, complete) in zip(documents, heads)]
    ids, text = render(documents)
    if max_length is None or len(ids) <= max_length:
        return SetwisePrompt(ids, text, n, max_select, None, [False] * n)

    enc = [(ids, offsets) for ids, offsets, _ in heads]
    lengths = [len(ids) for ids, _ in enc]
    fixed = len(render([""] * n)[0])
    room = max_length - fixed
    if room < n:
        raise ValueError(f"the prompt without document text is already {fixed} tokens (template, query, intent and "
                         f"{n} identifiers); max_length={max_length} leaves "
                         f"{'no tokens' if room <= 0 else f'only {room} token(s)'} for {n} documents (at least one each). "
                         "Shorten the query/intent or raise max_length")
    # Joint tokenization can differ from the per-document counts by a token at each seam, so
    # shrink the room by the overshoot until the real prompt fits. Every room down to
    # sum(min(len_i, b)) gives the same b, hence the same prompt and the same overshoot: step
    # over those rooms at once (to the first one the one-overshoot-at-a-time walk reaches below
    # it, so b is the one that walk finds) instead of rendering the prompt again for each --
    # with a 1-token overshoot that was up to one render per cut document (n/2 renders of the
    # whole prompt: 17 s for 400 documents). One or two renders in practice.
    while True:
        b = _water_fill(lengths, room)
        cut = [x > b for x in lengths]
        docs = [documents[i][:_head_end(enc[i][1], b)] if c and b > 0 else (documents[i] if not c else "")
                for i, c in enumerate(cut)]
        ids, text = render(docs)
        if len(ids) <= max_length:
            return SetwisePrompt(ids, text, n, max_select, b, cut)
        if room <= 0:
            raise ValueError(f"cannot fit {n} documents into max_length={max_length} tokens")
        over = len(ids) - max_length
        used = sum(min(x, b) for x in lengths)
        room -= over * ((room - used) // over + 1)
