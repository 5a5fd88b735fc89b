"""Each reranker owns its encoder: user code may use (and reconfigure) the tokenizer it passed
from another thread, the reranker never sees that state, and the reranker's encoding is safe
from several threads at once (the HTTP server tokenizes in a thread pool)."""
import threading
import time

import pytest

from _tiny import tiny_causal
from acarerank import PointwiseReranker
from acarerank.prompts import encode_pointwise
from acarerank.setwise import SetwiseReranker
from acarerank.setwise.prompts import build_prompt
from acarerank.tokenizer import load_qwen3_tokenizer

DOCS = [("retrieval augmented generation with long passages " * 6).strip(), "short doc", "数字 12345 与中文",
        "line one\nline two " * 5]


@pytest.fixture(scope="module")
def model():
    return tiny_causal(seed=2, tie=True)


def test_scores_unaffected_by_another_thread_using_the_shared_tokenizer(model):
    tok = load_qwen3_tokenizer()            # the process-wide object user code also holds
    rr = PointwiseReranker(model=model, tokenizer=tok)
    want = rr.score("what is rag?", DOCS)
    stop = threading.Event()
    errors = []

    def hammer():  # what user code does with its tokenizer: truncation and padding on every call
        try:
            while not stop.is_set():
                tok(["some user text " * 20, "x"], truncation=True, max_length=3, padding="max_length")
                time.sleep(0.0005)  # let the scoring thread run between calls (the GIL)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=hammer)
    t.start()
    try:
        got = [rr.score("what is rag?", DOCS) for _ in range(20)]
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    bad = [i for i, g in enumerate(got) if g != want]
    assert not bad, f"{len(bad)} of {len(got)} calls differ, e.g. {got[bad[0]]} vs {want}"
    # the user's tokenizer state is the user's: the reranker did not reset it either
    tok(["abc def ghi"], truncation=True, max_length=2)
    assert rr.score("what is rag?", DOCS) == want


def test_encoding_is_thread_safe(model):
    rr = PointwiseReranker(model=model)
    sr = SetwiseReranker(model=model)
    jobs = [(f"query {i}", DOCS[i % 4:] + DOCS[:i % 4], "trace " * (i % 7)) for i in range(12)]
    serial = [encode_pointwise(rr.tokenizer, q, d, trace=t, max_length=110, min_doc_tokens=8) for q, d, t in jobs]
    serial_sw = [build_prompt(sr.tokenizer, q, d, max_length=700).input_ids for q, d, _ in jobs]
    results = {}

    def work(k):
        for i in range(k, len(jobs), 4):
            q, d, t = jobs[i]
            for _ in range(2):
                e = encode_pointwise(rr.tokenizer, q, d, trace=t, max_length=110, min_doc_tokens=8)
                p = build_prompt(sr.tokenizer, q, d, max_length=700).input_ids
                results.setdefault(i, []).append((e.shared_ids, e.segment_ids, p))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, runs in results.items():
        for shared, segs, p in runs:
            assert shared == serial[i].shared_ids and segs == serial[i].segment_ids, f"job {i}"
            assert p == serial_sw[i], f"setwise job {i}"
    assert len(results) == len(jobs)


@pytest.mark.parametrize("cls", [PointwiseReranker, SetwiseReranker])
def test_a_passed_runner_is_never_modified(model, cls):
    base = cls(model=model)
    runner = base.runner
    assert runner.backend is None
    rr = cls(runner=runner, backend="torch")
    assert runner.backend is None, "the caller's runner was modified"
    assert rr.runner is not runner and rr.runner.backend == "torch"
    # the copy shares every tensor but the linear layers' matrices, which "torch" reads dense
    # where the caller's (oneDNN) runner holds them packed (tests/model/test_linear_runner.py)
    assert rr.runner.weights.embed is runner.weights.embed
    same_form = cls(runner=runner, backend={"linear": runner.linear_backend})
    assert same_form.runner is not runner and same_form.runner.weights is runner.weights  # no weight copy
    if cls is PointwiseReranker:
        PointwiseReranker(runner=runner, batch_invariant=True)
        assert runner.batch_invariant is False
