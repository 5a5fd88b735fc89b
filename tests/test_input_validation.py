"""Clear, documented errors (or correct results) for the odd inputs a new user sends."""
import json

import numpy as np
import pytest
import torch

from _tiny import tiny_causal
from acarerank import PointwiseReranker, ScoreRequest
from acarerank.ato.reward import JudgeOutputError, rubric_reward
from acarerank.ops import linear_logprob, prefix_shared_attention, topk_logprobs
from acarerank.ops.attention import prefix_shared_attention_ref
from acarerank.prompts import encode_pointwise, official_batch_input_ids
from acarerank.setwise.selection import parse_selection
from acarerank.setwise import SetwiseReranker
from acarerank.setwise.prompts import build_prompt

DOCS = ["alpha beta", "gamma delta", "the answer is 42"]


@pytest.fixture(scope="module")
def model():
    return tiny_causal(seed=3, tie=True)


@pytest.fixture(scope="module")
def rr(model):
    return PointwiseReranker(model=model)


def test_score_batch_accepts_dicts_and_tuples(rr):
    """Dicts and tuples give the scores of the same ScoreRequests. The second call finds the
    prefixes in the prefix cache and recomputes only the tail of a partly filled block, in another
    batch shape and (native CPU attention) another key tiling than the cold prefill — prefix tiles
    + own keys instead of one causal run — so the scores agree to fp32 rounding, not bit for bit."""
    want = rr.score_batch([ScoreRequest("q", DOCS, question="why?"), ScoreRequest("r", DOCS[:2])])
    got = rr.score_batch([{"query": "q", "documents": DOCS, "question": "why?"}, ("r", DOCS[:2])])
    assert len(got) == len(want) and all(len(g) == len(w) for g, w in zip(got, want))
    for g, w in zip(got, want):
        assert torch.allclose(torch.tensor(g), torch.tensor(w), rtol=1e-5, atol=0), (g, w)
    with pytest.raises(TypeError, match=r"requests\[0\]"):
        rr.score_batch([{"query": "q", "docs": DOCS}])
    with pytest.raises(TypeError, match=r"requests\[1\]"):
        rr.score_batch([("q", DOCS), "q"])
    with pytest.raises(TypeError, match="list of ScoreRequest"):
        rr.score_batch(ScoreRequest("q", DOCS))


@pytest.mark.parametrize("salt", [b"tenant", ["tenant"], 7])
def test_cache_salt_of_score_batch_must_be_a_str(rr, salt):
    """The same check as ScoreRequest.cache_salt's, before any work (an unhashable salt used to
    fail as a bare TypeError from the cache's dict lookup, a bytes salt to be used as given)."""
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got"):
        rr.score_batch([ScoreRequest("q", DOCS)], cache_salt=salt)
    with pytest.raises(TypeError, match="cache_salt must be a str or None, got"):
        rr.score_batch([ScoreRequest("q", DOCS, cache_salt=salt)])


def test_top_n_integers(rr):
    assert rr.rerank("q", DOCS, top_n=np.int64(1)) == rr.rerank("q", DOCS, top_n=1)
    with pytest.raises(ValueError, match="top_n"):
        rr.rerank("q", DOCS, top_n=True)


def test_lone_surrogate_names_the_field(rr, model):
    with pytest.raises(ValueError, match=r"documents\[1\] is not valid Unicode"):
        rr.score("q", ["fine", "bad \ud800 text"])
    with pytest.raises(ValueError, match="trace is not valid Unicode"):
        rr.score("q", ["fine"], trace="\udfff")
    with pytest.raises(ValueError, match=r"documents\[0\] is not valid Unicode"):
        SetwiseReranker(model=model).select("q", ["\ud800"])


class _ChangedAfterFirstRead(list):
    """A document list another thread changes right after the call first reads it whole: every
    later read sees ``later``."""

    def __init__(self, items, later):
        super().__init__(items)
        self.later, self.reads = later, 0

    def __iter__(self):
        self.reads += 1
        return super().__iter__() if self.reads == 1 else iter(self.later)


@pytest.mark.parametrize("later", [[5, "x", "y"], [None] * 3, [b"bytes", "x", "y"], ["bad \ud800"] * 3,
                                   DOCS + ["more"] * 50], ids=["int", "None", "bytes", "surrogate", "grown"])
def test_a_list_changed_during_the_call_is_used_as_it_was_checked(rr, model, later):
    """The documents were checked, then read again to be encoded: an int put in by another thread
    meanwhile was AttributeError: 'int' object has no attribute 'isascii' (bytes: a TypeError about
    str concatenation; a grown setwise list: a message counting the old length). The list is read
    once; the call scores (selects from) the documents as checked."""
    want = rr.score("q", list(DOCS))
    got = rr.score("q", _ChangedAfterFirstRead(DOCS, later))
    assert len(got) == len(want) and torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0), \
        (got, want)
    sr = SetwiseReranker(model=model)
    want = sr.select("q", list(DOCS), max_select=2)
    assert sr.select("q", _ChangedAfterFirstRead(DOCS, later), max_select=2) == want
    assert sr.select_batch(["q"], [_ChangedAfterFirstRead(DOCS, later)], max_select=2) == [want]


def test_empty_intent_is_no_intent(qwen3_tokenizer):
    rag = build_prompt(qwen3_tokenizer, "q", ["a", "b"], None).input_ids
    assert build_prompt(qwen3_tokenizer, "q", ["a", "b"], "").input_ids == rag
    assert build_prompt(qwen3_tokenizer, "q", ["a", "b"], "  ").input_ids == rag
    assert build_prompt(qwen3_tokenizer, "q", ["a", "b"], "why").input_ids != rag


def test_max_length_512_works_like_the_model_card(qwen3_tokenizer):
    long_doc = " ".join(f"word{i}" for i in range(700))
    docs = ["short", long_doc]
    enc = encode_pointwise(qwen3_tokenizer, "query", docs, max_length=512)   # default reserve: 256 here
    card = official_batch_input_ids(qwen3_tokenizer, "query", docs, max_length=512)
    assert [enc.input_ids(i) for i in range(2)] == card
    # the reserve is the knob when a long context has to be cut
    enc = encode_pointwise(qwen3_tokenizer, "query", docs, trace="thinking " * 600, max_length=512, min_doc_tokens=100)
    assert len(enc.input_ids(1)) == 512 and enc.trace_tokens_dropped > 0


def test_max_select_above_15_names_the_knob(model):
    docs = [f"doc {i}" for i in range(20)]
    with pytest.raises(ValueError, match="raise max_new_tokens"):
        SetwiseReranker(model=model).select("q", docs, max_select=16)
    sel = SetwiseReranker(model=model, max_new_tokens=65, max_length=800).select("q", docs, max_select=16)
    assert sel.valid and 1 <= len(sel.ids) <= 16


class _CountingPattern:
    """A compiled pattern that records where each ``match`` / ``finditer`` starts (the scan's work)."""

    def __init__(self, pattern):
        self._pattern, self.starts, self.scans = pattern, [], 0

    def match(self, text, pos=0):
        self.starts.append(pos)
        return self._pattern.match(text, pos)

    def finditer(self, text, *args):
        self.scans += 1
        return self._pattern.finditer(text, *args)


def test_parse_selection_linear_and_total(monkeypatch):
    """60,000 ids parse in one left-to-right scan: the strict parse matches each entry once, at the
    position the previous one ended (+1 for the space), and the lenient parse scans the text once."""
    import acarerank.setwise.selection as selection
    strict, lenient = (_CountingPattern(selection._STRICT_ENTRY), _CountingPattern(selection._LENIENT_ENTRY))
    monkeypatch.setattr(selection, "_STRICT_ENTRY", strict)
    monkeypatch.setattr(selection, "_LENIENT_ENTRY", lenient)
    n = 60_000
    entries = [f"[{i}]" for i in range(1, n + 1)]
    text = " ".join(entries)
    assert parse_selection(text, n, None).ids[-1] == n
    want_starts, pos = [], 0
    for e in entries:
        want_starts.append(pos)
        pos += len(e) + 1
    assert strict.starts == want_starts, "the strict parse re-scans the text"
    strict.starts.clear()
    assert len(parse_selection(text + " junk", n, None, strict=False).ids) == n
    assert lenient.scans == 1 and strict.starts == want_starts + [pos], (lenient.scans, len(strict.starts))
    huge = "[" + "9" * 4301 + "]"
    for strict in (True, False):
        r = parse_selection(huge + " [1]", 5, strict=strict)
        assert not r.valid and "out of range" in r.error
    assert parse_selection(huge + " [1]", 5, strict=False).ids == [1]
    with pytest.raises(TypeError, match="strict"):
        parse_selection("[1]", 5, strict="no")


RUBRICS = {"Relevance": [{"rubric": "on topic", "weight": 2}]}
JUDGE = {"score": {"Relevance": {"level": "doc", "rubrics": [{"rubric": "on topic", "per_doc": [
    {"doc_id": 1, "score": 8}, {"doc_id": 2, "score": 4}]}]}}}


def test_rubric_reward_strict_types_and_one_error_type():
    assert rubric_reward(JUDGE, RUBRICS, [1, 2]) == 6.0
    assert rubric_reward(JUDGE, RUBRICS, (np.int64(1),)) == 8.0
    with pytest.raises(TypeError, match="ParsedSelection"):
        rubric_reward(JUDGE, RUBRICS, "12")        # main: read as ids [1, 2], reward 6.0
    with pytest.raises(TypeError, match="ints"):
        rubric_reward(JUDGE, RUBRICS, [1.7])       # main: truncated to 1
    with pytest.raises(ValueError, match="repeated"):
        rubric_reward(JUDGE, RUBRICS, [1, 1])
    with pytest.raises(TypeError, match="rubrics"):
        rubric_reward(JUDGE, ["Relevance"], [1])
    bad_judges = [b"\xff\xfe", "[" * 100_000 + "]" * 100_000, '{"score": {"Relevance": 1' + "0" * 5000 + "}}",
                  {"score": {"Relevance": {"rubrics": [{"per_doc": [{"doc_id": "x", "score": 1}]}]}}},
                  {"score": {"Relevance": {"rubrics": [{"per_doc": [{"doc_id": [1], "score": 1}]}]}}},
                  {"score": {"Relevance": {"rubrics": [{"per_doc": [{"doc_id": 1, "score": 1},
                                                                    {"doc_id": 1, "score": 9}]}]}}},
                  {"score": {"Relevance": {"rubrics": ["text"]}}}, {"score": []}, 7]
    for j in bad_judges:
        with pytest.raises(JudgeOutputError):
            rubric_reward(j if not isinstance(j, dict) else json.loads(json.dumps(j)), RUBRICS, [1])


def _attn_inputs():
    T, Hq, Hkv, d = 6, 4, 2, 16
    q, k, v = torch.randn(T, Hq, d), torch.randn(T, Hkv, d), torch.randn(T, Hkv, d)
    pk, pv = torch.randn(5, Hkv, d), torch.randn(5, Hkv, d)
    meta = (torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32),
            torch.tensor([0, 0], dtype=torch.int32))
    return q, k, v, pk, pv, meta


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the Triton interpreter's numpy NaN
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_attention_non_finite_like_the_reference(backend):
    q, k, v, pk, pv, (cs, cp, sg) = _attn_inputs()
    for name in ("q", "k", "v", "pk"):
        t = {"q": q, "k": k, "v": v, "pk": pk}[name].clone()
        t[1, 0, 0] = float("nan")
        args = {"q": q, "k": k, "v": v, "pk": pk, **{name: t}}
        ref = prefix_shared_attention_ref(args["q"], args["k"], args["v"], cs, args["pk"], pv, cp, sg)
        out = prefix_shared_attention(args["q"], args["k"], args["v"], cs, args["pk"], pv, cp, sg, backend=backend)
        if backend == "triton" and name == "v":
            # Triton multiplies a key hidden from a row (weight 0) by its value, as fused GPU kernels
            # do: the NaN also reaches the rows before it in its tile (the oracle's rows see only
            # what they see, since 2026-12-07). Never fewer NaN rows than the oracle's
            assert not (torch.isnan(ref) & ~torch.isnan(out)).any(), "NaN in v: a row that sees it is not NaN"
        else:
            assert torch.equal(torch.isnan(out), torch.isnan(ref)), f"NaN in {name}: NaN pattern differs"
        fin = ~torch.isnan(out)
        assert torch.allclose(out[fin], ref[fin], atol=1e-4)
    # 1e39 / 1e-50: finite and > 0 in double, inf / 0 in the kernels' fp32 (NaN rows, no error)
    for bad in (0.0, -1.0, float("nan"), float("inf"), 1e39, -1e39, 1e-50):
        for fn in (prefix_shared_attention_ref, lambda *a, **kw: prefix_shared_attention(*a, backend=backend, **kw)):
            with pytest.raises(ValueError, match="softmax_scale must be finite and > 0"):
                fn(q, k, v, cs, pk, pv, cp, sg, softmax_scale=bad)
    tiny = prefix_shared_attention(q, k, v, cs, pk, pv, cp, sg, softmax_scale=1e-40, backend=backend)  # subnormal
    assert torch.isfinite(tiny).all()


def test_linear_logprob_and_topk_errors():
    h, w, t = torch.randn(3, 8), torch.randn(50, 8), torch.tensor([1, 2, 3])
    h[2, 0] = float("nan")
    for fn in (lambda: linear_logprob(h, w, t), lambda: topk_logprobs(h, w, t, k=4)):
        with pytest.raises(ValueError, match=r"non-finite.*\[2\]"):
            fn()
    with pytest.raises(TypeError, match="k must be an int"):
        topk_logprobs(torch.randn(3, 8), w, t, k=None)
