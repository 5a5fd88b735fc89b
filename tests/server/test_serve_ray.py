"""The Ray Serve deployment on a local Ray instance: 2 engine replicas behind the HTTP front.

Checks that requests of one context (same cache_salt and question, growing trace) always land on
the same replica, that context-free traffic still works, that scores equal the offline
reranker's, and that errors keep their code and shape through Ray. Starting Ray, Serve and three
replica processes dominates: ~50 s on 2 quiet cores (2+ min on a loaded machine).
"""
import pytest
from _optional import require

require("fastapi", "uvicorn", "httpx", "ray")
import httpx  # noqa: E402

from serve_util import free_port, tiny_model, wait_until

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from acarerank import PointwiseReranker  # noqa: E402
from acarerank.server.ray_serve import REPLICA_HEADER, build_app  # noqa: E402

DOCS = ["the tutor gives hints", "a recipe for bread", "setwise rerankers select documents", "weather today"]


@pytest.fixture(scope="module")
def ray_app(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-ckpt"))
    model = tiny_model()
    model.save_pretrained(path)
    port = free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(model=path, num_replicas=2, max_batch_tokens=256, dtype="float32"), name="acarerank",
                  route_prefix="/",
                  blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_until(base + "/ready", timeout=240)
        yield base, PointwiseReranker(model=model)
    finally:
        serve.shutdown()
        ray.shutdown()


def test_context_affinity_scores_and_errors(ray_app):
    base, rr = ray_app
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


@pytest.mark.parametrize("bound", [-1.0, float("nan"), float("inf"), True, "300"])
def test_build_app_refuses_a_bad_health_bound(bound):
    with pytest.raises(ValueError, match="max_pass_s must be a finite number >= 0"):
        build_app(model=None, health_max_pass_s=bound)
