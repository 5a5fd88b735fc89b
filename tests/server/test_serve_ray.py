"""The Ray Serve deployment on a local Ray instance: 2 engine replicas behind the HTTP front.

Checks that requests of one context (same cache_salt and question, growing trace) always land on
the same replica, that context-free traffic still works, that scores equal the offline
reranker's, that errors keep their code and shape through Ray, that each replica applies its
--max-queue (429) and --max-queue-tokens (a wait for room; 413 alone over it), and that the front's /ready turns
503 once no replica's engine can serve (stopped engines, then killed replicas) and 200 again once
Ray has replaced them. Starting Ray, Serve and three replica processes dominates: ~50 s on 2 quiet cores
(2+ min on a loaded machine). The front's readiness rules themselves run without Ray, over a
stand-in handle.
"""
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _optional import require

require("fastapi", "uvicorn", "httpx", "ray")
import httpx  # noqa: E402

from _tiny import random_qwen3
from serve_util import free_port, tiny_model, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from acarerank import PointwiseReranker, ScoreRequest  # noqa: E402
from acarerank.server import create_app  # noqa: E402
from acarerank.server import ray_serve  # noqa: E402
from acarerank.server.errors import APIError  # noqa: E402
from acarerank.server.gate import Gate  # noqa: E402
from acarerank.server.ray_serve import INGRESS_SPARE_REQUESTS, REPLICA_HEADER, RemoteService, build_app  # noqa: E402
from serve_util import thread_server  # noqa: E402

DOCS = ["the tutor gives hints", "a recipe for bread", "setwise rerankers select documents", "weather today"]
MAX_QUEUE = 6   # above Ray's default max_ongoing_requests (5), which held the rest at the proxy
BURST_DOCS = ["word " * 100] * 400   # ~0.3 s a request on 2 cores


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-ckpt"))
    model = tiny_model()
    model.save_pretrained(path)
    port = free_port()
    rr = PointwiseReranker(model=model)
    # every replica's token budget holds MAX_QUEUE burst requests: the burst test meets --max-queue first
    budget = MAX_QUEUE * _tokens(rr, "q", BURST_DOCS)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(model=path, num_replicas=2, max_batch_tokens=256, dtype="float32", max_queue=MAX_QUEUE,
                            max_queue_tokens=budget),
                  name="acarerank", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_until(base + "/ready", timeout=240)
        yield base, rr, budget
    finally:
        serve.shutdown()
        ray.shutdown()


def _tokens(rr, query, docs) -> int:
    """What --max-queue-tokens counts for a rerank: the shared part once, then every segment."""
    enc = rr.encode(ScoreRequest(query, docs))
    return len(enc.shared_ids) + sum(map(len, enc.segment_ids))


def test_context_affinity_scores_and_errors(ray_app):
    base, rr, _ = ray_app
    with httpx.Client(base_url=base, timeout=60) as c:
        # distinct contexts spread over both replicas. Run first: once both have answered, the
        # front's router knows both, so the ring no longer changes under the session below.
        # (Keys are spread by hash; 2 replicas not seen in 200 distinct keys: P ~ 2^-199.)
        replicas = set()
        for k in range(200):
            r = c.post("/v2/rerank", json=dict(query="q", documents=DOCS[:2], cache_salt=f"tenant-{k}"))
            assert r.status_code == 200, r.text
            replicas.add(r.headers[REPLICA_HEADER])
            if len(replicas) == 2:
                break
        assert len(replicas) == 2, f"200 distinct contexts all went to {replicas}"

        # one agent session: the trace grows, the question and salt stay -> one replica
        seen = set()
        for step in range(4):
            trace = "searched for tutoring rerankers. " * (step + 1)
            body = dict(query=f"sub-query {step}", documents=DOCS, question="which reranker learns from a tutor?",
                        trace=trace, cache_salt="tenant-a")
            r = c.post("/v1/rerank", json=body)
            assert r.status_code == 200, r.text
            seen.add(r.headers[REPLICA_HEADER])
            want = rr.score(body["query"], DOCS, question=body["question"], trace=trace)
            got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
            diff = max(abs(got[i] - want[i]) for i in range(len(DOCS)))
            assert diff <= 1e-6, f"step {step}: max |diff| {diff}"
        assert len(seen) == 1, f"one context was served by several replicas: {seen}"

        # errors cross Ray with their code and shape
        r = c.post("/v1/rerank", json=dict(query="q", documents=[]))
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
        r = c.post("/v1/rerank", json=dict(query=3, documents=["a"]))
        assert r.status_code == 422 and r.json()["error"]["type"] == "validation_error", r.text


def test_the_score_routes_through_ray(ray_app):
    """vLLM's /score and /v1/score on the Ray front: 1 to N the rerank route's scores, N to N each
    pair's offline score, the pairing error's 400 through Ray (test_serve_score.py checks the rest
    on acarerank serve; test_the_score_routes_answer_as_acarerank_serves, without Ray, the parity)."""
    base, rr, _ = ray_app
    with httpx.Client(base_url=base, timeout=60) as c:
        rerank = c.post("/v1/rerank", json=dict(query="q", documents=DOCS, cache_salt="score-a")).json()
        r = c.post("/score", json=dict(text_1="q", text_2=DOCS, cache_salt="score-a"))
        assert r.status_code == 200 and r.json()["object"] == "list", r.text
        by_index = {x["index"]: x["relevance_score"] for x in rerank["results"]}
        assert [d["score"] for d in r.json()["data"]] == [by_index[i] for i in range(len(DOCS))]
        queries = ["q", "another q", "q", "a third"]
        r = c.post("/v1/score", json=dict(queries=queries, documents=DOCS))
        assert r.status_code == 200, r.text
        want = [rr.score(q, [d])[0] for q, d in zip(queries, DOCS)]
        diff = max(abs(d["score"] - w) for d, w in zip(r.json()["data"], want))
        assert diff <= 1e-6 and [d["index"] for d in r.json()["data"]] == [0, 1, 2, 3], r.text
        r = c.post("/score", json=dict(queries=["a", "b"], documents=DOCS))
        assert r.status_code == 400 and "queries has 2 texts and documents 4" in r.json()["error"]["message"], r.text


#: bodies whose object documents take another JSON path than strings: (path, body, status, bytes that
#: both fronts' answers carry: the object document as sent). The Ray front built an object's other
#: keys to forward them (1e400: its 422, acarerank serve's 200; re-encoded: 1e5 as 100000.0, "\u00e9"
#: as "é", text first, a duplicate key once)
ODD_BODIES = [
    ("/v1/rerank", b'{"query": "q", "documents": [{"text": "a", "k": [1e400]}], "return_documents": true}', 200,
     b'{"text": "a", "k": [1e400]}'),
    ("/v1/rerank", b'{"query": "q", "documents": [{"text": "a", "k": [1e400]}, "b"]}', 200, None),
    ("/rerank", b'{"query": "q", "return_documents": true, "documents": [{"id": 7, "n": 1e5, "text": "a", '
                b'"s": "\\u00e9", "m": {"x": [1.5, null, true]}}, "b"]}', 200,
     b'{"id": 7, "n": 1e5, "text": "a", "s": "\\u00e9", "m": {"x": [1.5, null, true]}}'),
    ("/v2/rerank", b'{"query": "q", "return_documents": true, "documents": '
                   b'[{"text": "a", "k": 1, "k": 2, "big": 123456789012345678901234567890}]}', 200,
     b'{"text": "a", "k": 1, "k": 2, "big": 123456789012345678901234567890}'),
    ("/v1/rerank", b'{"query": "q", "return_documents": true, "documents": [{"text": "a", "k": "\\ud800"}]}', 422,
     None),   # a lone surrogate escape: msgspec refuses it even in a key it skips
    ("/v1/rerank", b'{"query": "q", "documents": [{"text": "a", "k": "\xff"}]}', 422, None),
    ("/v1/rerank", b'{"query": "q", "documents": [{"text": 1e400}]}', 422, None),
    ("/v1/rerank", b'{"query": "q", "documents": [{"k": "a"}]}', 422, None),
    ("/rerank", b'{"query": "q", "texts": []}', 400, None),   # TEI's shape on both
    ("/rerank", b'{"query": "q", "texts": [1]}', 422, None),
]


def _odd_answers(bases, path, body, status, sent):
    """Post ``body`` to each front; assert they answer alike (status, error or each result's index and
    document, scores within 1e-6) and that each answer carries ``sent``."""
    answers = []
    for base in bases:
        r = httpx.post(base + path, content=body, headers={"Content-Type": "application/json"}, timeout=60)
        assert r.status_code == status, (base, r.text)
        assert sent is None or sent in r.content, (base, r.content)
        answers.append(r.json())
    if status != 200:
        assert answers[0] == answers[1], answers
        return
    results = [a if isinstance(a, list) else a["results"] for a in answers]
    assert [[(x["index"], x.get("document")) for x in rs] for rs in results][0] == \
        [[(x["index"], x.get("document")) for x in rs] for rs in results][1], answers
    diff = max(abs(x["relevance_score"] - y["relevance_score"]) for x, y in zip(*results))
    assert diff <= 1e-6, answers


@pytest.fixture(scope="module")
def direct_front(ray_app):
    """acarerank serve's app over the tiny model the Ray replicas load (the same weights)."""
    from acarerank.server import RerankService

    service = RerankService(PointwiseReranker(model=tiny_model()), "tiny", max_batch_tokens=256).start()
    try:
        with thread_server(create_app(service)) as base:
            yield base
    finally:
        service.stop()


@pytest.mark.parametrize("path, body, status, sent", ODD_BODIES)
def test_both_fronts_answer_odd_bodies_alike(ray_app, direct_front, path, body, status, sent):
    """acarerank serve and the Ray front (through Ray: the forwarded request is pickled) parse the same
    bodies to the same answer: an object document's other keys never leave the front."""
    _odd_answers([direct_front, ray_app[0]], path, body, status, sent)


def test_the_fronts_metrics_carry_each_replicas_engine_series(ray_app):
    """Runs after the affinity test: both replicas scored documents, and their series reach the front's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    base, _, _ = ray_app
    text = httpx.get(base + "/metrics", timeout=30).text
    scored = {s.labels["replica"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name == "acarerank_documents_scored_total"}
    assert len(scored) == 2 and sum(scored.values()) >= 4 * len(DOCS) + 2, text


def test_a_replica_past_its_max_queue_answers_429(ray_app):
    """A burst of one context (one replica) past --max-queue gets acarerank serve's 429 with
    Retry-After. Ray's default max_ongoing_requests (5) let only five requests into the ingress:
    the others waited at Ray's proxy, so no replica ever saw more than five and no 429 ever came."""
    base, _, _ = ray_app
    body = dict(query="q", documents=BURST_DOCS, cache_salt="burst")
    with ThreadPoolExecutor(2 * MAX_QUEUE + 2) as pool:
        answers = list(pool.map(lambda _: httpx.post(base + "/v1/rerank", json=body, timeout=300),
                                range(2 * MAX_QUEUE + 2)))
    codes = sorted(r.status_code for r in answers)
    assert set(codes) == {200, 429}, codes
    for r in answers:
        if r.status_code == 429:
            assert f"--max-queue {MAX_QUEUE}" in r.json()["error"]["message"], r.text
            assert r.headers.get("retry-after") == "1", r.headers


def test_a_replica_past_its_token_budget_makes_requests_wait_and_refuses_one_over_it_alone(ray_app):
    """--max-queue-tokens on the Ray front, as on acarerank serve: a burst of one context (one
    replica) whose tokens pass the replica's budget waits for room there (every request 200,
    the replica's acarerank_requests_waiting_for_tokens seen above 0 through the front's
    /metrics), and a request over the budget alone is a 413 naming it."""
    from prometheus_client.parser import text_string_to_metric_families

    base, rr, budget = ray_app
    docs = ["word " * 300] * 400
    each = _tokens(rr, "q", docs)
    assert 2 * each <= budget < 3 * each, (each, budget)   # two at once; the others wait
    waiting = []

    def waiting_now():   # both replicas', summed
        text = httpx.get(base + "/metrics", timeout=30).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == "acarerank_requests_waiting_for_tokens")

    def watch(stop):
        while not stop.is_set():
            waiting.append(waiting_now())
            time.sleep(0.1)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    try:
        with ThreadPoolExecutor(5) as pool:
            answers = list(pool.map(lambda k: httpx.post(base + "/v1/rerank", timeout=300, json=dict(
                query="q", documents=docs, cache_salt="tokens")), range(5)))
    finally:
        stop.set()
        watcher.join(60)
    assert [r.status_code for r in answers] == [200] * 5, [r.text[:200] for r in answers]
    assert len({r.headers[REPLICA_HEADER] for r in answers}) == 1
    assert max(waiting) >= 1 and waiting_now() == 0, waiting
    over = ["word " * 300] * 1000
    assert _tokens(rr, "q", over) > budget
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=over), timeout=300)
    assert r.status_code == 413 and "--max-queue-tokens" in r.json()["error"]["message"], r.text


def wait_for_status(url, status, timeout=60.0):
    """Poll ``url`` until it answers ``status``; the last response."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url, timeout=10)
        if r.status_code == status or time.monotonic() > deadline:
            return r
        time.sleep(0.1)


def test_front_is_unready_once_no_replica_can_serve(ray_app):
    """Ray keeps a replica whose engine stopped or died in its routing table until three health
    checks failed (30 s and more), and a killed one until its controller notices: the front's
    /ready said 200 all that time while requests failed (503) or waited. Runs after the test above
    (the module's replicas are replaced here)."""
    base, _, _ = ray_app
    replicas = serve.get_deployment_handle("RerankReplica", app_name="acarerank")
    assert httpx.get(base + "/ready", timeout=10).status_code == 200
    # every engine stopped (a replica's __del__ stops its service), the replicas still running
    replicas.broadcast("__del__").results(timeout_s=60)
    t0 = time.monotonic()
    r = wait_for_status(base + "/ready", 503)
    assert r.status_code == 503 and "engine stopped" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 10, "the front took more than its probe's age to notice"
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=DOCS[:2]), timeout=60)
    assert r.status_code == 503, r.text
    assert httpx.get(base + "/health", timeout=10).status_code == 200, "the front itself is alive"
    # the replicas gone: killed, before Ray's controller has replaced them
    for name in ray.util.list_named_actors(all_namespaces=True):
        if "RerankReplica" in name["name"]:
            ray.kill(ray.get_actor(name["name"], namespace=name["namespace"]), no_restart=True)
    r = httpx.get(base + "/ready", timeout=10)
    assert r.status_code == 503, r.text
    # a request meanwhile waits for the replicas Ray starts in their place; then the front is ready again
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=DOCS[:2]), timeout=120)
    assert r.status_code == 200, r.text
    r = wait_for_status(base + "/ready", 200, timeout=30)
    assert r.status_code == 200, r.text


def _replica_logs() -> str:
    """Every Ray worker's stderr of this session (a replica's start-up notes; log_to_driver=False)."""
    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    return "".join(p.read_text(errors="replace") for p in logs.glob("worker-*.err"))


def test_a_model_too_short_for_the_setwise_template_on_the_ray_front(ray_app, tmp_path):
    """The Ray front of a model of 650 positions (a /v1/select cap of 650 - 64 = 586 tokens, under
    the setwise template's own): as on acarerank serve (test_positions.py), its replica says so once
    at start-up (the NOTE, in its log), the front is ready and reranks, and each /v1/select is the
    400 of type context_length naming the model's limit, through Ray. Runs last on the module's
    cluster: it replaces the module's application with its own (one replica)."""
    base, _, _ = ray_app
    random_qwen3(seed=3, spread_yes_no=40, max_position_embeddings=650).save_pretrained(tmp_path)
    serve.delete("acarerank")   # its three CPUs back (ray.init(num_cpus=4))
    serve.run(build_app(model=str(tmp_path), num_replicas=1, max_batch_tokens=256, cache_budget=256, dtype="float32"),
              name="short", route_prefix="/", blocking=False)
    wait_until(base + "/ready", timeout=240)
    with httpx.Client(base_url=base, timeout=60) as c:
        r = c.post("/v1/rerank", json=dict(query="q", documents=["a", "b"]))
        assert r.status_code == 200 and r.json()["model"] == tmp_path.name, r.text
        for body in (dict(query="q", documents=["a", "b"]), dict(query="q", documents=["a"] * 3, max_select=1)):
            r = c.post("/v1/select", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "context_length" and err["code"] == 400, err
            assert err["message"].startswith("this server's model cannot serve /v1/select at all: the setwise "
                                             "prompt cap of 586 tokens (this model's maximum context length of "
                                             "650 tokens less --select-max-new-tokens=64"), err
    notes = [ln for ln in _replica_logs().splitlines() if "NOTE: /v1/select is unavailable" in ln]
    assert len(notes) == 1 and "the setwise prompt cap of 586 tokens" in notes[0], notes


# -- the front's /ready without Ray: a stand-in handle -------------------------------------------------
class _Broadcast:
    def __init__(self, answers):
        self.answers = answers

    async def results_async(self, timeout_s=None, return_exceptions=False):
        assert return_exceptions and timeout_s is not None
        if isinstance(self.answers, BaseException):
            raise self.answers
        return list(self.answers)


class _Handle:
    """What RemoteService uses of a DeploymentHandle: ``broadcast`` (counted) and ``options().remote()``."""

    def __init__(self, answers=(), call_error=None, metrics=()):
        self.answers, self.call_error, self.broadcasts, self.metrics = answers, call_error, 0, metrics

    def broadcast(self, method):
        if method == "metrics":   # the front's /metrics (not counted: the probes' count)
            return _Broadcast(self.metrics)
        assert method == "check_health"
        self.broadcasts += 1
        return _Broadcast(self.answers)

    def options(self, **kw):
        return self

    def remote(self, *args):
        error = self.call_error

        class Response:
            def __await__(self):
                async def fail():
                    raise error
                return fail().__await__()

            def cancel(self):
                pass
        return Response()


def _unhealthy(problem, replica="r1"):
    """What a replica's check_health raises, as Ray hands it to the caller (a RayTaskError whose text
    holds the remote traceback)."""
    return ray.exceptions.RayTaskError("check_health", "Traceback (most recent call last):\n ...",
                                       RuntimeError(f"replica {replica}: {problem}")).as_instanceof_cause()


HEALTHY = None   # check_health's answer for an engine that can serve


def _ready(handle):
    with thread_server(create_app(RemoteService(handle, "m"))) as base:
        return httpx.get(base + "/ready", timeout=10)


_NO_DEPLOYMENT = ray.serve.exceptions.DeploymentUnavailableError(
    ray.serve._private.common.DeploymentID("RerankReplica", "app"))


@pytest.mark.parametrize("answers, problem", [
    ([_unhealthy("engine dead: the canary failed too"), _unhealthy("engine stopped", "r2")],
     "RuntimeError: replica r1: engine dead: the canary failed too; RuntimeError: replica r2: engine stopped"),
    ([ray.exceptions.ActorDiedError()], "ActorDiedError"),
    ([], "0 probed"),
    (_NO_DEPLOYMENT, "no engine replica is running"),
    (TimeoutError("Timed out waiting for broadcast results."), "did not all answer the readiness probe"),
])
def test_front_is_unready_while_no_replica_can_serve(answers, problem):
    """The front's /ready was 200 whatever its replicas were (RemoteService.ready = True)."""
    r = _ready(_Handle(answers))
    assert r.status_code == 503 and problem in r.json()["error"]["message"], r.text
    assert "Traceback" not in r.text, "the remote traceback went into the probe's answer"


@pytest.mark.parametrize("answers", [[_unhealthy("engine dead: x"), HEALTHY], [HEALTHY]])
def test_front_is_ready_while_one_replica_can_serve(answers):
    """One engine serving is enough (requests of a dead one's contexts go to the next on the ring
    once Ray replaces it)."""
    r = _ready(_Handle(answers))
    assert r.status_code == 200 and r.json()["status"] == "ready", r.text


def test_front_probes_the_replicas_at_most_once_per_ttl(monkeypatch):
    handle = _Handle([HEALTHY])
    monkeypatch.setattr(ray_serve, "READY_PROBE_TTL_S", 0.5)
    with thread_server(create_app(RemoteService(handle, "m"))) as base:
        for _ in range(5):
            assert httpx.get(base + "/ready", timeout=10).status_code == 200
        assert handle.broadcasts == 1, handle.broadcasts
        handle.answers = [_unhealthy("engine dead: gone bad")]
        time.sleep(0.6)
        r = httpx.get(base + "/ready", timeout=10)
        assert r.status_code == 503 and "gone bad" in r.text and handle.broadcasts == 2, r.text


def test_concurrent_probes_share_one_broadcast():
    handle = _Handle([HEALTHY])
    service = RemoteService(handle, "m")

    async def main():
        return await asyncio.gather(*[service.readiness() for _ in range(8)])

    assert asyncio.run(main()) == [None] * 8 and handle.broadcasts == 1


@pytest.mark.parametrize("error", [ray.exceptions.ActorDiedError(), _NO_DEPLOYMENT])
def test_a_replica_gone_under_a_request_is_a_503(error):
    """Was the app's catch-all 500 "internal error: ActorDiedError": no fault of the request."""
    with thread_server(create_app(RemoteService(_Handle(call_error=error), "m"))) as base:
        r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["a"]), timeout=10)
    assert r.status_code == 503 and type(error).__name__ in r.json()["error"]["message"], r.text
    assert r.headers.get("retry-after") == "1"


class _HeldHandle(_Handle):
    """A handle whose calls are answered (200) once ``release`` is set; ``calls``: how many reached it."""

    def __init__(self, release):
        super().__init__()
        self.release, self.calls = release, 0

    def remote(self, method, body):
        self.calls += 1
        release = self.release

        class Response:
            def __await__(self):
                async def held():
                    while not release.is_set():
                        await asyncio.sleep(0.01)
                    return 200, dict(id="x", results=[], usage={}), {}
                return held().__await__()

            def cancel(self):
                pass
        return Response()


def _held_at_the_handle(base: str, pool, handle, body: dict, n: int) -> list:
    """``n`` /v1/rerank requests sent at once, returned (futures) once all have reached ``handle``."""
    held = [pool.submit(httpx.post, base + "/v1/rerank", json=body, timeout=30) for _ in range(n)]
    deadline = time.monotonic() + 30
    while handle.calls < n:
        assert time.monotonic() < deadline, f"{handle.calls} of {n} requests reached the handle"
        time.sleep(0.01)
    return held


def test_the_front_counts_max_queue_before_reading_the_body():
    """The Ray front admitted nothing itself: every request's body was read and held (up to
    --max-body-bytes each) until a replica refused it. Now the request past every replica's
    --max-queue together is a 429 with Retry-After from the front, before its body is read (the
    handle never sees it), and the slots come back once the others are answered."""
    release = threading.Event()
    handle = _HeldHandle(release)
    service = RemoteService(handle, "m", max_queue=2, num_replicas=2)
    body = dict(query="q", documents=["a"])
    with thread_server(create_app(service)) as base, ThreadPoolExecutor(4) as pool:
        held = _held_at_the_handle(base, pool, handle, body, 4)
        r = httpx.post(base + "/v1/rerank", json=body, timeout=30)
        assert r.status_code == 429 and "--max-queue 2 × 2 engine replicas" in r.json()["error"]["message"], r.text
        assert r.headers.get("retry-after") == "1" and handle.calls == 4 and service.admitted == 4
        release.set()
        assert [f.result().status_code for f in held] == [200] * 4
        assert httpx.post(base + "/v1/rerank", json=body, timeout=30).status_code == 200
    assert service.admitted == 0


def test_several_fronts_together_admit_what_the_engines_hold():
    """Each ingress replica counted the whole max_queue × num_replicas, so 3 fronts together admitted
    3 × what the engines hold, reading and holding every body until an engine refused it. Each now
    admits its share, ceil(max_queue × num_replicas / ingress_replicas): 2 × 3 / 4 -> 2 here, the
    third concurrent request a 429 before its body is read; build_app hands the share on."""
    release = threading.Event()
    handle = _HeldHandle(release)
    service = RemoteService(handle, "m", max_queue=3, num_replicas=2, ingress_replicas=4)
    assert [RemoteService(handle, "m", max_queue=q, num_replicas=r, ingress_replicas=i).limit
            for q, r, i in ((3, 2, 1), (3, 2, 3), (3, 2, 4), (1, 1, 5), (None, 2, 2))] == [6, 2, 2, 1, None]
    body = dict(query="q", documents=["a"])
    with thread_server(create_app(service)) as base, ThreadPoolExecutor(2) as pool:
        held = _held_at_the_handle(base, pool, handle, body, 2)
        r = httpx.post(base + "/v1/rerank", json=body, timeout=30)
        assert r.status_code == 429 and "share of 4 ingress replicas: 2" in r.json()["error"]["message"], r.text
        assert handle.calls == 2 and service.admitted == 2
        release.set()
        assert [f.result().status_code for f in held] == [200] * 2
    assert service.admitted == 0
    app = build_app(model=None, num_replicas=2, ingress_replicas=3, max_queue=5)
    assert app._bound_deployment.init_args[2:] == (2, 3), app._bound_deployment.init_args[2:]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ingress_replicas must be a positive int"):
            build_app(model=None, ingress_replicas=bad)


def _engine_families(documents: int):
    """A replica's metric families (RerankReplica.metrics' second item) after scoring ``documents``."""
    from acarerank.server.metrics import ServerMetrics

    m = ServerMetrics(lambda: {"hit_tokens": 3})
    m.documents.inc(documents)
    return list(m.registry.collect())


def test_the_fronts_metrics_are_its_own_and_each_replicas():
    """The front served every engine series of acarerank serve held at 0 (its ServerMetrics was never
    fed by an engine), and the replicas' were nowhere: documents_scored_total 0 under load read as an
    idle engine. Now its own HTTP series, then each replica's with a replica label; a replica that
    fails the scrape is left out of it."""
    from prometheus_client.parser import text_string_to_metric_families

    replicas = [("r1", _engine_families(5)), ("r2", _engine_families(7)), ray.exceptions.ActorDiedError()]
    with thread_server(create_app(RemoteService(_Handle(metrics=replicas), "m"))) as base:
        httpx.post(base + "/v1/rerank", content=b"{", timeout=10)   # the front's own 422
        text = httpx.get(base + "/metrics", timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("acarerank_documents_scored_total", (("replica", "r1"),))] == 5, text
    assert samples[("acarerank_documents_scored_total", (("replica", "r2"),))] == 7, text
    assert samples[("acarerank_prefix_cache_hit_tokens_total", (("cache", "rerank"), ("replica", "r2")))] == 3, text
    assert samples[("acarerank_errors_total", (("code", "422"),))] == 1, text
    unlabeled = {name for name, labels in samples if name.startswith("acarerank_") and "replica" not in dict(labels)}
    assert {n.rsplit("_", 1)[0] for n in unlabeled} <= {"acarerank_request_duration_seconds", "acarerank_requests",
                                                        "acarerank_errors", "acarerank_client_disconnects"}, unlabeled


def test_the_fronts_metrics_without_replicas_are_its_own():
    with thread_server(create_app(RemoteService(_Handle(metrics=_NO_DEPLOYMENT), "m"))) as base:
        r = httpx.get(base + "/metrics", timeout=10)
    assert r.status_code == 200 and "acarerank_requests_total" in r.text and "replica=" not in r.text, r.text


class _LocalHandle:
    """A handle whose ``call`` runs ``RerankReplica.call`` of a replica in this process (no Ray): the
    front's forwarding (dump, validate at the replica, errors as values) over a real service."""

    def __init__(self, replica):
        self.replica = replica

    def options(self, **kw):
        return self

    def remote(self, method, body):
        call = self.replica.call(method, body)

        class Response:
            def __await__(self):
                return call.__await__()

            def cancel(self):
                pass
        return Response()


@pytest.fixture(scope="module")
def fronts():
    """(acarerank serve's app, the Ray front's app over a replica of the same service): base URLs."""
    from acarerank.server import RerankService

    service = RerankService(PointwiseReranker(model=tiny_model()), "tiny", max_batch_tokens=256,
                            max_documents=8).start()
    try:
        with thread_server(create_app(service)) as direct, \
                thread_server(create_app(RemoteService(_LocalHandle(_replica(service)), "tiny"))) as front:
            yield direct, front
    finally:
        service.stop()


@pytest.mark.parametrize("path, body, status", [
    ("/score", dict(text_1="q", text_2=DOCS), 200),
    ("/v1/score", dict(queries=["q", "r", "q", "s"], documents=DOCS, request_id="r-1"), 200),
    ("/score", dict(data_1=["q"], data_2=DOCS[:1], question="why?", cache_salt="t",
                    chat_template_kwargs={"instruction": "Judge."}, max_tokens_per_doc=2), 200),
    ("/score", dict(queries=["a", "b"], documents=DOCS), 400),
    ("/score", dict(text_1="q", text_2=[f"d{i}" for i in range(9)]), 413),
    ("/score", dict(text_1="q", text_2=DOCS, use_activation=False), 400),
    ("/v1/score", dict(text_1="q"), 422),
    ("/score", dict(text_1="q", text_2=DOCS, request_id="x" * 257), 422),   # past MAX_REQUEST_ID_CHARS
])
def test_the_score_routes_answer_as_acarerank_serves(fronts, path, body, status):
    """The Ray front serves /score and /v1/score with acarerank serve's answers: status, error, data
    and usage (the id and created time are each response's own)."""
    answers = []
    for base in fronts:
        for _ in range(2):   # the second from the cached prefix on both: bit for bit the same passes
            r = httpx.post(base + path, json=body, timeout=60)
        out = r.json()
        if r.status_code == 200:
            assert out.pop("id").startswith("score-") and isinstance(out.pop("created"), int), out
        answers.append((r.status_code, out))
    assert answers[0][0] == status and answers[0] == answers[1], answers


def test_the_score_id_on_the_ray_front_is_the_bodys_request_id(fronts):
    """Ray Serve's proxy sets X-Request-Id on every request, so on the Ray front the body's
    request_id names the score response (the header only without one); acarerank serve takes the
    header first, as vLLM does. Before, every Ray answer's id was Ray's own (score-bedd650a-...)."""
    direct, front = fronts
    body = dict(text_1="q", text_2=DOCS[:1], request_id="my-id-1")
    hdr = {"X-Request-Id": "ray-made-7"}
    assert httpx.post(direct + "/score", json=body, headers=hdr, timeout=60).json()["id"] == "score-ray-made-7"
    assert httpx.post(front + "/score", json=body, headers=hdr, timeout=60).json()["id"] == "score-my-id-1"
    del body["request_id"]
    assert httpx.post(front + "/score", json=body, headers=hdr, timeout=60).json()["id"] == "score-ray-made-7"


@pytest.mark.parametrize("path, body, status, sent", ODD_BODIES)
def test_the_fronts_answer_odd_bodies_alike_without_ray(fronts, path, body, status, sent):
    """The same table over the Ray front's forwarding without a cluster (the replica in this process)."""
    _odd_answers(fronts, path, body, status, sent)


class _Refusing:
    """A service whose rerank refuses with the status its query names: an APIError (the engine's
    413, 429, 503, 504, with Retry-After on 429 and 503), or at 500 an exception nobody expected
    (the app's catch-all; through Ray, the replica's exception)."""
    ready = True
    model_name = "stub"

    def __init__(self):
        from acarerank.server.metrics import ServerMetrics
        self.metrics = ServerMetrics(engine=False)

    async def rerank(self, req, is_disconnected, headers=None):
        from acarerank.server.errors import APIError

        status = int(req.query)
        if status == 500:
            raise RuntimeError("the model raised")
        raise APIError(status, f"refused: {status}", {"Retry-After": "3"} if status in (429, 503) else None)

    def stop(self):  # the replica's __del__ stops its service (once the dropped apps let it go)
        pass


@pytest.fixture(scope="module")
def refusing_fronts():
    service = _Refusing()
    with thread_server(create_app(service)) as direct, \
            thread_server(create_app(RemoteService(_LocalHandle(_replica(service)), "stub"))) as front:
        yield direct, front


@pytest.mark.parametrize("status, error_type", [(413, "Validation"), (429, "Overloaded"), (503, "Unhealthy"),
                                                (504, "Overloaded"), (500, "Backend")])
@pytest.mark.parametrize("front", [0, 1], ids=["acarerank-serve", "ray-front"])
def test_teis_route_answers_the_engines_errors_in_teis_shape(refusing_fronts, front, status, error_type):
    """TEI's clients read ``error`` as the message: on /rerank a TEI body's refusal is TEI's
    ``{"error", "error_type"}`` with the same status and Retry-After, on both fronts; a documents
    body there, and /v1/rerank, keep ours."""
    from serve_util import expect_error, expect_tei_error

    base = refusing_fronts[front]
    words = [] if status == 500 else [f"refused: {status}"]
    r = httpx.post(base + "/rerank", json=dict(query=str(status), texts=["a"]), timeout=30)
    expect_tei_error(r, status, error_type, words)
    assert r.headers.get("retry-after") == ("3" if status in (429, 503) else None), r.headers
    expect_error(httpx.post(base + "/rerank", json=dict(query=str(status), documents=["a"]), timeout=30), status, words)
    expect_error(httpx.post(base + "/v1/rerank", json=dict(query=str(status), texts=["a"]), timeout=30), status, words)


@pytest.mark.parametrize("route", ["rerank", "score"])
def test_the_routing_key_reads_the_instruction_that_is_scored(route):
    """vLLM's chat_template_kwargs instruction is the request's instruction (it wins over the field):
    the routing key is that of the same context sent in the field, so its requests meet their cached
    prefix on one replica; routing_key read the field alone (None: no affinity)."""
    from acarerank.server.ray_serve import routing_key
    from acarerank.server.schemas import RerankRequest, ScorePairsRequest

    def req(**kw):
        if route == "rerank":
            return RerankRequest.model_validate(dict(query="q", documents=DOCS, **kw))
        return ScorePairsRequest.model_validate(dict(text_1="q", text_2=DOCS, **kw))
    by_field = routing_key(req(instruction="Judge the passage."))
    assert by_field is not None
    assert routing_key(req(chat_template_kwargs={"instruction": "Judge the passage."})) == by_field
    assert routing_key(req(instruction="other", chat_template_kwargs={"instruction": "Judge the passage."})) == by_field
    assert routing_key(req(chat_template_kwargs={})) is None


class _FakeService:
    """A service with the health() a replica reads; nothing else of it is called."""

    def __init__(self, **health):
        self.h = dict(dict(state="idle", busy_s=0.0, iterations=3), **health)

    def health(self):
        return self.h

    def stop(self):  # the replica's __del__ stops its service
        pass


def _replica(service, health_max_pass_s=None):
    """The deployment's class without Ray: its __init__ would build an engine."""
    from acarerank.server.ray_serve import RerankReplica
    replica = object.__new__(RerankReplica.func_or_class)
    replica.service, replica.replica, replica.health_max_pass_s = service, "r1", health_max_pass_s
    return replica


@pytest.mark.parametrize("health, bound, problem", [
    (dict(state="dead", reason="the canary failed too"), None, "engine dead: the canary failed too"),
    (dict(state="stopped"), None, "engine stopped"),
    (dict(state="busy", busy_s=12.5), 10.0, "in one step for 12.5 s (more than max_pass_s=10)"),
])
def test_replica_health_check_fails_for_a_dead_or_wedged_engine(health, bound, problem):
    """Ray replaces a replica whose check_health raises; without it a dead engine would answer 503
    to everything routed to it for as long as the replica lived."""
    with pytest.raises(RuntimeError, match="replica r1: ") as e:
        _replica(_FakeService(**health), bound).check_health()
    assert problem in str(e.value), str(e.value)


@pytest.mark.parametrize("health, bound", [(dict(state="idle"), None), (dict(state="busy", busy_s=600.0), None),
                                           (dict(state="busy", busy_s=9.0), 10.0)])
def test_replica_health_check_passes_a_live_engine(health, bound):
    """A long pass is legitimate: only a bound the deployment set makes it unhealthy."""
    assert _replica(_FakeService(**health), bound).check_health() is None


def test_replica_health_check_fails_once_max_pass_timeout_declared_its_engine_dead():
    """build_app(..., max_pass_timeout=S) and one model step held past S, end to end without Ray: a real
    RerankService (its Engine and watchdog, a fake model) under the deployment's class. Once the
    watchdog declares the engine dead, check_health raises naming the flag, with no
    health_max_pass_s of the replica's own, and keeps raising after the held step returns (the
    engine stays dead): Ray replaces the replica. Before the bound it passes."""
    from acarerank.server.engine import EngineDead
    from acarerank.server.service import RerankService

    class Steps:   # no scoring: the held step is a call on the model thread
        max_batch_tokens = 100

        def cache_stats(self):
            return {}

    gate = threading.Event()
    service = RerankService(Steps(), "fake", max_pass_timeout=0.3)
    service.engine.start()
    try:
        replica = _replica(service)
        assert replica.check_health() is None
        held = service.engine.submit_call(lambda: gate.wait(30))
        with pytest.raises(EngineDead):
            held.future.result(10)
        for _ in range(2):   # while the step is held, and after it returned
            with pytest.raises(RuntimeError, match=r"replica r1: engine dead: the model thread has been in one "
                                                   r"step for 0\.\d s, more than --max-pass-timeout 0\.3 s"):
                replica.check_health()
            gate.set()
    finally:
        gate.set()
        service.stop()


@pytest.mark.parametrize("options", [dict(send_timeout=5.0), dict(host="0.0.0.0", port=9000),
                                     dict(drain_timeout=10.0), dict(header_timeout=1.0, max_connections=8)])
def test_build_app_refuses_the_options_of_the_connection(options):
    """Ray's proxy owns the connections and Ray the replicas' shutdown: build_app took these
    ServeConfig fields and applied none of them, so --send-timeout 5 silently stayed Ray's."""
    with pytest.raises(ValueError, match="not applied on Ray Serve") as e:
        build_app(model=None, **options)
    assert all(name in str(e.value) for name in options), str(e.value)


@pytest.mark.parametrize("options, words", [
    (dict(autoscaling_config={"min_replicas": 1, "max_replicas": 4}), ["autoscaling_config", "fixed num_replicas"]),
    (dict(num_replicas="auto"), ["num_replicas must be a positive int", "no autoscaling", "'auto'"]),
    (dict(max_queu=4), ["max_queu is not a ServeConfig field"]),
    (dict(max_queue=None), ["--max-queue must be set"]),
    (dict(max_queue=2, ingres_replicas=2, max_document=3), ["ingres_replicas, max_document are not ServeConfig"])])
def test_build_app_names_what_it_cannot_apply(options, words):
    """Ray's autoscaling_config and any unknown option were ServeConfig's TypeError (unexpected keyword
    argument), max_queue=None build_app's own (NoneType + int): each front's share of max_queue needs
    fixed replica counts and a max_queue, so build_app names what it cannot apply."""
    with pytest.raises(ValueError) as e:
        build_app(model=None, **options)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("bound", [-1.0, float("nan"), float("inf"), True, "300"])
def test_build_app_refuses_a_bad_health_bound(bound):
    with pytest.raises(ValueError, match="max_pass_s must be a finite number >= 0"):
        build_app(model=None, health_max_pass_s=bound)


def test_the_ingress_takes_the_bodies_being_received_besides_what_the_engines_hold():
    """The front reads a body before the request counts against its share of max_queue, so an
    ingress replica holds up to max_uploads requests more than the engines do: Ray's
    max_ongoing_requests counts them (else Ray's proxy held the surplus with no answer), and
    the front peeks at its share at the head (a 429 before the body) without taking a slot."""
    app = build_app(model=None, num_replicas=2, max_queue=5, max_uploads=7)
    ingress = app._bound_deployment
    assert ingress.init_args[0]._bound_deployment.max_ongoing_requests == 5 + 1
    assert ingress.max_ongoing_requests == 2 * (5 + 1) + 7 + INGRESS_SPARE_REQUESTS
    # max_uploads left out: the larger of 64 and the front's share (4 × 100 / 1), in Ray's count and
    # the front's gate — with max_queue's 100 instead, 101 stalled uploads refused everyone where
    # filling the front's 400 took 400
    app = build_app(model=None, num_replicas=4, max_queue=100)
    assert app._bound_deployment.max_ongoing_requests == 4 * (100 + 1) + 400 + INGRESS_SPARE_REQUESTS
    front = RemoteService(_HeldHandle(threading.Event()), "m", max_queue=100, num_replicas=4)
    assert front.admission_limit == 400
    gate = next(m for m in create_app(front).user_middleware if m.cls is Gate)
    assert gate.kwargs["max_uploads"] == 400
    service = RemoteService(_HeldHandle(threading.Event()), "m", max_queue=1, num_replicas=1)
    service.refuse_if_full()
    assert service.admitted == 0
    with service.admit():
        with pytest.raises(APIError) as e:
            service.refuse_if_full()
        assert e.value.status == 429 and "--max-queue 1" in e.value.message
    assert service.admitted == 0
