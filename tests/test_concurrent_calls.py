"""One reranker shared by several Python threads (docs/api.md, "Threads"): every result equals
the same call made alone, nothing deadlocks, and the prefix cache's pages are all given back.

Small budgets make threads evict each other's prefixes, and prefills that find every page
pinned fall back to a private pool (at 32 pages every setwise prompt does, at 64 some do).
"""
import random
import threading

import pytest

from _tiny import tiny_causal
from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker

DOCS = [f"document {i} about topic {i % 5}" + " and more text" * (i % 4) for i in range(10)]
TRACE = "the agent looked at step {i} and decided to go on. "
CALLS = [dict(query=f"sub-query {j % 3}", documents=DOCS[j % 4:j % 4 + 3 + j % 4],
              question="what is the topic?" if j % 2 else None,
              trace="".join(TRACE.format(i=i) for i in range(j % 4 * 6)) or None,
              cache_salt="tenant-1" if j % 3 == 0 else None) for j in range(8)]
SELECTS = [dict(query=f"query {j % 2}", documents=DOCS[j:j + 4], intent="the agent's intent" if j % 2 else None,
                max_select=1 + j % 3, cache_salt="tenant-1" if j % 3 == 0 else None) for j in range(5)]


@pytest.fixture(scope="module")
def model():
    return tiny_causal(seed=5)


def run_threads(n, work):
    """``work(i)`` in n threads started together; the exceptions they raised; fails on a hang."""
    errors, barrier = [], threading.Barrier(n)

    def main(i):
        barrier.wait()
        try:
            work(i)
        except Exception as e:  # every failure of a worker is reported by the test, not lost in its thread
            errors.append(e)

    threads = [threading.Thread(target=main, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 60 s (deadlock)"
    return errors


def assert_pages_at_rest(reranker):
    pc = reranker._cache_slot._cache
    refs = pc.pool.refcount
    assert all(c <= 1 for c in refs), "a page is still pinned after every call returned"
    assert pc.pool.num_free + pc.resident_tokens // pc.block_size == pc.pool.num_blocks, "a page leaked"


@pytest.mark.parametrize("budget", [512, 1024, None], ids=["32-pages", "64-pages", "default"])
def test_threads_sharing_one_runner_get_the_results_of_calls_made_alone(model, budget):
    pw = PointwiseReranker(model=model, cache_budget_tokens=budget)
    sw = SetwiseReranker(runner=pw.runner, cache_budget_tokens=budget)
    alone_pw = PointwiseReranker(runner=pw.runner, prefix_cache=False)
    alone_sw = SetwiseReranker(runner=pw.runner, prefix_cache=False)
    want = [alone_pw.score(**c) for c in CALLS]
    want_sel = [alone_sw.select(**c) for c in SELECTS]
    bad = []

    def work(i):
        rnd = random.Random(i)
        for _ in range(6):
            if i % 3 == 2:
                j = rnd.randrange(len(SELECTS))
                got = sw.select(**SELECTS[j])
                if got != want_sel[j]:
                    bad.append(("select", j, got, want_sel[j]))
                continue
            js = [rnd.randrange(len(CALLS)) for _ in range(1 + i % 2)]
            got = pw.score_batch([ScoreRequest(**CALLS[j]) for j in js])
            for j, g in zip(js, got):
                # a prefix served from the cache runs in another key tiling: fp32 rounding, not bits
                if len(g) != len(want[j]) or max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(g, want[j])) > 1e-5:
                    bad.append(("score", j, g, want[j]))

    assert run_threads(6, work) == []
    assert bad == []
    assert pw.cache_stats()["hit_tokens"] > 0, "no call was served from the cache: the test shares nothing"
    assert_pages_at_rest(pw)
    assert_pages_at_rest(sw)


def test_handles_released_and_used_across_threads(model):
    """Step API handles passed between threads: one thread acquires, others score and release
    (twice), and a use after the release is the documented ValueError, never another score."""
    rr = PointwiseReranker(model=model, cache_budget_tokens=64)
    encs = [rr.encode(ScoreRequest(**c)) for c in CALLS]
    want = [PointwiseReranker(runner=rr.runner, prefix_cache=False).score(**c) for c in CALLS]
    handles = [rr.acquire_prefix(e) for e in encs]
    bad = []

    def work(i):
        for k in range(i % 2, len(handles), 2):
            h = handles[k]
            if i < 2:  # scorers
                try:
                    got = rr.score_segments([(h, ids) for ids in h.encoding.segment_ids])
                except ValueError as e:
                    assert "was released" in str(e), e
                    continue
                if max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(got, want[k])) > 1e-5:
                    bad.append((k, got, want[k]))
            else:  # releasers
                rr.release_prefix(h)

    assert run_threads(4, work) == []
    assert bad == []
    for h in handles:
        rr.release_prefix(h)  # again: idempotent
    for h in handles:
        with pytest.raises(ValueError, match="was released"):
            rr.score_segments([(h, h.encoding.segment_ids[0])])
    assert_pages_at_rest(rr)


@pytest.mark.parametrize("backend", [None, "torch"], ids=["default", "torch"])
def test_a_callers_autocast_region_changes_nothing(model, backend, monkeypatch):
    """torch.autocast is per thread: a reranker called from a thread inside a bf16 autocast region
    (a training loop's) ran its fp32 GEMMs in bf16 — scores off by ~2e-3 from the same call
    elsewhere, the torch attention backend a ValueError about the plan's dtype. The passes, the
    yes/no head and the decoder's logits (each step's best allowed logit, recorded) now run in the
    weights' dtype wherever they are called from: the very same numbers."""
    import torch

    from acarerank.setwise import decode

    steps = []
    check = decode.GreedyStepper._check_finite
    monkeypatch.setattr(decode.GreedyStepper, "_check_finite",
                        lambda self, best, running: (steps.append(best.clone()), check(self, best, running))[1])
    pw = PointwiseReranker(model=model, backend=backend, prefix_cache=False)
    sw = SetwiseReranker(runner=pw.runner, prefix_cache=False)
    hidden = torch.randn(3, pw.runner.arch.hidden_size)

    def calls():
        steps.clear()
        out = ([pw.score(**c) for c in CALLS[:4]], [sw.select(**c) for c in SELECTS[:3]],
               sw.select(**SELECTS[0], constrained=False))
        return out, list(steps), pw.runner.logits(hidden)

    want, want_steps, want_logits = calls()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_steps, got_logits = calls()
    assert got == want
    assert len(got_steps) == len(want_steps) and all(torch.equal(g, w) for g, w in zip(got_steps, want_steps))
    assert torch.equal(got_logits, want_logits)


@pytest.mark.parametrize("how", ["torch.device", "set_default_device"])
@pytest.mark.parametrize("backend", [None, "torch"], ids=["default", "torch"])
def test_a_callers_default_device_changes_nothing(model, backend, how):
    """A default device is per thread too (``with torch.device(...)`` or ``torch.set_default_device``):
    the package's own factory calls without a device (token ids, block tables, slots, grammar
    masks, the cascade's host plan) landed on it — under "meta" every score and select was a
    RuntimeError from ``.item()``, under "cuda" a CPU model would get CUDA metadata. Each names
    its device now: the same selections and bit-identical scores (fp32, the prefix cache on, with
    evictions: the same calls on fresh rerankers over one runner), and the default is the
    caller's again afterwards."""
    import torch

    runner = PointwiseReranker(model=model, backend=backend).runner

    def calls():
        pw = PointwiseReranker(runner=runner, cache_budget_tokens=512)
        sw = SetwiseReranker(runner=runner, cache_budget_tokens=512, max_new_tokens=24)
        return ([pw.score(**c) for c in CALLS], pw.score_batch([ScoreRequest(**c) for c in CALLS[:3]]),
                [sw.select(**c) for c in SELECTS], sw.select(**SELECTS[0], constrained=False),
                sw.select_batch([c["query"] for c in SELECTS[:2]], [c["documents"] for c in SELECTS[:2]]))

    want = calls()
    if how == "torch.device":
        with torch.device("meta"):
            got = calls()
    else:
        torch.set_default_device("meta")
        try:
            got = calls()
        finally:
            torch.set_default_device(None)
    assert got == want
    assert torch.empty(0).device == torch.device("cpu")
