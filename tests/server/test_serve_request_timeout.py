"""``--request-timeout``: a request still unanswered that many seconds after it arrived gets a 504
naming the flag, its remaining work is dropped and its admission slot freed, and the engine serves
on. The wait for the large tokenizer lane is bounded too, and the lane is never leaked.

A real server (uvicorn over loopback, a tiny random model); the model's steps are wrapped by a
test double that holds them at a gate, as a hung or very slow pass would.
"""
import threading
import time

import pytest
from _optional import require

require("fastapi", "uvicorn", "httpx", "prometheus_client")
import httpx  # noqa: E402

from acarerank import PointwiseReranker, SetwiseReranker  # noqa: E402
from acarerank.server import RerankService, create_app  # noqa: E402
from acarerank.server.config import ServeConfig  # noqa: E402
from serve_util import thread_server, tiny_model  # noqa: E402

TIMEOUT = 0.5
DOCS = ["tutor hints help the reranker", "bread and rivers", "a search agent's trace"]


class Held:
    """A step API (the reranker's or the setwise reranker's) whose ``held`` methods wait at ``gate``
    while it is clear; ``encode`` also waits at ``encode_gate`` for a query containing "hold"."""

    def __init__(self, inner, held):
        self.inner, self.held = inner, set(held)
        self.gate, self.encode_gate = threading.Event(), threading.Event()
        self.gate.set()
        self.encode_gate.set()
        self.at_gate, self.encoding = threading.Event(), threading.Event()
        self.holding = 0   # "hold" requests stopped in encode (each takes a tokenizer worker)
        self.encoded = []  # the queries encode was called for, in order

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        if name not in self.held:
            return fn

        def held(*args, **kw):
            self.at_gate.set()
            assert self.gate.wait(60), "test gate never opened"
            return fn(*args, **kw)
        return held

    def encode(self, request, **kw):
        self.encoded.append(request.query)
        if "hold" in request.query:
            self.holding += 1
            self.encoding.set()
            assert self.encode_gate.wait(60), "test encode gate never opened"
        return self.inner.encode(request, **kw)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def served(model):
    rr = PointwiseReranker(model=model)
    sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer)
    steps, select_steps = Held(rr, {"score_segments"}), Held(sr, {"decode_select"})
    svc = RerankService(rr, "tiny-timeout", setwise=sr, max_queue=16, request_timeout=TIMEOUT)
    svc.reranker = svc.engine.steps = steps
    svc.setwise = svc.engine.select_steps = select_steps
    svc.start()
    try:
        with thread_server(create_app(svc)) as base:
            yield dict(base=base, svc=svc, steps=steps, select_steps=select_steps)
    finally:
        steps.gate.set()
        steps.encode_gate.set()
        select_steps.gate.set()
        svc.stop()


def cancelled(base) -> float:
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("acarerank_requests_cancelled_total "):
            return float(line.split()[1])
    raise AssertionError("acarerank_requests_cancelled_total not in /metrics")


def assert_timed_out(r, took):
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert err["code"] == 504 and err["type"] == "timeout" and "--request-timeout 0.5 s" in err["message"], err
    assert took < TIMEOUT + 5, f"504 came {took:.1f} s after the request (--request-timeout {TIMEOUT})"


@pytest.mark.parametrize("path", ["/v1/rerank", "/v1/select"])
def test_a_held_pass_answers_504_drops_the_work_and_the_engine_serves_on(served, path):
    base, svc = served["base"], served["svc"]
    held = served["steps"] if path == "/v1/rerank" else served["select_steps"]
    before = cancelled(base)
    held.gate.clear()
    t0 = time.monotonic()
    r = httpx.post(base + path, json=dict(query="slow", documents=DOCS), timeout=30)
    assert_timed_out(r, time.monotonic() - t0)
    assert held.at_gate.is_set(), "the request timed out before its work reached the model"
    assert cancelled(base) == before + 1, "the timed-out request's work was not dropped"
    assert svc.admitted == 0, "a timed-out request kept its admission slot"
    held.gate.set()
    deadline = time.monotonic() + 30
    while svc.engine.num_jobs and time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.engine.num_jobs == 0, "the dropped job never left the engine"
    r = httpx.post(base + path, json=dict(query="after", documents=DOCS), timeout=30)
    assert r.status_code == 200, r.text
    assert httpx.get(base + "/health", timeout=5).status_code == 200


BIG = ["x " * 100] * 2   # a large request once large_request_chars is 100


def hold_the_large_lane(base, svc, steps):
    """Make BIG a large request and send one ("hold") that stops in its tokenizer worker with the
    large lane held, until ``steps.encode_gate`` opens. Returns (its thread, {"r": its response})."""
    svc.large_request_chars = 100
    steps.encode_gate.clear()
    first = {}
    t = threading.Thread(target=lambda: first.update(r=httpx.post(
        base + "/v1/rerank", json=dict(query="hold", documents=BIG), timeout=30)))
    t.start()
    assert steps.encoding.wait(30), "the first large request never reached its tokenizer worker"
    return t, first


def test_the_wait_for_the_large_lane_is_bounded_and_the_lane_is_not_leaked(served):
    """Two tokenizer workers: one large request at a time. A large request held in its tokenizer
    worker holds the lane; a second one waits for the lane and gets its 504 at the deadline; the
    first, released after its deadline, gets its 504 once tokenized (never submitted); then the
    lane is free for a third."""
    base, svc, steps = served["base"], served["svc"], served["steps"]
    t, first = hold_the_large_lane(base, svc, steps)
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/rerank", json=dict(query="second", documents=BIG), timeout=30)
    assert_timed_out(r, time.monotonic() - t0)
    time.sleep(TIMEOUT)
    steps.encode_gate.set()
    t.join(30)
    assert first["r"].status_code == 504 and "--request-timeout" in first["r"].text, first["r"].text
    assert svc.engine.num_jobs == 0, "a request past its deadline after tokenizing was submitted"
    r = httpx.post(base + "/v1/rerank", json=dict(query="third", documents=BIG), timeout=30)
    assert r.status_code == 200, r.text
    assert svc.admitted == 0


def test_a_client_gone_while_waiting_for_the_large_lane_is_never_tokenized(model):
    """No --request-timeout (the default): a large request whose client leaves while another holds
    the large lane is dropped there. It was tokenized once the lane came free (seconds of a worker
    for megabytes, the lane held from the requests behind it), then submitted, and only the wait
    for its scores noticed the client had gone."""
    rr = PointwiseReranker(model=model)
    steps = Held(rr, ())
    encoded = []
    inner_encode = steps.encode
    steps.encode = lambda request, **kw: (encoded.append(request.query), inner_encode(request, **kw))[1]
    svc = RerankService(rr, "tiny-lane", max_queue=16, tokenize_workers=2)
    svc.reranker = svc.engine.steps = steps
    svc.start()
    try:
        with thread_server(create_app(svc)) as base:
            t, first = hold_the_large_lane(base, svc, steps)
            with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                httpx.post(base + "/v1/rerank", json=dict(query="gone", documents=BIG), timeout=0.5)
            time.sleep(0.5)  # the service's disconnect poll (0.1 s) sees it while the lane is held
            steps.encode_gate.set()
            t.join(30)
            assert first["r"].status_code == 200, first["r"].text
            r = httpx.post(base + "/v1/rerank", json=dict(query="third", documents=BIG), timeout=30)
            assert r.status_code == 200, r.text
            assert [q for q in encoded if q != "warm-up query"] == ["hold", "third"], \
                f"tokenized: {encoded} (a gone client's request was tokenized)"
            _assert_drained(svc)
    finally:
        steps.encode_gate.set()
        svc.stop()


def _assert_drained(svc, timeout: float = 10.0) -> None:
    """Every admission slot given back (within ``timeout``) and no engine job left."""
    deadline = time.monotonic() + timeout
    while svc.admitted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.admitted == 0 and svc.engine.num_jobs == 0, (svc.admitted, svc.engine.num_jobs)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "5"])
def test_a_timeout_that_is_not_a_duration_is_refused(model, bad):
    with pytest.raises(ValueError, match="request_timeout"):
        RerankService(PointwiseReranker(model=model), "tiny", request_timeout=bad)
    if not isinstance(bad, (bool, str)):
        with pytest.raises(ValueError, match="--request-timeout"):
            ServeConfig(request_timeout=bad)


@pytest.mark.parametrize("forever", [float("inf"), 10 ** 400], ids=["inf", "10**400"])
def test_an_infinite_timeout_is_no_deadline(model, forever):
    """An int past a float's range is no deadline too (it was kept, and loop.time() + it raised
    OverflowError in the request)."""
    assert RerankService(PointwiseReranker(model=model), "tiny", request_timeout=forever).request_timeout is None


def test_a_tokenization_that_fails_after_the_deadline_answers_504(served):
    """A tokenization is not abandoned at the deadline; the request is answered 504 when it ends
    (docs/serving.md) — also when it ends in an error: that error (a 400 here) was the answer,
    18 s after a 1 s deadline in one run."""
    base, steps = served["base"], served["steps"]
    too_long = dict(documents=["word " * 9000], truncate=False)   # over max_length 8,192: refused (400)
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", **too_long), timeout=30)
    assert r.status_code == 400, r.text
    steps.encode_gate.clear()
    out = {}
    t0 = time.monotonic()
    t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
        base + "/v1/rerank", json=dict(query="hold", **too_long), timeout=30)))
    t.start()
    assert steps.encoding.wait(10), "the request never reached its tokenizer"
    time.sleep(TIMEOUT + 0.2)
    steps.encode_gate.set()
    t.join(30)
    assert_timed_out(out["r"], time.monotonic() - t0)


def hold_every_tokenizer_worker(base, steps) -> list:
    """Send two "hold" requests (the pool's two workers, --tokenize-workers' default) that stop in
    their tokenizer workers until ``steps.encode_gate`` opens. Returns [(thread, {"r": response})]."""
    steps.encode_gate.clear()
    held = []
    for n in range(2):
        out = {}
        t = threading.Thread(target=lambda out=out, n=n: out.update(r=httpx.post(
            base + "/v1/rerank", json=dict(query=f"hold {n}", documents=DOCS), timeout=30)))
        t.start()
        held.append((t, out))
    deadline = time.monotonic() + 30
    while steps.holding < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert steps.holding == 2, "the two held requests never reached their tokenizer workers"
    return held


@pytest.mark.parametrize("ends", ["deadline", "client_gone"])
def test_a_request_waiting_for_a_tokenizer_worker_is_dropped_at_its_deadline_or_when_its_client_leaves(
        model, ends):
    """Both tokenizer workers held (a wedged or very slow tokenization); a third request queued behind
    them in the pool. At --request-timeout it gets its 504 (ends="deadline"), or its client leaving
    frees its admission slot (ends="client_gone", no --request-timeout), and it is never tokenized.
    Its wait for a worker watched neither: a request with request_timeout=2 was answered after 8.4 s
    (never, if the workers never came free), and a gone client's slot stayed held (429 for everyone
    with --max-queue 3)."""
    rr = PointwiseReranker(model=model)
    steps = Held(rr, ())
    svc = RerankService(rr, "tiny-tokwait", max_queue=16,
                        request_timeout=TIMEOUT if ends == "deadline" else None)
    svc.reranker = svc.engine.steps = steps
    svc.start()
    try:
        with thread_server(create_app(svc)) as base:
            held = hold_every_tokenizer_worker(base, steps)
            t0 = time.monotonic()
            if ends == "deadline":
                r = httpx.post(base + "/v1/rerank", json=dict(query="queued", documents=DOCS), timeout=TIMEOUT + 5)
                assert_timed_out(r, time.monotonic() - t0)
            else:
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
                    httpx.post(base + "/v1/rerank", json=dict(query="queued", documents=DOCS), timeout=0.5)
                deadline = time.monotonic() + 5   # the service's disconnect poll (0.1 s) sees it
                while svc.admitted > 2 and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert svc.admitted == 2, f"{svc.admitted} requests admitted: the gone client kept its slot"
            steps.encode_gate.set()
            for t, out in held:
                t.join(30)
                assert out["r"].status_code == (504 if ends == "deadline" else 200), out["r"].text
            assert "queued" not in steps.encoded, f"tokenized: {steps.encoded} (a dropped request was tokenized)"
            _assert_drained(svc)
    finally:
        steps.encode_gate.set()
        svc.stop()
