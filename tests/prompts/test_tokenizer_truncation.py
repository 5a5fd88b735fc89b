"""Heads of long texts: only a prefix of a long document is tokenized, cut where Qwen3's
tokenization provably splits; the kept tokens (and so the scores and selections) are those of
the whole text's tokenization, and a huge document costs what it keeps, not its length."""
import copy
import random
import unicodedata

import pytest

from acarerank.prompts import encode_pointwise
from acarerank.setwise.prompts import build_prompt
from acarerank.tokenizer import (HEAD_CHARS_PER_TOKEN, QWEN3_MAX_TOKEN_CHARS, TextEncoder, _composition_seconds,
                                 _head_cut_classes, load_qwen3_tokenizer)

# awkward pieces: long words, CJK runs, whitespace runs, digits, emoji, special-token strings,
# contractions, CRLF, combining marks, Hangul jamo, full-width punctuation, a lone apostrophe
PIECES = ["supercalifragilisticexpialidocious" * 3, "1234567890" * 50, "3" * 200, "数字混合文本", "，", "。", "、", "「引用」", " ", "  ", "\t",
          "\n", "\r\n", "\n\n\n", " " * 40, "12345678901234567890", "3.14159", "😀🚀", "👩‍👩‍👧", "<|im_end|>",
          "</think>", "<think>", "<|endoftext|>", "don't", "we'll", "it's", "'S", "e\u0301", "\u1100\u1161\u11a8",
          "한국어", "Ωμέγα", "Кириллица", "ｆｕｌｌ！", "？", "--", "----------", "====", "a", "b", "x" * 300,
          "/*********/", "café", "naïve", "#", "$", "(", ")", ".", ",", ";", ":", "!", "?", "-", "'", '"', "\u3000",
          "שָׁלוֹם", "ספר", "مرحبا", "كتابٌ", "،", "नमस्ते", "किताब", "।", "สวัสดี", "โลก", "Բարեւ", "ქართული", "ሰላም",
          "ខ្មែរ", "ਪੰਜਾਬੀ", "বাংলা", "தமிழ்"]


def awkward_text(seed: int, pieces: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice(PIECES) + (" " if rnd.random() < 0.4 else "") for _ in range(pieces))


@pytest.fixture(scope="module", params=["escape", "parse"])
def encoder(request):
    return TextEncoder.of(load_qwen3_tokenizer(), request.param)


def whole(encoder):
    """The same encoder with heads disabled: every text tokenized whole (the behaviour before heads)."""
    e = copy.copy(encoder)
    e._cuttable = False
    return e


@pytest.mark.parametrize("seed", range(12))
def test_heads_are_exact_prefixes_of_the_whole_tokenization(encoder, seed):
    text = awkward_text(seed, 600)
    ids_all, offsets_all = encoder.user_offsets(text)
    for n in (1, 7, 50, 333, len(ids_all) - 1, len(ids_all), len(ids_all) + 5):
        if n < 1:
            continue
        ids, offsets, complete = encoder.user_heads([text], n, offsets=True)[0]
        assert ids == ids_all[:len(ids)], f"seed {seed} n {n}: the head's tokens differ from the whole text's"
        assert offsets == offsets_all[:len(ids)], f"seed {seed} n {n}: offsets differ"
        if complete:
            assert ids == ids_all
        else:
            assert n <= len(ids) < len(ids_all), (n, len(ids), len(ids_all))
        if n * HEAD_CHARS_PER_TOKEN < len(text) and n < len(ids_all) // 4:
            assert not complete, f"seed {seed} n {n}: a long text was tokenized whole"


def test_every_letter_stop_pair_is_a_pre_token_and_normalization_boundary(encoder):
    """The cut rule's premises, checked over its whole character classes: letters and stops
    are NFC-inert starters that compose with nothing, no added token holds a stop (parse mode) or
    a digit, and the tokenizer's own pre-tokenizer and normalizer split between every letter and
    a few stops, and between each digit or letter and every stop (and a digit and a letter or digit)."""
    import re

    letters_cls, stops_cls = _head_cut_classes(encoder.special_tokens)
    # each class matches one character: its matches in the run of all code points are its members
    every = "".join(map(chr, range(0x30000)))
    letters, stops = re.findall(letters_cls, every), re.findall(stops_cls, every)
    assert len(letters) > 20000 and len(stops) >= 6
    seconds, letter_set = _composition_seconds(), set(letters)
    for c in letters + stops:
        assert c.isalpha() == (c in letter_set), hex(ord(c))
        assert unicodedata.combining(c) == 0 and unicodedata.is_normalized("NFC", c) and c not in seconds, hex(ord(c))
    assert not any(d in t for t in encoder.added_tokens for d in "0123456789")
    if encoder.special_tokens == "parse":
        assert not any(s in t for t in encoder.added_tokens for s in stops)
    backend = encoder._backend

    def split_at(text, cut):
        norm = backend.normalizer.normalize_str(text)
        assert norm[:cut] == backend.normalizer.normalize_str(text[:cut]), repr(text)
        spans = [o for _, o in backend.pre_tokenizer.pre_tokenize_str(norm)]
        assert any(e == cut for _, e in spans), (repr(text), spans)

    rnd = random.Random(0)
    sample = letters[::97] + [rnd.choice(letters) for _ in range(200)]
    for s in stops:
        for a in sample[:: max(1, len(sample) // 60)] + list("0123456789"):
            for before in ("", "'", "x", "\u0301", " ", "1"):
                split_at(before + a + s + "'s" + a, len(before) + 1)
    for d in "0123456789":
        for after in sample + list("0123456789"):
            for before in ("", "a", " ", "9", "'"):
                split_at(before + d + after + "x", len(before) + 1)
    for s in stops[:: max(1, len(stops) // 3)]:  # every letter, against a few stops
        for a in letters:
            spans = [o for _, o in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(a + s))]
            assert spans[0] == (0, 1), (hex(ord(a)), repr(s), spans)


def test_max_token_chars_is_the_vocabulary_s():
    e = TextEncoder.of(None)
    longest = max(len(e.decode([i], skip_special_tokens=False)) for i in range(151643))
    assert longest == QWEN3_MAX_TOKEN_CHARS


def test_pointwise_encoding_equals_the_whole_tokenization(encoder):
    """Documents that fit: the same ids (bitwise-equal scores follow); documents cut: the same kept
    tokens, the cut flagged, the dropped count a lower bound marked inexact."""
    docs = [awkward_text(s, 40 + 400 * (s % 3)) for s in range(9)] + ["short", "数字" * 3000, " " * 5000]
    for max_length in (200, 700, 4096):
        got = encode_pointwise(encoder, "which tutor hints help?", docs, question="Q?", trace="step 1. step 2.",
                               max_length=max_length)
        want = encode_pointwise(whole(encoder), "which tutor hints help?", docs, question="Q?",
                                trace="step 1. step 2.", max_length=max_length)
        assert got.shared_ids == want.shared_ids
        for i in range(len(docs)):
            assert got.segment_ids[i] == want.segment_ids[i], f"max_length {max_length}: documents[{i}] differs"
            assert got.doc_truncated[i] == want.doc_truncated[i]
            if got.doc_tokens_exact[i]:
                assert got.doc_tokens_dropped[i] == want.doc_tokens_dropped[i]
            else:
                assert got.doc_truncated[i] and 1 <= got.doc_tokens_dropped[i] <= want.doc_tokens_dropped[i]
        if max_length < 4096:
            assert not all(got.doc_tokens_exact), "no document was cut before tokenizing: the test proves nothing"


def test_setwise_prompt_equals_the_whole_tokenization(encoder):
    docs = [awkward_text(s, 30 + 3000 * (s % 2)) for s in range(6)] + ["tiny"]
    assert not all(c for _, _, c in encoder.user_heads(docs, 2501)), "no head cut: the test proves nothing"
    for max_length in (2500, 6000, 16000):
        got = build_prompt(encoder, "which passages?", docs, "the agent wants tutor hints", 3, max_length)
        want = build_prompt(whole(encoder), "which passages?", docs, "the agent wants tutor hints", 3, max_length)
        assert (got.input_ids, got.text, got.doc_token_budget, got.truncated) == \
            (want.input_ids, want.text, want.doc_token_budget, want.truncated), max_length


def _huge(chars: int) -> str:
    unit = "Agents call rerankers with long traces; 数字 12345, tutor hints! "
    return unit * (chars // len(unit) + 1)


class _CountingBackend:
    """The encoder's tokenizers backend, counting the characters handed to it (the work done) and
    the longest text handed to it at once (what one encoding holds)."""

    def __init__(self, backend):
        self._backend, self.chars, self.longest = backend, 0, 0

    def encode(self, text, **kw):
        self.chars += len(text)
        self.longest = max(self.longest, len(text))
        return self._backend.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.chars += sum(map(len, texts))
        self.longest = max([self.longest] + [len(t) for t in texts])
        return self._backend.encode_batch(texts, **kw)

    def __getattr__(self, name):
        return getattr(self._backend, name)


def _counting(monkeypatch, special_tokens="escape"):
    """The default encoder of that mode with its backend counting characters tokenized (restored after)."""
    enc = TextEncoder.of(None, special_tokens)
    counter = _CountingBackend(enc._backend)
    monkeypatch.setattr(enc, "_backend", counter)
    return enc, counter


@pytest.fixture
def counted(monkeypatch):
    return _counting(monkeypatch)


# a head is bounded by the cap's tokens, not the text: at most 16 characters per kept token of the
# 8,192 (measured: ~49k characters for a 30 MB document, ~96k for a setwise prompt's two passes)
HEAD_WORK_CHARS = 16 * 8192


def test_a_30_mb_document_costs_its_kept_tokens(counted):
    """truncate=False: rejected after counting past the cap only; truncate=True: cost ~ the cap's
    tokens, never the document's 30M characters (counted as characters handed to the tokenizer)."""
    enc, counter = counted
    doc = _huge(30_000_000)
    with pytest.raises(ValueError, match=r"documents\[0\] is at least \d+ tokens.*truncate=False"):
        encode_pointwise(enc, "q", [doc], max_length=8192, truncate=False)
    reject_chars, counter.chars = counter.chars, 0
    got = encode_pointwise(enc, "q", [doc, "short"], max_length=8192)
    cut_chars, counter.chars = counter.chars, 0
    assert got.doc_truncated == [True, False] and got.doc_tokens_exact == [False, True]
    want = enc.user([" " + doc[:200_000]])[0]  # the whole tokenization's head (splits at a space)
    n_keep = len(got.segment_ids[0]) - got.num_suffix_tokens
    assert got.segment_ids[0][:n_keep] == want[:n_keep]
    assert reject_chars <= HEAD_WORK_CHARS and cut_chars <= HEAD_WORK_CHARS, (reject_chars, cut_chars, len(doc))
    digits = "1234567890" * 3_000_000  # no letter at all: cut between digits
    counter.chars = 0
    with pytest.raises(ValueError, match=r"documents\[0\] is at least \d+ tokens"):
        encode_pointwise(enc, "q", [digits], max_length=8192, truncate=False)
    assert counter.chars <= HEAD_WORK_CHARS, (counter.chars, len(digits))


def test_huge_never_cut_fields_are_refused_after_their_heads(counted):
    """A query (pointwise, setwise) or intent (setwise) over the cap is refused after tokenizing
    about the cap's tokens (not the field's 20M characters), naming the field."""
    enc, counter = counted
    huge = _huge(20_000_000)
    for call, field in ((lambda: encode_pointwise(enc, huge, ["d"]), "query"),
                        (lambda: encode_pointwise(enc, "q", ["d"], question=huge), "question"),
                        (lambda: build_prompt(enc, huge, ["d"]), "query"),
                        (lambda: build_prompt(enc, "q", ["d"], intent=huge), "intent")):
        counter.chars = 0
        with pytest.raises(ValueError, match=f"{field}.*never truncated|never truncated.*{field}"):
            call()
        assert counter.chars <= HEAD_WORK_CHARS, (field, counter.chars)



def test_a_dense_document_costs_its_kept_tokens_not_six_times_them(counted):
    """Documents of one token per character (digits) shorter than 6 characters per kept token:
    each costs about the tokens it keeps, pointwise and setwise, with the whole tokenization's
    head. Such documents were tokenized whole (the head's first reach was 6 characters a token):
    200 of 48,000 digits under max_length 8,192 took 30 s and 856 MB to keep 1.6 M tokens."""
    enc, counter = counted
    docs = [("1234567890" * 4800)[:-1] + str(i) for i in range(3)]  # 48,000 characters, < 6 × 8,192
    want = [enc.user([" " + d])[0] for d in docs]
    counter.chars = 0
    got = encode_pointwise(enc, "q", docs, max_length=8192)
    kept = [len(s) - got.num_suffix_tokens for s in got.segment_ids]
    assert got.doc_truncated == [True] * 3 and all(k > 8000 for k in kept), kept
    assert [s[:k] for s, k in zip(got.segment_ids, kept)] == [w[:k] for w, k in zip(want, kept)]
    assert counter.chars <= 2 * sum(kept), (counter.chars, sum(kept), sum(map(len, docs)))
    setwise_docs = ["1234567890" * 9000] * 2  # 90,000 characters, < 6 × 16,001 (the default cap + 1)
    counter.chars = 0
    prompt = build_prompt(enc, "q", setwise_docs, max_length=16000)
    assert prompt.truncated == [True, True]
    # the heads, then the prompt rendered from them and from the cut documents (module docstring of
    # acarerank.setwise.prompts): about 3.5 heads' worth; the documents whole were 180,000 more
    assert counter.chars <= 4 * 2 * 16001, (counter.chars, sum(map(len, setwise_docs)))


# words of scripts beyond Latin, Greek, Cyrillic, kana, CJK and Hangul: a text of them had no split
# point, so it was tokenized whole (4 M characters of Hindi: 18.8 s and +1.5 GB to keep 8,192 tokens)
SCRIPT_WORDS = {"arabic": ["مرحبا", "العالم", "كتاب", "في"], "hebrew": ["שלום", "עולם", "ספר"],
                "hindi": ["नमस्ते", "दुनिया", "किताब"], "thai": ["สวัสดี", "โลก", "หนังสือ"],
                "armenian": ["Բարեւ", "աշխարհ"], "bengali": ["বাংলা", "বই", "আমার"]}


def _script_text(words, sep: str, chars: int, seed: int = 0) -> str:
    rnd = random.Random(seed)
    return sep.join(rnd.choice(words) for _ in range(chars // 3))[:chars]


@pytest.mark.parametrize("script", sorted(SCRIPT_WORDS) + ["chinese-parse"])
def test_other_scripts_cost_their_kept_tokens(script, monkeypatch):
    """A document in Arabic, Hebrew, Hindi, Thai... (and Chinese with its own punctuation in "parse"
    mode) costs about the tokens it keeps, with the whole tokenization's head."""
    if script == "chinese-parse":
        enc, counter = _counting(monkeypatch, "parse")
        doc = _script_text(["你好世界。", "今天天气很好，", "文档检索"], "", 60_000)
    else:
        enc, counter = _counting(monkeypatch)
        doc = _script_text(SCRIPT_WORDS[script], " ", 60_000)
    want = enc.user([" " + doc])[0]
    counter.chars = 0
    got = encode_pointwise(enc, "q", [doc], max_length=1024)
    n_keep = len(got.segment_ids[0]) - got.num_suffix_tokens
    assert got.doc_truncated == [True] and got.segment_ids[0][:n_keep] == want[:n_keep], script
    assert counter.chars <= 16 * 1024, f"{script}: {counter.chars} characters tokenized to keep {n_keep} tokens"


def test_a_long_arabic_trace_is_counted_in_pieces(encoder, monkeypatch):
    """A trace over its room is counted piece by piece; an Arabic one had no split point and was
    tokenized whole, three times (4 M characters: 28 s and +1.1 GB). The result is the whole
    tokenization's."""
    import acarerank.tokenizer as tk

    monkeypatch.setattr(tk, "PIECE_CHARS", 4096)
    trace = _script_text(SCRIPT_WORDS["arabic"], " ", 40_000)
    kw = dict(question="Which tutor?", trace=trace, max_length=2048)
    want = encode_pointwise(whole(encoder), "q", ["d"], **kw)
    counter = _CountingBackend(encoder._backend)
    monkeypatch.setattr(encoder, "_backend", counter)
    got = encode_pointwise(encoder, "q", ["d"], **kw)
    assert (got.shared_ids, got.trace_used, got.trace_tokens_dropped) == \
        (want.shared_ids, want.trace_used, want.trace_tokens_dropped)
    assert got.trace_tokens_dropped > 0
    assert counter.longest <= 3 * 4096, f"{counter.longest} characters of a {len(trace)}-character trace at once"


def test_a_text_with_no_split_point_over_the_budget_is_over_alone():
    """``_over_alone``: a text with no split point comes back whole ("complete") from
    ``user_heads``; over the budget it is over, and is then counted in pieces, never held as ids."""
    from acarerank.prompts.pointwise import _over_alone

    enc = TextEncoder.of(None)
    word = "नमस्ते" * 20_000  # one word, no stop: tokenized whole
    n = enc.user_count(word)
    assert enc.user_heads([word], 1001)[0][2], "the text has a split point: the test proves nothing"
    assert n > 1000, n
    assert _over_alone(enc, word, 1000), f"a {n}-token text was not over a budget of 1,000"
    assert not _over_alone(enc, word, n)


@pytest.mark.parametrize("token", ["hello world", "hello。world", "he11o"])
def test_an_added_token_holding_a_stop_or_digit_is_never_cut_in_parse_mode(token):
    """In "parse" mode an added token is matched in the raw text: one holding a stop or a digit
    could straddle a cut (module docstring of acarerank.tokenizer), so such a tokenizer's texts
    are tokenized whole there, and the heads keep the whole tokenization's ids."""
    from tokenizers import AddedToken, Tokenizer

    from acarerank.tokenizer import qwen3_tokenizer_dir

    backend = Tokenizer.from_file(qwen3_tokenizer_dir() + "/tokenizer.json")
    backend.add_tokens([AddedToken(token, normalized=False)])
    enc = TextEncoder(backend, "parse")
    text = " ".join([token] * 3000)
    ids_all = enc.user([text])[0]
    assert enc.added_tokens[token] in ids_all
    for n in (100, 101, 333, 1000):
        ids = enc.user_heads([text], n)[0][0]
        assert ids == ids_all[:len(ids)], f"{token!r} n {n}: the head's tokens differ from the whole text's"


@pytest.mark.parametrize("seed", range(4))
def test_pieces_concatenate_to_the_whole_tokenization(encoder, seed):
    text = awkward_text(seed, 1500)
    ids_all, offsets_all = encoder.user_offsets(text)
    for piece_chars in (1, 300, 5000, len(text) + 1):
        pieces = list(encoder.user_pieces(text, piece_chars))
        assert [i for _, e in pieces for i in e.ids] == ids_all, (seed, piece_chars)
        assert [(a + s, b + s) for s, e in pieces for a, b in e.offsets] == offsets_all, (seed, piece_chars)
        assert encoder.user_count(text) == len(ids_all)
        if piece_chars == 300:
            assert len(pieces) > 5, "the text was never cut into pieces: the test proves nothing"


@pytest.mark.parametrize("chunk", [1, 64, 512])
def test_long_trace_cut_piecewise_equals_the_whole_tokenization(encoder, chunk, monkeypatch):
    """A trace far over its room is counted piece by piece (bounded memory); the kept trace, the
    dropped count and the shared ids are those the whole tokenization gives."""
    import acarerank.tokenizer as tk

    monkeypatch.setattr(tk, "PIECE_CHARS", 4096)
    trace = awkward_text(11, 4000)
    for max_length in (1000, 4096):
        kw = dict(question="Which tutor?", trace=trace, max_length=max_length, trace_cut_chunk=chunk)
        got = encode_pointwise(encoder, "q", ["d"], **kw)
        want = encode_pointwise(whole(encoder), "q", ["d"], **kw)
        assert (got.shared_ids, got.trace_used, got.trace_tokens_dropped, got.mode) == \
            (want.shared_ids, want.trace_used, want.trace_tokens_dropped, want.mode), (chunk, max_length)
        assert got.trace_tokens_dropped > 0
    with pytest.raises(ValueError, match=r"trace is \d+ tokens"):
        encode_pointwise(encoder, "q", ["d"], trace=trace, max_length=1000, truncate=False)


def test_a_huge_word_is_tokenized_without_holding_the_gil(encoder):
    """A text with no split point is tokenized whole (module docstring). The tokenizers library's
    ``encode`` of one text held the GIL throughout: 4 M characters of one word froze the server's
    event loop (its /health) for 3 s and more while a tokenizer worker ran it. Here another thread
    keeps running meanwhile (its worst gap between 10 ms sleeps stays far below the encode's time)."""
    import threading
    import time

    word = "y" * 3_000_000
    done, took = threading.Event(), {}

    def work():
        t0 = time.monotonic()
        heads = encoder.user_heads([word], 8193)
        took["s"] = time.monotonic() - t0
        took["complete"] = heads[0][2]
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    worst, last = 0.0, time.monotonic()
    while not done.is_set():
        time.sleep(0.01)
        now = time.monotonic()
        worst, last = max(worst, now - last), now
    worker.join()
    assert took["complete"], "a word with no split point is tokenized whole"
    assert took["s"] > 1.0, f"the encode took {took['s']:.2f} s: too quick to show anything"
    assert worst < min(0.5, took["s"] / 2), f"another thread stalled {worst:.2f} s of the encode's {took['s']:.2f} s"
