"""Setwise selection as steps of the serving engine: a long selection shares the passes with
scoring (a small rerank submitted meanwhile finishes first, within a few passes), and what the
engine selects is what the offline ``SetwiseReranker.select`` selects."""
import threading

import pytest

from acarerank import PointwiseReranker, ScoreRequest
from acarerank.server.engine import Engine
from acarerank.setwise import SetwiseReranker

from serve_util import tiny_model

BUDGET = 128  # segment tokens per pass: the selection's prompt takes many passes


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def passages(n, seed=0):
    topics = ["tutor hints for rerankers", "bread baking at home", "setwise passage selection", "river deltas",
              "agent reasoning traces", "数字 12345 混合", "GPU kernels for attention", "pasta recipes"]
    return [f"{topics[(i * 7 + seed) % len(topics)]}: passage {i} says {i * 13 % 17} things about it."
            for i in range(n)]


class Recorder:
    """Wraps the step APIs: an ordered log of model calls, and a hook after the first prefill chunk.

    hold: the second prefill chunk waits (``blocked`` set) until ``release`` is set, so a test can
    submit work while that chunk is the step in flight."""

    def __init__(self, rr, sr, hold=False):
        self.log, self.lock = [], threading.Lock()
        self.first_chunk, self.blocked, self.release = threading.Event(), threading.Event(), threading.Event()
        self.hold, self.prefills = hold, 0
        for obj, name, tag in ((rr, "score_segments", "score"), (sr, "prefill_select", "prefill"),
                               (sr, "decode_select", "decode")):
            self._wrap(obj, name, tag)

    def _wrap(self, obj, name, tag):
        orig = getattr(obj, name)

        def call(*a, **kw):
            if tag == "prefill":
                self.prefills += 1
                if self.hold and self.prefills == 2:
                    self.blocked.set()
                    assert self.release.wait(60), "the test never released the held chunk"
            out = orig(*a, **kw)
            self.mark(tag)
            if tag == "prefill":
                self.first_chunk.set()
            return out

        setattr(obj, name, call)

    def mark(self, tag):
        with self.lock:
            self.log.append(tag)


def test_a_long_selection_does_not_block_a_small_rerank(model, qwen3_tokenizer):
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_batch_tokens=BUDGET)
    sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer, max_new_tokens=64)
    offline = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=64)
    docs = passages(60)
    query = "which passages help a reranker learn from a tutor?"
    rec = Recorder(rr, sr, hold=True)
    eng = Engine(rr, BUDGET, select_steps=sr).start()
    try:
        enc = sr.encode_select(query, docs, intent="the agent studies tutoring", max_select=5)
        assert len(enc.prompt.input_ids) > 10 * BUDGET, "the selection must span many passes"
        sel_job = eng.submit_select(enc)
        small_enc = rr.encode(ScoreRequest("tutor hints?", ["hints from a tutor", "bread"]))
        assert rec.blocked.wait(60), "the selection never reached its second chunk"
        small = eng.submit(small_enc)  # while the second chunk is the step in flight
        small.future.add_done_callback(lambda f: rec.mark("rerank done"))
        sel_job.future.add_done_callback(lambda f: rec.mark("select done"))
        rec.mark("submit")
        rec.release.set()
        scores = small.future.result(120).scores
        got = sel_job.future.result(300)
    finally:
        eng.stop()
    log = rec.log
    assert log.index("rerank done") < log.index("select done"), log
    between = log[log.index("submit") + 1:log.index("rerank done")]
    assert between == ["prefill", "score"], f"the rerank waited for more than the step in flight: {between}"
    assert log[log.index("rerank done"):].count("prefill") + log[log.index("rerank done"):].count("decode") > 5, \
        "the selection was nearly over when the rerank came: the test proves nothing"
    want_scores = rr.score("tutor hints?", ["hints from a tutor", "bread"])  # step API contract: <= 1e-6 fp32
    assert max(abs(a - b) for a, b in zip(scores, want_scores)) <= 1e-6, (scores, want_scores)
    want = offline.select(query, docs, intent="the agent studies tutoring", max_select=5)
    assert got == want, (got, want)


@pytest.mark.parametrize("seed,n,intent,constrained", [(1, 5, None, True), (2, 12, "why", True),
                                                       (4, 30, None, True), (5, 8, "agent intent", False)])
def test_engine_selections_equal_offline_select(model, qwen3_tokenizer, seed, n, intent, constrained):
    """Chunked under the pass budget with scoring work in the same passes, or alone: the same Selection."""
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_batch_tokens=BUDGET)
    sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer, max_new_tokens=48)
    offline = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=48)
    docs = passages(n, seed)
    eng = Engine(rr, BUDGET, select_steps=sr).start()
    try:
        busy = [eng.submit(rr.encode(ScoreRequest(f"q{i}", docs[:6]))) for i in range(3)]  # scoring meanwhile
        jobs = [eng.submit_select(sr.encode_select("which passages?", docs, intent, max_select=4,
                                                   constrained=constrained)) for _ in range(2)]
        got = [j.future.result(300) for j in jobs]
        for b in busy:
            b.future.result(120)
    finally:
        eng.stop()
    want = offline.select("which passages?", docs, intent, max_select=4, constrained=constrained)
    assert got == [want, want], (got, want)
    pc = sr._cache_slot._cache
    assert all(pc.pool.refcount[b] == 1 for b in pc.paths().values()), "pages left pinned"
    assert pc.pool.num_free + len(pc.paths()) == pc.pool.num_blocks, "pages neither free nor cached"


def test_cancelled_selection_releases_its_pages(model, qwen3_tokenizer):
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_batch_tokens=BUDGET)
    sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer, max_new_tokens=64)
    rec = Recorder(rr, sr, hold=True)
    eng = Engine(rr, BUDGET, select_steps=sr).start()
    try:
        job = eng.submit_select(sr.encode_select("which passages?", passages(60), max_select=5))
        assert rec.blocked.wait(60)
        eng.cancel(job)  # while its second chunk is in flight
        rec.release.set()
        with pytest.raises(Exception) as info:
            job.future.result(60)
        assert "cancel" in type(info.value).__name__.lower() or "disconnected" in str(info.value)
        after = eng.submit(rr.encode(ScoreRequest("q", ["d"]))).future.result(60)
        assert len(after.scores) == 1
    finally:
        eng.stop()
    assert rec.log.count("prefill") == 2 and "decode" not in rec.log, f"cancelled work kept running: {rec.log}"
    pc = sr._cache_slot._cache
    assert all(pc.pool.refcount[b] == 1 for b in pc.paths().values())
    assert pc.pool.num_free + len(pc.paths()) == pc.pool.num_blocks, "the cancelled selection kept pages"


@pytest.mark.parametrize("constrained", [True, False])
def test_selection_under_a_cache_too_small_for_it(model, qwen3_tokenizer, constrained):
    """A cache too small for the prompt (prefill falls back to a private pool) or for the decoded
    rows (free decoding runs past the prompt's last page: decode restarts privately): the engine
    and offline select both equal an uncached select."""
    plain = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=48, prefix_cache=False)
    docs = passages(10, 7)
    want = plain.select("which passages?", docs, max_select=4, constrained=constrained)
    n = want.prompt_tokens - 1
    room = -(-n // 16) * 16 - n
    assert constrained or want.num_tokens > room + 1, "decoding never leaves the prompt's pages: proves nothing"
    for budget in (64, -(-n // 16) * 16):  # < the prompt; exactly the prompt's pages
        rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_batch_tokens=BUDGET)
        sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer, max_new_tokens=48, cache_budget_tokens=budget)
        assert sr.select("which passages?", docs, max_select=4, constrained=constrained) == want, budget
        eng = Engine(rr, BUDGET, select_steps=sr).start()
        try:
            enc = sr.encode_select("which passages?", docs, max_select=4, constrained=constrained)
            got = eng.submit_select(enc).future.result(300)
        finally:
            eng.stop()
        assert got == want, budget
        pc = sr._cache_slot._cache
        assert pc.pool.num_free + len(pc.paths()) == pc.pool.num_blocks, "pages left pinned"
