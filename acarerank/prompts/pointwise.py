"""Pointwise prompts: Qwen3-Reranker strings, ACARe context modes, the token-safe split.

The prompt a pointwise reranker scores (docs/ARCHITECTURE.md, "Scoring facts", the Qwen3-Reranker model card)::

    PREFIX + "<Instruct>: {instruction}\\n" [context lines] "<Query>: {query}\\n<Document>: {doc}" + SUFFIX
    └──────────────────── shared part: identical for every document ──────────────┘└── segment ──────┘

tokenized as the model card does it: prefix and suffix each on their own
(``add_special_tokens=False``), the body on its own. The split point is right after
``"<Document>:"``: the shared part is ``tokens(PREFIX) + tokens(body up to "<Document>:")``
and a document's segment is ``tokens(" " + doc) + tokens(SUFFIX)``. With the Qwen3
tokenizer this equals the joint tokenization because the pre-tokenizer regex can never
put ``":"`` and the following space in one pre-token (its punctuation branch,
`` ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*``, stops at a space) and BPE never merges across
pre-tokens. ``tests/prompts/test_prompts.py`` keeps proving it on awkward documents.

ACARe context modes (one checkpoint, four prompts):

====  ==================================  ========================================
mode  fields                              body
====  ==================================  ========================================
M0    sub-query only                      Qwen3-Reranker's body, fixed
M1    + reasoning trace                   ``ContextTemplate.trace`` line added
M2    + original question                 ``ContextTemplate.question`` line added
M3    + both                              both lines, in ``ContextTemplate.order``
====  ==================================  ========================================

A field that is ``None``, empty or whitespace only counts as missing and the mode drops
to the matching lower one (e.g. an empty trace turns M3 into M2), as ACARe's context
dropout trains for. Truncation rules live in :mod:`acarerank.prompts.truncation`.
"""
from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Optional, Sequence

from .._validate import check_int, is_bool, positive_int
from .truncation import DEFAULT_MIN_DOC_TOKENS, TRACE_CUT_CHUNK, cut_oldest, cut_tail

# -- Qwen3-Reranker model card strings, character for character (docs/ARCHITECTURE.md, "Scoring facts") --------
QWEN3_RERANKER_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
)
QWEN3_RERANKER_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
QWEN3_RERANKER_BODY = "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
DEFAULT_MAX_LENGTH = 8192  # ACARe's inference cap and the model card's max_length

# The body cut into the pieces the context lines go between. Everything up to and including
# SHARED_END is shared; a segment starts with DOC_SEP.
INSTRUCT_LINE = "<Instruct>: {instruction}\n"
QUERY_LINE = "<Query>: {query}\n"
SHARED_END = "<Document>:"
DOC_SEP = " "
assert INSTRUCT_LINE + QUERY_LINE + SHARED_END + DOC_SEP + "{doc}" == QWEN3_RERANKER_BODY

MODES = ("M0", "M1", "M2", "M3")


@dataclass(frozen=True)
class ContextTemplate:
    """How ACARe's context fields enter the body (modes M1–M3); M0 never uses it.

    ACARe's released template is not public, so this is data. The default puts the context
    between the instruction and the sub-query, in the order the agent produced it::

        <Instruct>: {instruction}
        <Question>: {question}        # M2, M3
        <Reasoning>: {trace}          # M1, M3
        <Query>: {query}
        <Document>: {doc}

    Context always sits before ``"<Document>:"``, i.e. in the shared part.

    Attributes:
        question: format string of the question line; exactly one field, ``{question}``, bare:
            a format spec or conversion (``{question:.30}``, ``{question!r}``) would change the
            text, e.g. cut the question, which is never cut (``acarerank.prompts.truncation``).
        trace: format string of the reasoning-trace line; exactly one field, ``{trace}``, bare.
        order: the order of the two lines, a permutation of ``("question", "trace")``.
        context_instruction: instruction used in M1–M3 when the caller passes none
            (``None``: :data:`DEFAULT_INSTRUCTION`, as in M0).
    """

    question: str = "<Question>: {question}\n"
    trace: str = "<Reasoning>: {trace}\n"
    order: tuple = ("question", "trace")
    context_instruction: Optional[str] = None

    def __post_init__(self):
        from ..tokenizer import check_text

        for name in ("question", "trace"):
            fmt = getattr(self, name)
            if not isinstance(fmt, str):
                raise TypeError(f"ContextTemplate.{name} must be a format string, got {type(fmt).__name__}")
            try:
                parsed = [(f, spec, conv) for _, f, spec, conv in string.Formatter().parse(fmt) if f is not None]
            except ValueError as e:  # an unmatched brace
                raise ValueError(f"ContextTemplate.{name} is not a format string: {e}; {fmt!r}") from None
            fields = [f for f, _, _ in parsed]
            if fields != [name]:
                raise ValueError(f"ContextTemplate.{name} must contain the field {{{name}}} exactly once and no "
                                 f"other field; {fmt!r} has {fields}")
            if parsed[0][1] or parsed[0][2]:  # else "{question:.30}" cut the question silently, "{question:d}" failed in encode
                raise ValueError(f"ContextTemplate.{name} must hold the field bare, {{{name}}}, without a format spec "
                                 f"or conversion (they change the text); {fmt!r}")
            check_text(f"ContextTemplate.{name}", fmt)
        if tuple(self.order) not in (("question", "trace"), ("trace", "question")):
            raise ValueError(f"ContextTemplate.order must be ('question', 'trace') or ('trace', 'question'), "
                             f"got {self.order!r}")
        if self.context_instruction is not None and not isinstance(self.context_instruction, str):
            raise TypeError(f"ContextTemplate.context_instruction must be a str or None, "
                            f"got {type(self.context_instruction).__name__}")
        if self.context_instruction is not None:
            check_text("ContextTemplate.context_instruction", self.context_instruction)


DEFAULT_TEMPLATE = ContextTemplate()



#: the advice on min_doc_tokens in a too-long-context error: a setting of the reranker, never of a
#: request (an HTTP client was told to pass ``--min-doc-tokens``, which ``acarerank serve`` has not)
MIN_DOC_KNOB = (" or lower min_doc_tokens (the reranker's setting, not a request's: PointwiseReranker(min_doc_tokens=...), "
                "acarerank score --min-doc-tokens)")

def _check_optional_str(name: str, value) -> Optional[str]:
    """``None`` for a missing field (None, "" or whitespace only), else the string itself."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or None, got {type(value).__name__}")
    return value if value.strip() else None


def context_mode(question: Optional[str] = None, trace: Optional[str] = None) -> str:
    """The ACARe mode the fields select: "M0" none, "M1" trace, "M2" question, "M3" both.

    ``None``, ``""`` and whitespace-only strings count as missing.
    """
    q = _check_optional_str("question", question)
    t = _check_optional_str("trace", trace)
    return MODES[(1 if t is not None else 0) + (2 if q is not None else 0)]


def check_query(query) -> str:
    if query is None:
        raise TypeError("query is None; pass the (sub-)query as a str")
    if not isinstance(query, str):
        raise TypeError(f"query must be a str, got {type(query).__name__}")
    return query


def check_documents(documents) -> list:
    """A copy of ``documents``, a list of str; TypeError naming the first bad item's index,
    ValueError("no documents"). The sequence is read once and the copy is what is checked:
    callers use the copy, so a list another thread changes meanwhile is used as it was checked
    (read again after the check, a non-str put in by then reached the tokenizer: an
    AttributeError or a TypeError naming nothing)."""
    if isinstance(documents, (str, bytes)) or not isinstance(documents, Sequence):
        raise TypeError(f"documents must be a list of str, got {type(documents).__name__}")
    docs = list(documents)
    if len(docs) == 0:
        raise ValueError("no documents: the document list is empty")
    for i, doc in enumerate(docs):
        if not isinstance(doc, str):
            raise TypeError(f"documents[{i}] must be a str, got {type(doc).__name__}")
    return docs


def resolve_instruction(instruction, mode: str, template: ContextTemplate) -> str:
    if instruction is not None:
        if not isinstance(instruction, str):
            raise TypeError(f"instruction must be a str or None, got {type(instruction).__name__}")
        return instruction
    if mode != "M0" and template.context_instruction is not None:
        return template.context_instruction
    return DEFAULT_INSTRUCTION


def shared_body_text(query: str, question: Optional[str], trace: Optional[str], instruction: str,
                     template: ContextTemplate = DEFAULT_TEMPLATE) -> str:
    """The body up to and including ``"<Document>:"`` (no prefix). Fields already validated;
    ``None`` leaves a context line out. With both ``None`` it is Qwen3-Reranker's body head."""
    parts = [INSTRUCT_LINE.format(instruction=instruction)]
    values = {"question": question, "trace": trace}
    for name in template.order:
        if values[name] is not None:
            parts.append(getattr(template, name).format(**{name: values[name]}))
    parts.append(QUERY_LINE.format(query=query))
    parts.append(SHARED_END)
    return "".join(parts)


def body_text(query: str, doc: str, question: Optional[str] = None, trace: Optional[str] = None,
              instruction: Optional[str] = None, template: ContextTemplate = DEFAULT_TEMPLATE) -> str:
    """The whole body ``"<Instruct>: ...<Document>: {doc}"`` for the mode the fields select."""
    query = check_query(query)
    if not isinstance(doc, str):
        raise TypeError(f"doc must be a str, got {type(doc).__name__}")
    q = _check_optional_str("question", question)
    t = _check_optional_str("trace", trace)
    instr = resolve_instruction(instruction, context_mode(q, t), template)
    return shared_body_text(query, q, t, instr, template) + DOC_SEP + doc


def full_prompt_text(query: str, doc: str, question: Optional[str] = None, trace: Optional[str] = None,
                     instruction: Optional[str] = None, template: ContextTemplate = DEFAULT_TEMPLATE) -> str:
    """The whole, unshared, untruncated prompt as one string: prefix + body + suffix.

    In M0 it is exactly the model card's ``prefix + format_instruction(instruction, query, doc) + suffix``.
    """
    return QWEN3_RERANKER_PREFIX + body_text(query, doc, question, trace, instruction, template) + QWEN3_RERANKER_SUFFIX


@dataclass
class PointwiseEncoding:
    """Token ids of one query's pointwise prompts, split for prefix sharing.

    Attributes:
        shared_ids: prefix tokens + tokens of the body up to and including ``"<Document>:"``
            — the same for every document (truncated, if at all, independently of them).
        segment_ids: per document, ``tokens(" " + doc)`` (cut from its end so that
            ``len(shared_ids) + len(segment) <= max_length``) followed by the suffix tokens.
            Never empty: the suffix is at least 9 tokens.
        mode: "M0".."M3" actually used (after missing fields and a fully dropped trace).
        trace_tokens_dropped: how many of the trace's own tokens (tokenized alone) were
            dropped from its start to fit; 0 when nothing was cut.
        doc_truncated: per document, whether its tail was cut.
        trace_used: the trace text in the prompt (a tail of the given trace when cut; ``None``
            when there is no trace line).
        doc_tokens_dropped: per document, how many of its tokens were cut (a lower bound
            where ``doc_tokens_exact`` is False: only the document's head was tokenized).
        doc_tokens_exact: per document, whether ``doc_tokens_dropped`` is its exact count.
        num_suffix_tokens: length of the suffix at the end of every segment.
        max_length: the cap the encoding was built for.
    """

    shared_ids: list
    segment_ids: list
    mode: str
    trace_tokens_dropped: int
    doc_truncated: list
    doc_tokens_dropped: list = field(default_factory=list)
    doc_tokens_exact: list = field(default_factory=list)
    num_suffix_tokens: int = 0
    max_length: int = DEFAULT_MAX_LENGTH
    trace_used: Optional[str] = None
    cache_salt: Optional[str] = None  # the request's prefix-cache namespace (set by the reranker)

    def input_ids(self, i: int) -> list:
        """Document ``i``'s whole, unshared sequence: ``shared_ids + segment_ids[i]``."""
        return self.shared_ids + self.segment_ids[i]

    def __len__(self) -> int:
        return len(self.segment_ids)


def default_min_doc_tokens(max_length: int) -> int:
    """The document reserve when the caller gives none: 512 tokens, at most half of ``max_length``.

    512 protects a typical retrieval passage from a long trace at the usual caps (8,192); the
    half-cap keeps short caps workable (the model card runs at ``max_length=512``, where a fixed
    512-token reserve plus the prompt's ~60 fixed tokens could never fit).
    """
    return min(DEFAULT_MIN_DOC_TOKENS, max(1, max_length // 2))


def encode_pointwise(tokenizer, query: str, documents: Sequence[str], question: Optional[str] = None,
                     trace: Optional[str] = None, instruction: Optional[str] = None,
                     max_length: int = DEFAULT_MAX_LENGTH, template: ContextTemplate = DEFAULT_TEMPLATE,
                     truncate: bool = True, min_doc_tokens: Optional[int] = None,
                     special_tokens: Optional[str] = None, trace_cut_chunk: int = TRACE_CUT_CHUNK,
                     max_doc_tokens: Optional[int] = None) -> PointwiseEncoding:
    """Tokenize one query's pointwise prompts for N documents, split for prefix sharing.

    ``shared_ids + segment_ids[i]`` equals the model card's construction for document ``i``
    (``tokens(PREFIX) + tokens(body) + tokens(SUFFIX)``, the body tokenized on its own),
    truncated as follows when it would exceed ``max_length``:

    1. the shared part, independently of the documents, must leave room for the suffix and
       ``min_doc_tokens`` document tokens; only the trace is cut, oldest text first, at a token
       boundary, in whole chunks of ``trace_cut_chunk`` of its tokens (so that a growing trace
       keeps its start across calls, see :mod:`acarerank.prompts.truncation`); a trace with no
       token left is dropped and the mode falls to M0/M2; if the fixed strings, instruction,
       question and query alone do not fit: ValueError with counts naming the knobs
       (``max_length``, ``min_doc_tokens``);
    2. each document is cut from its end to the room left (the model card's body truncation).
       Only the head of a long document is tokenized (``TextEncoder.user_heads``: one token past
       the room, at a point where the tokenization provably splits), so its cost is what it
       keeps, not its length; the kept tokens are those of the whole document's tokenization.

    With ``truncate=False`` anything over ``max_length`` raises ValueError naming the field or
    document and the lengths (``min_doc_tokens`` is then not reserved).

    ``max_doc_tokens`` (the rerank APIs' ``max_tokens_per_doc``): each document is first cut to
    that many tokens, a cut the caller asked for, so it applies with ``truncate=False`` too; the
    rules above then see the cut document.

    Args:
        tokenizer: a transformers fast tokenizer, a ``tokenizers.Tokenizer`` or a
            :class:`acarerank.tokenizer.TextEncoder`; it is never called (its state is never
            read or changed): a private read-only copy encodes (``TextEncoder.of``).
        query: the (sub-)query, str. documents: non-empty list of str.
        question, trace: ACARe context (None/empty: missing). instruction: None → default.
        max_length: cap on each document's whole sequence (default 8192).
        template: the M1–M3 context lines.
        min_doc_tokens: document tokens the shared part always leaves room for; None:
            :func:`default_min_doc_tokens` (512, at most ``max_length // 2``).
        special_tokens: "escape" (default: special-token strings in user text are plain text)
            or "parse" (the model card's behaviour, exact parity); see :mod:`acarerank.tokenizer`.

    Returns: :class:`PointwiseEncoding`.

    Costs two tokenizer calls when nothing is cut (prefix, suffix and shared body together; all
    documents in one batch) — not one per document; cutting the trace adds ~3 short ones.
    Thread-safe: any number of threads may encode with the same tokenizer at once.
    """
    from ..tokenizer import TextEncoder

    f = _checked_fields(query, documents, question, trace, instruction, template, max_length, min_doc_tokens,
                        truncate, max_doc_tokens)
    # checked here, not only where a trace is cut: a bad value fails every call, named as the caller wrote it
    trace_cut_chunk = positive_int("trace_cut_chunk", trace_cut_chunk)
    enc = TextEncoder.of(tokenizer, special_tokens)
    prefix_ids, suffix_ids = enc.template([QWEN3_RERANKER_PREFIX, QWEN3_RERANKER_SUFFIX])
    shared_ids, trace_used, trace_dropped = _encode_shared(enc, f, prefix_ids, len(suffix_ids), trace_cut_chunk)
    room = f.max_length - len(shared_ids) - len(suffix_ids)
    segments, truncated, dropped, exact = _encode_documents(enc, f, room, len(shared_ids), suffix_ids)
    return PointwiseEncoding(shared_ids=shared_ids, segment_ids=segments, mode=context_mode(f.question, trace_used),
                             trace_tokens_dropped=trace_dropped, doc_truncated=truncated,
                             doc_tokens_dropped=dropped, doc_tokens_exact=exact, num_suffix_tokens=len(suffix_ids),
                             max_length=f.max_length, trace_used=trace_used)


@dataclass(frozen=True)
class _Fields:
    """``encode_pointwise``'s arguments, checked: missing context fields are None."""
    query: str
    docs: list
    question: Optional[str]
    trace: Optional[str]
    instruction: Optional[str]
    template: ContextTemplate
    max_length: int
    min_doc_tokens: int
    truncate: bool
    max_doc_tokens: Optional[int]

    @property
    def reserve(self) -> int:
        """Document tokens the shared part must leave free (none when nothing may be cut)."""
        return self.min_doc_tokens if self.truncate else 0

    def head(self, trace: Optional[str]) -> str:
        """The shared body text with ``trace`` as the trace line (None: no trace line)."""
        instr = resolve_instruction(self.instruction, context_mode(self.question, trace), self.template)
        return shared_body_text(self.query, self.question, trace, instr, self.template)


def _checked_fields(query, documents, question, trace, instruction, template, max_length, min_doc_tokens,
                    truncate, max_doc_tokens) -> _Fields:
    """Step 1: every argument checked (TypeError / ValueError naming it), missing fields as None."""
    from ..tokenizer import check_text

    query = check_text("query", check_query(query))
    docs = [check_text(f"documents[{i}]", d) for i, d in enumerate(check_documents(documents))]
    q = _check_optional_str("question", question)
    t = _check_optional_str("trace", trace)
    if not isinstance(template, ContextTemplate):
        raise TypeError(f"template must be a ContextTemplate, got {type(template).__name__}")
    # the package's one integer rule (numpy ints as ints, never bools; acarerank._validate), as
    # PointwiseReranker's own arguments, which reach here
    max_length = check_int("max_length", max_length, 1)
    if min_doc_tokens is None:
        min_doc_tokens = default_min_doc_tokens(max_length)
    min_doc_tokens = check_int("min_doc_tokens", min_doc_tokens, 1)
    if not is_bool(truncate):
        raise TypeError(f"truncate must be a bool, got {type(truncate).__name__}")
    if truncate and min_doc_tokens >= max_length:
        # the reserve is kept only when cutting (_Fields.reserve): with truncate=False such a pair scores.
        # Checked first: the later checks blamed whatever came first, e.g. "the query alone is over"
        raise ValueError(f"min_doc_tokens {min_doc_tokens} leaves no room in max_length {max_length}: the prompt's "
                         f"fixed strings need tokens too; raise max_length{MIN_DOC_KNOB}; truncate=False reserves none")
    max_doc_tokens = check_int("max_doc_tokens", max_doc_tokens, 1, allow_none=True)
    if instruction is not None and not isinstance(instruction, str):
        raise TypeError(f"instruction must be a str or None, got {type(instruction).__name__}")
    for name, value in (("question", q), ("trace", t), ("instruction", instruction)):
        if value is not None:
            check_text(name, value)
    return _Fields(query, docs, q, t, instruction, template, max_length, min_doc_tokens, truncate, max_doc_tokens)


def _encode_shared(enc, f: _Fields, prefix_ids: list, n_suffix: int, trace_cut_chunk: int) -> tuple:
    """Step 2: the shared ids, the trace as used and its dropped tokens: ``(shared_ids, trace, dropped)``.

    The shared part may take ``max_length - suffix - reserve`` tokens; over that, the trace is cut
    oldest-first (``cut_oldest``) or, when the never-cut fields alone are over, ValueError.
    """
    budget = f.max_length - n_suffix - f.reserve  # most tokens the shared part may take
    _check_never_cut_heads(enc, f, len(prefix_ids), n_suffix, budget)
    t = f.trace
    if _over_alone(enc, t, budget):  # a huge trace: count the shared part piece by piece, never hold its ids
        head_ids, shared_len = None, len(prefix_ids) + enc.user_count(f.head(t))
    else:
        head_ids = enc.user([f.head(t)])[0]
        shared_len = len(prefix_ids) + len(head_ids)
    trace_dropped = 0
    if shared_len > budget:
        _raise_shared_over(enc, f, prefix_ids, n_suffix, budget, shared_len)  # unless only the trace is over
        t, trace_dropped = cut_oldest(enc, t, lambda tr: len(prefix_ids) + len(enc.user([f.head(tr)])[0]),
                                      budget, current_len=shared_len, chunk=trace_cut_chunk)
        head_ids = enc.user([f.head(t)])[0]
        shared_len = len(prefix_ids) + len(head_ids)
        if shared_len > budget:  # the trace went whole, and its lower mode's instruction is the longer one
            _raise_never_cut(enc, f, n_suffix, shared_len)
        assert shared_len <= budget, (shared_len, budget)  # cut_oldest verified it; guard the invariant
    return list(prefix_ids) + list(head_ids), t, trace_dropped


def _over_alone(enc, text: Optional[str], budget: int) -> bool:
    """Whether ``text`` alone is over ``budget`` tokens, from its head only (long texts only)."""
    from ..tokenizer import HEAD_CHARS_PER_TOKEN

    if text is None or len(text) <= (budget + 1) * HEAD_CHARS_PER_TOKEN:
        return False
    ids, _, complete = enc.user_heads([text], budget + 1)[0]
    # a text with no split point comes back whole ("complete") however long it is
    return not complete or len(ids) > budget


def _check_never_cut_heads(enc, f: _Fields, n_prefix: int, n_suffix: int, budget: int) -> None:
    """ValueError, before the shared body is tokenized, when the query, question or instruction
    alone is over the budget: only their heads are tokenized, so a huge one costs the budget's tokens."""
    from ..tokenizer import HEAD_CHARS_PER_TOKEN

    n = max(budget - n_prefix, 0) + 1
    values = [(name, v) for name, v in (("query", f.query), ("question", f.question), ("instruction", f.instruction))
              if v is not None and len(v) > n * HEAD_CHARS_PER_TOKEN]  # shorter ones: the usual check below
    if not values:
        return
    for (name, _), (ids, _, complete) in zip(values, enc.user_heads([v for _, v in values], n)):
        if not complete:
            tail = f" + min_doc_tokens {f.min_doc_tokens}" if f.truncate else ""
            knob = MIN_DOC_KNOB if f.truncate else ""
            raise ValueError(
                f"the query and question are never truncated, but the {name} alone is over the shared context's "
                f"room ({name} {len(ids)}+ tokens; prefix {n_prefix} + suffix {n_suffix}{tail} leave {n - 1} of "
                f"max_length={f.max_length}). Shorten the query/question or raise max_length" + knob)


def _raise_shared_over(enc, f: _Fields, prefix_ids: list, n_suffix: int, budget: int, shared_len: int) -> None:
    """The shared part is over its budget: ValueError naming what is over (fixed strings, the
    never-cut fields, or the trace when nothing may be cut); returns when cutting the trace can fit it."""
    q, t = f.question, f.trace
    reserve = f.reserve
    tail = f" + min_doc_tokens {f.min_doc_tokens}" if f.truncate else ""
    knob = MIN_DOC_KNOB if f.truncate else ""
    empty_head = shared_body_text("", "" if q is not None else None, "" if t is not None else None, "", f.template)
    fixed = len(prefix_ids) + len(enc.user([empty_head])[0])
    if fixed + n_suffix + reserve > f.max_length:
        raise ValueError(
            f"max_length={f.max_length} is too small for the prompt's fixed strings: prefix and "
            f"{context_mode(q, t)} body template {fixed} + suffix {n_suffix}{tail} = "
            f"{fixed + n_suffix + reserve} tokens; raise max_length" + knob)
    base = len(prefix_ids) + len(enc.user([f.head(None)])[0])
    if base > budget:
        # Without its trace line the prompt drops a mode (M1 -> M0), and M0's instruction is the model
        # card's: a ContextTemplate.context_instruction shorter than it can make a cut trace fit where
        # no trace does, so then cutting decides (``_encode_shared`` raises if the trace goes whole).
        instr = resolve_instruction(f.instruction, context_mode(q, "trace"), f.template)
        if instr == resolve_instruction(f.instruction, context_mode(q, None), f.template) or \
                len(prefix_ids) + len(enc.user([shared_body_text(f.query, q, "", instr, f.template)])[0]) > budget:
            _raise_never_cut(enc, f, n_suffix, base)
    if not f.truncate:  # only the trace is over
        n_trace = enc.user_count(t)
        raise ValueError(
            f"trace is {n_trace} tokens; with it the shared context is {shared_len} tokens + suffix {n_suffix} "
            f"= {shared_len + n_suffix} > max_length={f.max_length} (truncate=False)")


def _raise_never_cut(enc, f: _Fields, n_suffix: int, base: int) -> None:
    """ValueError: the shared part without its trace line (``base`` tokens) is over its budget."""
    q = f.question
    tail = f" + min_doc_tokens {f.min_doc_tokens}" if f.truncate else ""
    knob = MIN_DOC_KNOB if f.truncate else ""
    n_query, n_question, n_instr = (len(x) for x in enc.user(
        [f.query, q or "", resolve_instruction(f.instruction, context_mode(q, None), f.template)]))
    raise ValueError(
        f"the query and question are never truncated, but with the instruction and fixed strings they "
        f"make a {base}-token shared context (query {n_query}, question {n_question}, "
        f"instruction {n_instr} tokens); with suffix {n_suffix}{tail} that exceeds "
        f"max_length={f.max_length}. Shorten the query/question or raise max_length" + knob)


def _encode_documents(enc, f: _Fields, room: int, shared_len: int, suffix_ids: list) -> tuple:
    """Step 3: each document's segment ``tokens(" " + doc)[:keep] + suffix``, keep = the room, or
    the caller's ``max_doc_tokens`` when that fits in it; returns (segments, truncated, tokens
    dropped, whether each dropped count is exact).

    ``max_doc_tokens`` counts the document's own tokens as they are in the prompt: the tokens of
    ``" " + doc`` that hold any of its characters. The separator usually merges into the first
    one (``" hello"``), but before a digit or a space it is a token of its own (``" "``, ``"1"``),
    which is the prompt's, not the document's: it does not count. The room (``max_length``)
    counts every token.

    One token past ``keep`` tells a cut from a fit, so only that head of a long document is
    tokenized; its dropped count is then a lower bound (the rest was never tokenized). A cut to
    ``max_doc_tokens`` was asked for: never an error, ``truncate`` or not, when it fits."""
    cap = f.max_doc_tokens
    heads = enc.user_heads([DOC_SEP + d for d in f.docs], (room if cap is None else min(cap + 1, room)) + 1,
                           offsets=cap is not None)
    segments, truncated, dropped, exact = [], [], [], []
    for i, (doc_ids, offsets, complete) in enumerate(heads):
        keep, asked = room, False
        if cap is not None:
            # a first token spanning only the separator's characters is not the document's
            sep = 1 if offsets and offsets[0][1] <= len(DOC_SEP) else 0
            asked = cap + sep <= room  # the caller's cut makes it fit
            keep = cap + sep if asked else room
        if len(doc_ids) > room and not asked and not f.truncate:
            at_least = "" if complete else "at least "
            raise ValueError(
                f"documents[{i}] is {at_least}{len(doc_ids)} tokens; shared context {shared_len} + document "
                f"{at_least}{len(doc_ids)} + suffix {len(suffix_ids)} = {at_least}"
                f"{shared_len + len(doc_ids) + len(suffix_ids)} > max_length={f.max_length} (truncate=False)")
        doc_ids, n_cut = cut_tail(doc_ids, keep)
        segments.append(list(doc_ids) + list(suffix_ids))
        truncated.append(n_cut > 0)
        dropped.append(n_cut)
        exact.append(complete)
    return segments, truncated, dropped, exact
