"""Faults inside a real server (uvicorn over loopback, a tiny random model), injected by a test
double that wraps the reranker's step methods (no switch in the package):

1. one request's fault fails that request alone (500 with an error id its log line carries);
   the others in its packed pass get their offline scores; a model-side ValueError is a 500;
   a failing selection step fails that selection only;
2. prefills that fail at a layer give every page back (the pool is back to idle);
3. an exception that escapes the scheduler loop makes the service dead: /health and /ready
   503 with the reason, waiting and new requests 503 at once;
4. each failure is counted in ``acarerank_engine_failures_total{stage}``;
5. a client that leaves while its request waits is a 499, not a 500, counted as a disconnect, not an error;
6. a ``SystemExit`` in a tokenizer worker is a JSON 500; a tokenizer pool that can take no more
   work (shut down under a serving service) makes the service dead like a dead engine;
7. a sticky fault (every pass raises) runs the canary after three failures, the canary fails and
   the service is dead (503 everywhere, at once); a client that sends only poisoned requests
   runs a canary that passes, and the service stays healthy;
8. hostile mixes: a client that leaves while its documents are in a running pass (beside a
   poisoned request or not), one failing selection among several queued, and GeneratorExit /
   asyncio.CancelledError raised in model code (BaseExceptions: a dead, loud engine).
"""
import logging
import math
import re
import threading
import time

import pytest
from _optional import require

require("fastapi", "uvicorn", "httpx", "prometheus_client")
import httpx  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker  # noqa: E402
from acarerank.model.paged_cache import PagedKVCache  # noqa: E402
from acarerank.server import RerankService, create_app  # noqa: E402
from serve_util import thread_server, tiny_model  # noqa: E402

POISON = "poison"
DOCS = ["tutor hints help the reranker", "bread and rivers", "a search agent's trace", "prefix cache pages"]


class FaultInjector:
    """The reranker's step API with faults on request: a pass holding a request whose query
    contains ``POISON`` raises ``self.pass_fault()`` (or, with ``nan_scores``, scores it NaN); every pass raises
    ``self.every_pass_fault()`` when set (a device broken for good); ``prefill_layer`` makes its prefill raise at
    that layer; ``encode_fault`` is raised in the tokenizer worker. ``gate`` holds every pass
    while clear. Counts passes (``passes``: the queries of each)."""

    def __init__(self, rr):
        self.rr = rr
        self.pass_fault = None
        self.every_pass_fault = None
        self.nan_scores = False    # the poisoned request's scores come back NaN (no exception)
        self.prefill_layer = None
        self.prefill_once = False  # clear prefill_layer after its first fault
        self.prefill_chunks = []   # chunk_tokens of each acquire_prefix call
        self.encode_fault = None
        self.gate = threading.Event()
        self.gate.set()
        self.at_gate = threading.Event()
        self.hold = None           # (substring, Event): a pass holding a query with it waits for the event
        self.live = {}             # id -> query of the prefix handles acquired and not released
        self.held = threading.Event()
        self.passes = []
        self._query = {}
        self._in_prefill = threading.local()

    def __getattr__(self, name):
        return getattr(self.rr, name)

    def encode(self, request, **kw):
        if self.encode_fault is not None and POISON in request.query:
            raise self.encode_fault
        enc = self.rr.encode(request, **kw)
        enc.fault_query = request.query
        return enc

    def acquire_prefix(self, enc, chunk_tokens=None):
        self._in_prefill.layer = self.prefill_layer if POISON in enc.fault_query else None
        self.prefill_chunks.append(chunk_tokens)
        try:
            h = self.rr.acquire_prefix(enc, chunk_tokens)
        finally:
            self._in_prefill.layer = None
        self._query[id(h)] = enc.fault_query
        self.live[id(h)] = enc.fault_query
        return h

    def release_prefix(self, h):
        self.rr.release_prefix(h)
        self.live.pop(id(h), None)

    def score_segments(self, items):
        self.at_gate.set()
        assert self.gate.wait(60), "test gate never opened"
        self.at_gate.clear()
        queries = sorted({self._query[id(h)] for h, _ in items})
        if self.hold is not None and any(self.hold[0] in q for q in queries):
            self.held.set()
            assert self.hold[1].wait(60), "test hold never released"
        self.passes.append(queries)
        if self.every_pass_fault is not None:
            raise self.every_pass_fault()
        if self.pass_fault is not None and any(POISON in q for q in queries):
            raise self.pass_fault()
        scores = self.rr.score_segments(items)
        if self.nan_scores:
            scores = [math.nan if POISON in self._query[id(h)] else v for (h, _), v in zip(items, scores)]
        return scores

    def fail_here(self, layer):
        """Called from PagedKVCache.pages (patched by the test): raise at the chosen layer."""
        if getattr(self._in_prefill, "layer", None) == layer:
            if self.prefill_once:
                self.prefill_layer = None
            raise torch.OutOfMemoryError(f"injected out of memory at layer {layer}")


class SelectFaults:
    """The setwise step API with a fault: a selection whose query contains ``POISON`` raises
    ``fault`` at its first decode step (after its prompt took pages)."""

    def __init__(self, sr):
        self.sr = sr
        self.fault = None
        self.poisoned = []   # the poisoned encodings (SelectEncoding is frozen: no mark on it)

    def __getattr__(self, name):
        return getattr(self.sr, name)

    def encode_select(self, query, documents, **kw):
        enc = self.sr.encode_select(query, documents, **kw)
        if POISON in query:
            self.poisoned.append(enc)
        return enc

    def decode_select(self, st):
        if self.fault is not None and any(st.encoding is e for e in self.poisoned):
            raise self.fault
        return self.sr.decode_select(st)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def reference(model):
    return PointwiseReranker(model=model)


@pytest.fixture
def served(model, monkeypatch, request):
    """A fresh service per test (a dead engine cannot leak into the next test); an indirect
    parameter is a dict of more ``RerankService`` arguments (``max_pass_timeout``)."""
    rr = PointwiseReranker(model=model)
    sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer)
    inj = FaultInjector(rr)
    sel = SelectFaults(sr)
    svc = RerankService(rr, "tiny-faults", setwise=sr, max_batch_tokens=4096, max_queue=64,
                        **getattr(request, "param", {}))
    svc.reranker = svc.engine.steps = inj
    svc.setwise = svc.engine.select_steps = sel
    pages = PagedKVCache.pages

    def pages_or_fail(self, layer):
        inj.fail_here(layer)
        return pages(self, layer)

    monkeypatch.setattr(PagedKVCache, "pages", pages_or_fail)
    svc.start()
    try:
        with thread_server(create_app(svc)) as base:
            yield dict(base=base, svc=svc, inj=inj, rr=rr, sr=sr, sel=sel)
    finally:
        inj.gate.set()
        svc.stop()


def metrics(base) -> dict:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def failures(base, stage) -> float:
    return metrics(base).get(("acarerank_engine_failures_total", (("stage", stage),)), 0.0)


def post_all(base, queries, timeout=60):
    """POST one rerank per query, all at once (threads); {query: response}."""
    out = {}

    def one(q):
        out[q] = httpx.post(base + "/v1/rerank", json=dict(query=q, documents=DOCS), timeout=timeout)

    threads = [threading.Thread(target=one, args=(q,)) for q in queries]
    for t in threads:
        t.start()
    return threads, out


def hold_then_send(served, queries):
    """Hold the engine at a pass, queue ``queries`` behind it, release: they share one pass."""
    base, inj, svc = served["base"], served["inj"], served["svc"]
    inj.gate.clear()
    blocker, out = post_all(base, ["blocker query"])
    assert inj.at_gate.wait(30), "the blocker never reached a pass"
    threads, more = post_all(base, queries)
    deadline = time.monotonic() + 30
    while svc.engine.num_jobs < 1 + len(queries) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.engine.num_jobs == 1 + len(queries), "the requests never queued behind the blocker"
    inj.passes.clear()
    inj.gate.set()
    for t in blocker + threads:
        t.join(60)
    out.update(more)
    return out


def assert_scores(r, want, what):
    assert r.status_code == 200, f"{what}: {r.status_code} {r.text}"
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    diff = max(abs(got[i] - want[i]) for i in range(len(want)))
    assert diff <= 1e-6, f"{what}: max |server - offline| = {diff:.3g}"


# -- 1 and 4: one request's fault fails alone; logged with its error id; counted ----------------------
@pytest.mark.parametrize("fault", [RuntimeError, ValueError, torch.OutOfMemoryError, MemoryError])
def test_one_bad_request_in_a_packed_pass_fails_alone(served, reference, fault, caplog):
    base, inj = served["base"], served["inj"]
    queries = ["tutor question one", f"{POISON} request", "bread question three", "agent question four"]
    before = failures(base, "pass")
    inj.pass_fault = lambda: fault("injected kernel fault")
    with caplog.at_level(logging.ERROR, logger="acarerank.server"):
        out = hold_then_send(served, queries)
    assert any(len(p) == len(queries) for p in inj.passes), f"the four never shared a pass: {inj.passes}"
    for q in queries:
        if POISON in q:
            continue
        assert_scores(out[q], reference.score(q, DOCS), f"innocent request {q!r} beside a {fault.__name__}")
    r = out[f"{POISON} request"]
    assert r.status_code == 500, f"the culprit got {r.status_code}: {r.text}"
    err = r.json()["error"]
    assert err["type"] == "internal_error" and err["code"] == 500, err
    m = re.search(r"error id ([0-9a-f]{16})", err["message"])
    assert m and fault.__name__ in err["message"], err["message"]
    lines = [rec.getMessage() for rec in caplog.records if m.group(1) in rec.getMessage()]
    assert len(lines) == 1 and "engine pass failed" in lines[0], f"log lines with the error id: {lines}"
    assert failures(base, "pass") - before == 1
    extra = len([p for p in inj.passes if p != ["blocker query"]]) - 1
    # ceil(log2 4) probes + the culprit alone when found by elimination + the pass of the halves set
    # aside; an out-of-memory error first runs two passes of half the tokens, then both halves of
    # each failing part: 2 ceil(log2 4), then the culprit's documents in halves (a pass too large,
    # not a bad request) until one alone fails: ceil(log2 len(DOCS)) more
    oom = fault in (torch.OutOfMemoryError, MemoryError)
    bound = 4 + (math.ceil(math.log2(len(DOCS))) if oom else 0)
    assert extra <= bound, f"{extra} extra passes to isolate one of 4 (bound {bound}): {inj.passes}"


def test_nan_score_from_the_model_fails_its_request_alone(served, reference):
    """A NaN score that comes out of the model with no exception is the model's fault: that request
    gets the 500 with an error id (once a bare "internal error: ValueError" from the JSON encoder,
    uncounted), the others in its pass their offline scores."""
    base, inj = served["base"], served["inj"]
    queries = ["tutor question one", f"{POISON} request", "bread question three"]
    before = failures(base, "pass")
    inj.nan_scores = True
    out = hold_then_send(served, queries)
    assert any(len(p) == len(queries) for p in inj.passes), f"the three never shared a pass: {inj.passes}"
    for q in queries:
        if POISON not in q:
            assert_scores(out[q], reference.score(q, DOCS), f"innocent request {q!r} beside a NaN score")
    r = out[f"{POISON} request"]
    assert r.status_code == 500, f"the culprit got {r.status_code}: {r.text}"
    msg = r.json()["error"]["message"]
    assert re.search(r"error id [0-9a-f]{16}", msg) and "not a finite number" in msg, msg
    assert failures(base, "pass") - before == 1


# -- 2: a prefill that fails at a layer gives back every page ----------------------------------------
def pool_state(rr):
    pool = rr._prefix_cache.pool
    return list(pool.refcount), sorted(pool._free)


def test_failed_prefills_leak_no_pages(served, reference):
    base, inj, rr = served["base"], served["inj"], served["rr"]
    trace = "the agent searched for tutors, read three pages and kept two of them. " * 6
    # a first call caches the shared part of the context: later failures hit (and pin) cached pages
    r = httpx.post(base + "/v1/rerank", json=dict(query=f"{POISON} q", trace=trace, documents=DOCS), timeout=60)
    assert r.status_code == 200, r.text
    idle = pool_state(rr)
    assert sum(1 for c in idle[0] if c > 0) >= 3, "nothing cached: the test would not pin cached pages"
    layers = rr.runner.arch.num_layers
    before = failures(base, "prefill")
    for i in range(3 * layers):
        inj.prefill_layer = i % layers
        r = httpx.post(base + "/v1/rerank", json=dict(query=f"{POISON} q", trace=trace + f" step {i}.",
                                                      documents=DOCS), timeout=60)
        assert r.status_code == 500 and "error id" in r.json()["error"]["message"], r.text
    inj.prefill_layer = None
    assert failures(base, "prefill") - before == 3 * layers
    assert pool_state(rr) == idle, "page references or free blocks differ from idle after failed prefills"
    r = httpx.post(base + "/v1/rerank", json=dict(query="after", documents=DOCS), timeout=60)
    assert_scores(r, reference.score("after", DOCS), "a request after the failures")


def test_prefill_out_of_memory_once_is_retried_at_half_and_scores_right(served, reference):
    base, inj, rr = served["base"], served["inj"], served["rr"]
    trace = "the agent compared two tutoring methods and kept notes on each. " * 4
    want = reference.score(f"{POISON} q", DOCS, trace=trace)
    inj.prefill_layer, inj.prefill_once = 1, True
    before = failures(base, "prefill")
    r = httpx.post(base + "/v1/rerank", json=dict(query=f"{POISON} q", trace=trace, documents=DOCS), timeout=60)
    assert_scores(r, want, "a request whose first prefill ran out of memory")
    assert inj.prefill_layer is None, "the injected fault never fired"
    shared = len(rr.encode(ScoreRequest(f"{POISON} q", DOCS, trace=trace)).shared_ids)
    assert inj.prefill_chunks[-2:] == [None, min(rr.prefill_chunk, shared) // 2], inj.prefill_chunks
    assert failures(base, "prefill") == before


@pytest.mark.parametrize("fault", [RuntimeError("injected decode fault"), ValueError("injected model-side")])
def test_failing_selection_step_fails_that_selection_only(served, model, fault):
    base, sel, sr = served["base"], served["sel"], served["sr"]
    docs = ["tutor hints", "bread", "rivers"]
    sel.fault = fault
    r = httpx.post(base + "/v1/select", json=dict(query=f"{POISON} which?", documents=docs, max_select=2),
                   timeout=60)
    assert r.status_code == 500 and "error id" in r.json()["error"]["message"], r.text
    assert type(fault).__name__ in r.json()["error"]["message"]
    assert failures(base, "select") == 1
    pool = sr._cache_slot.get().pool
    assert all(c <= 1 for c in pool.refcount), "the failed selection left pages pinned beyond the tree's"
    r = httpx.post(base + "/v1/select", json=dict(query="which helps?", documents=docs, max_select=2), timeout=60)
    assert r.status_code == 200, r.text
    ref_rr = PointwiseReranker(model=model)
    want = SetwiseReranker(runner=ref_rr.runner, tokenizer=ref_rr.tokenizer).select("which helps?", docs,
                                                                                   max_select=2)
    assert r.json()["indices"] == want.indices and r.json()["text"] == want.text


# -- 3: a dead engine is loud -------------------------------------------------------------------------
@pytest.mark.parametrize("fault", [KeyboardInterrupt, SystemExit])
def test_dead_engine_answers_503_everywhere_at_once(served, fault):
    base, inj, svc = served["base"], served["inj"], served["svc"]
    h = httpx.get(base + "/health", timeout=5)
    assert h.status_code == 200 and h.json()["engine"]["state"] in ("idle", "busy"), h.text
    inj.pass_fault = lambda: fault("injected")
    t0 = time.monotonic()
    out = hold_then_send(served, [f"{POISON} request", "an innocent waiting request"])
    assert time.monotonic() - t0 < 30
    for q, r in out.items():
        if q == "blocker query":
            continue
        assert r.status_code == 503, f"{q!r}: {r.status_code} {r.text}"
        assert fault.__name__ in r.json()["error"]["message"], r.text
    assert svc.dead is not None and fault.__name__ in svc.dead
    for path in ("/health", "/ready"):
        r = httpx.get(base + path, timeout=5)
        assert r.status_code == 503 and fault.__name__ in r.json()["error"]["message"], f"{path}: {r.text}"
    r = httpx.post(base + "/v1/rerank", json=dict(query="later", documents=DOCS), timeout=5)
    assert r.status_code == 503, r.text
    r = httpx.post(base + "/v1/select", json=dict(query="later", documents=DOCS), timeout=5)
    assert r.status_code == 503, r.text
    assert failures(base, "engine") == 1
    assert svc.admitted == 0, "admission slots held by a dead engine's requests"


@pytest.mark.parametrize("fault", ["KeyboardInterrupt", "failed canary"])
def test_a_request_waiting_for_tokens_gets_the_dead_engines_503_at_once(served, monkeypatch, fault):
    """A request waiting for room in --max-queue-tokens behind the request in a pass when the
    engine dies (an exception out of the loop, or a canary that fails) gets the dead engine's 503
    within a second, not a 429 after --token-wait-timeout (60 s here); tests/server/test_admission.py
    covers a death behind tokens that never come back."""
    from acarerank.server.service import score_tokens

    base, inj, svc = served["base"], served["inj"], served["svc"]
    held = score_tokens(svc.reranker.encode(ScoreRequest("blocker query", DOCS)))
    monkeypatch.setattr(svc, "max_queue_tokens", held + held // 2)   # the waiter fits alone, not beside it
    monkeypatch.setattr(svc._tokens, "budget", held + held // 2)
    monkeypatch.setattr(svc, "token_wait_timeout", 60.0)
    inj.gate.clear()
    blocker, out = post_all(base, ["blocker query"])
    assert inj.at_gate.wait(30), "the blocker never reached a pass"
    waiter, more = post_all(base, ["waiting query"])
    deadline = time.monotonic() + 30
    while svc.waiting_for_tokens < 1:
        assert time.monotonic() < deadline, "the second request never waited for tokens"
        time.sleep(0.01)
    if fault == "KeyboardInterrupt":
        inj.every_pass_fault = lambda: KeyboardInterrupt("injected")
    else:
        monkeypatch.setattr(svc.engine, "canary_after", 1)
        inj.every_pass_fault = lambda: RuntimeError("CUDA error: an illegal memory access was encountered")
    t0 = time.monotonic()
    inj.gate.set()
    for t in blocker + waiter:
        t.join(60)
    out.update(more)
    assert time.monotonic() - t0 < 5, "the waiter waited out its token wait"
    for q, r in out.items():
        assert r.status_code == 503 and "cannot serve" in r.json()["error"]["message"], f"{q}: {r.status_code} {r.text}"
    assert svc.dead is not None and svc.waiting_for_tokens == 0 and svc.queued_tokens == 0 and svc.admitted == 0


def test_health_reports_a_long_step_without_calling_it_dead(served):
    base, inj = served["base"], served["inj"]
    inj.gate.clear()
    threads, out = post_all(base, ["long pass"])
    assert inj.at_gate.wait(30)
    time.sleep(0.3)
    h = httpx.get(base + "/health", timeout=5)
    assert h.status_code == 200 and h.json()["engine"]["state"] == "busy", h.text
    assert h.json()["engine"]["busy_s"] >= 0.3, h.text
    r = httpx.get(base + "/health", params={"max_pass_s": 0.2}, timeout=5)
    assert r.status_code == 503 and "max_pass_s" in r.json()["error"]["message"], r.text
    inj.gate.set()
    threads[0].join(60)
    assert out["long pass"].status_code == 200
    assert httpx.get(base + "/health", params={"max_pass_s": 0.2}, timeout=5).status_code == 200


@pytest.mark.parametrize("served", [dict(max_pass_timeout=3.0)], indirect=True)
def test_a_step_past_max_pass_timeout_makes_the_engine_dead(served, monkeypatch):
    """--max-pass-timeout 3: a pass held past 3 s (a model call that does not return) makes the engine
    dead, as one whose loop ended: the request in the pass and one waiting for tokens behind it get
    the dead engine's 503 at once (not the 429 after --token-wait-timeout), /health and /ready 503
    naming the flag and the step's duration, a new request 503, the failure counted and on_dead run
    once. The step that ends after it leaves the engine dead. Without the bound the blocker waited
    for the gate (60 s) and the waiter for its 429."""
    from acarerank.server.service import score_tokens

    base, inj, svc = served["base"], served["inj"], served["svc"]
    calls = []
    svc.on_dead.append(calls.append)
    held = score_tokens(svc.reranker.encode(ScoreRequest("blocker query", DOCS)))
    monkeypatch.setattr(svc, "max_queue_tokens", held + held // 2)   # the waiter fits alone, not beside it
    monkeypatch.setattr(svc._tokens, "budget", held + held // 2)
    monkeypatch.setattr(svc, "token_wait_timeout", 60.0)
    inj.gate.clear()
    t0 = time.monotonic()
    blocker, out = post_all(base, ["blocker query"])
    assert inj.at_gate.wait(30), "the blocker never reached a pass"
    waiter, more = post_all(base, ["waiting query"])
    while svc.waiting_for_tokens < 1:
        assert svc.dead is None, "the bound passed before the second request waited for tokens"
        time.sleep(0.01)
    for t in blocker + waiter:
        t.join(30)
    out.update(more)
    took = time.monotonic() - t0
    assert took < 15, f"answered after {took:.1f} s: the requests waited out the wedged step"
    for q, r in out.items():
        assert r.status_code == 503 and "--max-pass-timeout 3 s" in r.json()["error"]["message"], \
            f"{q}: {r.status_code} {r.text}"
    for path in ("/health", "/ready"):
        r = httpx.get(base + path, timeout=5)
        msg = r.json()["error"]["message"]
        assert r.status_code == 503 and re.search(r"in one step for \d+\.\d s, more than --max-pass-timeout 3 s",
                                                  msg), f"{path}: {r.text}"
    r = httpx.post(base + "/v1/rerank", json=dict(query="later", documents=DOCS), timeout=5)
    assert r.status_code == 503 and "--max-pass-timeout" in r.json()["error"]["message"], r.text
    inj.gate.set()   # the wedged step returns: the engine stays dead (a restart is the fix)
    deadline = time.monotonic() + 30
    while svc.engine.threads() or (svc.engine._loop is not None and not svc.engine._loop.done()):
        assert time.monotonic() < deadline, "the loop did not end after its step returned"
        time.sleep(0.02)
    h = httpx.get(base + "/health", timeout=5)
    assert h.status_code == 503 and "--max-pass-timeout" in h.json()["error"]["message"], h.text
    assert failures(base, "engine") == 1 and len(calls) == 1, (failures(base, "engine"), calls)
    assert svc.admitted == 0 and svc.waiting_for_tokens == 0 and svc.queued_tokens == 0
    assert not inj.live, f"pages of the dead engine's requests not given back: {inj.live}"


@pytest.mark.parametrize("served", [dict(max_pass_timeout=5.0)], indirect=True)
def test_a_step_under_max_pass_timeout_changes_nothing(served):
    """Under the bound a long step is a long step: its request is answered 200 and /health stays 200."""
    base, inj, svc = served["base"], served["inj"], served["svc"]
    inj.gate.clear()
    threads, out = post_all(base, ["long pass"])
    assert inj.at_gate.wait(30)
    time.sleep(0.5)
    assert httpx.get(base + "/health", timeout=5).status_code == 200
    inj.gate.set()
    threads[0].join(60)
    assert out["long pass"].status_code == 200, out["long pass"].text
    assert svc.dead is None and httpx.get(base + "/health", timeout=5).status_code == 200


@pytest.mark.parametrize("bound", ["-1", "nan", "inf", "abc"])
def test_health_refuses_a_bound_that_is_not_a_duration(served, bound):
    """A negative, NaN or infinite max_pass_s would make the probe always fail (-1) or never (NaN):
    422 naming it, engine idle or not."""
    r = httpx.get(served["base"] + "/health", params={"max_pass_s": bound}, timeout=5)
    assert r.status_code == 422 and "max_pass_s" in r.text, r.text


# -- 5: a client that leaves while waiting is a 499 ---------------------------------------------------
def test_client_leaving_while_waiting_is_499(served):
    base, inj, svc = served["base"], served["inj"], served["svc"]
    before = metrics(base)
    inj.gate.clear()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(base + "/v1/rerank", json=dict(query="leaving", documents=DOCS), timeout=1.0)
    deadline = time.monotonic() + 30
    key499 = ("acarerank_requests_total", (("code", "499"), ("endpoint", "/v1/rerank")))
    while metrics(base).get(key499, 0) < before.get(key499, 0) + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    inj.gate.set()
    after = metrics(base)
    key500 = ("acarerank_requests_total", (("code", "500"), ("endpoint", "/v1/rerank")))
    assert after.get(key499, 0) - before.get(key499, 0) == 1, "the disconnect was not counted as 499"
    assert after.get(key500, 0) == before.get(key500, 0), "the disconnect was counted as 500"
    # a client that left is no error of the server's: its own counter, not errors_total (error-rate alerts)
    gone = ("acarerank_client_disconnects_total", (("endpoint", "/v1/rerank"),))
    assert after.get(gone, 0) - before.get(gone, 0) == 1, "the disconnect was not counted as one"
    assert not any(k[0] == "acarerank_errors_total" and after[k] != before.get(k, 0) for k in after), \
        "the disconnect was counted in acarerank_errors_total"
    assert svc.admitted == 0


# -- 6: a BaseException in a tokenizer worker is a JSON 500 --------------------------------------------
@pytest.mark.parametrize("fault", [SystemExit("injected exit"), RuntimeError("injected tokenizer bug"),
                                   # the schemas checked every type first: a TypeError here is ours, never
                                   # a 400 telling the client to fix a request that was fine
                                   TypeError("encode() got an unexpected keyword argument 'x'")])
def test_tokenizer_worker_fault_is_a_json_500(served, reference, fault):
    base, inj = served["base"], served["inj"]
    inj.encode_fault = fault
    r = httpx.post(base + "/v1/rerank", json=dict(query=f"{POISON} q", documents=DOCS), timeout=30)
    assert r.status_code == 500, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert err["type"] == "internal_error" and "error id" in err["message"], err
    assert failures(base, "tokenize") == 1
    inj.encode_fault = None
    assert_scores(httpx.post(base + "/v1/rerank", json=dict(query="next", documents=DOCS), timeout=30),
                  reference.score("next", DOCS), "a request after the tokenizer fault")


def test_tokenizer_pool_that_refuses_work_makes_the_service_dead(served):
    base, svc = served["base"], served["svc"]
    calls = []
    svc.on_dead.append(calls.append)
    svc.pool.shutdown(wait=True)  # what a broken pool looks like to submit(): RuntimeError
    r = httpx.post(base + "/v1/rerank", json=dict(query="after the pool broke", documents=DOCS), timeout=30)
    assert r.status_code == 503, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    assert "tokenizer pool" in r.json()["error"]["message"], r.text
    assert svc.dead is not None and "tokenizer pool" in svc.dead, svc.dead
    assert len(calls) == 1 and "tokenizer pool" in calls[0], calls
    for path in ("/health", "/ready"):
        h = httpx.get(base + path, timeout=5)
        assert h.status_code == 503 and "tokenizer pool" in h.json()["error"]["message"], f"{path}: {h.text}"
    r = httpx.post(base + "/v1/rerank", json=dict(query="later", documents=DOCS), timeout=30)
    assert r.status_code == 503, r.text
    assert len(calls) == 1, f"on_dead ran {len(calls)} times"
    assert failures(base, "engine") == 1
    assert svc.admitted == 0, "admission slots held after the pool broke"


# -- 7: a broken engine is found by its canary; bad requests alone never kill it -----------------------
def canary_runs(base) -> dict:
    m = metrics(base)
    return {o: m.get(("acarerank_engine_canary_total", (("outcome", o),)), 0.0) for o in ("passed", "failed")}


def test_sticky_fault_fails_the_canary_and_the_probes_turn_503(served):
    """Every pass raises (a CUDA illegal memory access after which every kernel fails): two requests
    get their 500s, the third failed pass runs the warm-up request as the canary, it fails, and the
    engine is dead — that request, /health, /ready and a later request answer 503 at once."""
    base, inj, svc = served["base"], served["inj"], served["svc"]
    inj.every_pass_fault = lambda: RuntimeError("CUDA error: an illegal memory access was encountered")
    codes = [httpx.post(base + "/v1/rerank", json=dict(query=f"q{i}", documents=DOCS), timeout=60).status_code
             for i in range(3)]
    assert codes == [500, 500, 503], codes
    assert inj.passes[-1] == ["warm-up query"], f"the canary never ran alone: {inj.passes}"
    assert svc.dead is not None and "canary" in svc.dead and "illegal memory access" in svc.dead, svc.dead
    for path in ("/health", "/ready"):
        r = httpx.get(base + path, timeout=5)
        assert r.status_code == 503 and "canary" in r.json()["error"]["message"], f"{path}: {r.text}"
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/rerank", json=dict(query="later", documents=DOCS), timeout=5)
    assert r.status_code == 503 and time.monotonic() - t0 < 5, r.text
    assert canary_runs(base) == {"passed": 0, "failed": 1}
    assert failures(base, "engine") == 1
    assert svc.admitted == 0


def test_a_client_sending_only_poisoned_requests_keeps_the_server_healthy(served, reference):
    """Seven poisoned requests in a row, each failing its pass: the canary runs after the 3rd and the
    6th, passes both times, and the server stays up; a clean request then scores as offline."""
    base, inj, svc = served["base"], served["inj"], served["svc"]
    inj.pass_fault = lambda: RuntimeError("injected kernel fault")
    for i in range(7):
        r = httpx.post(base + "/v1/rerank", json=dict(query=f"{POISON} {i}", documents=DOCS), timeout=60)
        assert r.status_code == 500, r.text
    assert canary_runs(base) == {"passed": 2, "failed": 0}
    m = metrics(base)
    assert m[("acarerank_engine_failures_in_a_row", (("kind", "model"),))] == 1
    assert svc.dead is None
    for path in ("/health", "/ready"):
        assert httpx.get(base + path, timeout=5).status_code == 200, path
    assert_scores(httpx.post(base + "/v1/rerank", json=dict(query="clean", documents=DOCS), timeout=60),
                  reference.score("clean", DOCS), "a clean request after the poisoned ones")
    assert metrics(base)[("acarerank_engine_failures_in_a_row", (("kind", "model"),))] == 0


# -- hostile cases: a fault beside a client that leaves, a selection among several, odd BaseExceptions ---
@pytest.mark.parametrize("poisoned", [False, True])
def test_a_client_leaving_mid_pass_costs_the_others_nothing(served, reference, poisoned):
    """A client gives up while its documents are in a running pass (and, with ``poisoned``, the pass
    also fails for another request and is bisected): the others get their offline scores, the culprit
    its 500, the leaver a 499, and every page goes back."""
    base, inj, svc = served["base"], served["inj"], served["svc"]
    inj.pass_fault = lambda: RuntimeError("injected kernel fault")
    release = threading.Event()
    inj.hold = ("leaving", release)
    queries = ["leaving query", "tutor question one", "bread question three"] + ([f"{POISON} q"] if poisoned else [])
    inj.gate.clear()
    blocker, out = post_all(base, ["blocker query"])
    assert inj.at_gate.wait(30)
    leaving = {}

    def leave():
        try:
            httpx.post(base + "/v1/rerank", json=dict(query="leaving query", documents=DOCS), timeout=1.5)
        except httpx.TimeoutException as e:
            leaving["gone"] = e

    threads = [threading.Thread(target=leave)]
    threads[0].start()
    more_threads, more = post_all(base, queries[1:])
    deadline = time.monotonic() + 30
    while svc.engine.num_jobs < 1 + len(queries) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert svc.engine.num_jobs == 1 + len(queries), "the requests never queued behind the blocker"
    inj.gate.set()
    assert inj.held.wait(30), "the leaver's pass never ran"
    threads[0].join(30)
    assert "gone" in leaving, "the leaving client got an answer"
    deadline = time.monotonic() + 10
    while not any(j.cancelled for j in svc.engine._active) and time.monotonic() < deadline:
        time.sleep(0.01)   # the server notices within its disconnect poll
    release.set()
    for t in blocker + more_threads:
        t.join(60)
    assert any("leaving query" in p and len(p) == len(queries) for p in inj.passes), inj.passes
    for q in queries[1:]:
        if POISON in q:
            assert more[q].status_code == 500 and "error id" in more[q].text, more[q].text
        else:
            assert_scores(more[q], reference.score(q, DOCS), f"{q!r} beside a client that left mid-pass")
    deadline = time.monotonic() + 10
    while svc.engine.num_jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not inj.live, f"prefixes left pinned after a client left mid-pass: {inj.live}"
    assert svc.admitted == 0


def test_a_failing_selection_among_several_fails_alone(served, model):
    """Three selections queued at once, the middle one raising in its decode: the other two get the
    offline selection, the middle one its 500; the selections' pages go back."""
    base, sel, sr = served["base"], served["sel"], served["sr"]
    docs = ["tutor hints", "bread", "rivers", "agent traces"]
    sel.fault = RuntimeError("injected decode fault")
    queries = ["which helps a tutor?", f"{POISON} which?", "which is about rivers?"]
    out = {}

    def one(q):
        out[q] = httpx.post(base + "/v1/select", json=dict(query=q, documents=docs, max_select=2), timeout=120)

    threads = [threading.Thread(target=one, args=(q,)) for q in queries]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    ref_rr = PointwiseReranker(model=model)
    ref = SetwiseReranker(runner=ref_rr.runner, tokenizer=ref_rr.tokenizer)
    for q in queries:
        r = out[q]
        if POISON in q:
            assert r.status_code == 500 and "injected decode fault" in r.text and "error id" in r.text, r.text
            continue
        want = ref.select(q, docs, max_select=2)
        assert r.status_code == 200 and r.json()["indices"] == want.indices and r.json()["text"] == want.text, r.text
    pool = sr._cache_slot.get().pool
    assert all(c <= 1 for c in pool.refcount), "a selection left pages pinned beyond the tree's"


@pytest.mark.parametrize("fault", [GeneratorExit, StopIteration, "cancelled"])
def test_odd_exceptions_in_model_code(served, reference, fault):
    """A ``GeneratorExit`` or ``asyncio.CancelledError`` (BaseExceptions, not Exceptions) raised in a
    model call ends the scheduler loop: the engine is dead and loud (503 everywhere, probes 503), as
    for SystemExit. A ``StopIteration`` is an ordinary Exception: that request's 500, the others scored."""
    import asyncio
    base, inj, svc = served["base"], served["inj"], served["svc"]
    exc_type = asyncio.CancelledError if fault == "cancelled" else fault
    inj.pass_fault = lambda: exc_type("injected")
    out = hold_then_send(served, [f"{POISON} request", "an innocent waiting request"])
    if exc_type is StopIteration:
        assert out[f"{POISON} request"].status_code == 500, out[f"{POISON} request"].text
        assert_scores(out["an innocent waiting request"], reference.score("an innocent waiting request", DOCS),
                      "beside a StopIteration")
        assert svc.dead is None and httpx.get(base + "/ready", timeout=5).status_code == 200
        return
    for q in (f"{POISON} request", "an innocent waiting request"):
        assert out[q].status_code == 503 and exc_type.__name__ in out[q].json()["error"]["message"], out[q].text
    for path in ("/health", "/ready"):
        r = httpx.get(base + path, timeout=5)
        assert r.status_code == 503 and exc_type.__name__ in r.json()["error"]["message"], f"{path}: {r.text}"
    assert svc.admitted == 0
