"""The gate under a path prefix, and a request cancelled under it by the server in front.

Ray Serve's ``route_prefix`` (and uvicorn's ``root_path``) give the app a ``scope["path"]`` that
starts with ``scope["root_path"]``; the routes match the rest. The gate compared the whole path,
so under "/acare" nothing was an API or probe path: a rerank body over 64 KiB was a 413, the
probes needed the API key, no request was admitted under --max-queue, every request counted as
endpoint "other" and TEI's route lost its error shape (found on the Ray front, 2026-12-07). Here
one uvicorn with ``root_path`` gives the app the same scope. Ray's proxy also cancels the call of
a client that leaves; the gate counted that as a 500 (an error) where uvicorn's front counts 499.
"""
import asyncio

import pytest
from _optional import require

require("httpx", "fastapi", "uvicorn", "prometheus_client")

import httpx  # noqa: E402

from acarerank import PointwiseReranker  # noqa: E402
from serve_util import thread_server, tiny_model  # noqa: E402

KEY = "sesame"


def _samples(text: str, name: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {tuple(sorted(s.labels.items())): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == name}


@pytest.fixture(scope="module")
def prefixed():
    """(base URL, service, the gate's state) of a server whose app sees every path under "/acare"."""
    from acarerank.server import RerankService, create_app
    from acarerank.server.config import ServeConfig
    from acarerank.server.gate import GateState

    svc = RerankService(PointwiseReranker(model=tiny_model()), "tiny", max_queue=4).start(warmup=False)
    state = GateState()
    try:
        with thread_server(create_app(svc, ServeConfig(api_key=KEY, max_queue=4), state=state),
                           root_path="/acare") as base:
            yield base, svc, state
    finally:
        svc.stop()


def test_the_probes_limits_and_metrics_hold_under_a_path_prefix(prefixed):
    base, svc, state = prefixed
    for probe in ("/health", "/ready", "/metrics"):   # no key: the probes pass straight through
        r = httpx.get(base + probe, timeout=10)
        assert r.status_code == 200, (probe, r.status_code, r.text)
    auth = {"Authorization": f"Bearer {KEY}"}
    big = ["word " * 20_000]   # a 100 kB body: over the 64 KiB of a request to no API path
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=big), headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["a"]), timeout=10)
    assert r.status_code == 401, r.text   # the API key still guards the API
    r = httpx.post(base + "/rerank", json=dict(query="q", texts=[]), headers=auth, timeout=10)
    assert r.status_code == 400 and set(r.json()) == {"error", "error_type"}, r.text   # TEI's shape
    requests = _samples(httpx.get(base + "/metrics", timeout=10).text, "acarerank_requests_total")
    assert requests.get((("code", "200"), ("endpoint", "/v1/rerank"))) == 1, requests
    assert not any(dict(k).get("endpoint") == "other" for k in requests), requests
    assert state.in_flight == 0 and svc.admitted == 0


def test_a_request_cancelled_by_the_server_in_front_counts_as_a_client_gone():
    """No response started, not draining, not stopping: the cancel is the client's leaving (Ray's
    proxy cancels its call), counted as 499 and a client disconnect, not as a 500 error."""
    from acarerank.server.errors import CLIENT_CLOSED
    from acarerank.server.gate import Gate, GateState
    from acarerank.server.metrics import ServerMetrics

    class Service:
        metrics = ServerMetrics(engine=False)

    started = asyncio.Event()

    async def app(scope, receive, send):
        started.set()
        await asyncio.sleep(60)

    async def run():
        state = GateState()
        gate = Gate(app, state, Service(), None, 1 << 20, 10.0)
        body = [{"type": "http.request", "body": b"{}", "more_body": False}]
        scope = {"type": "http", "method": "POST", "path": "/v1/rerank", "root_path": "", "raw_path": b"/v1/rerank",
                 "headers": [(b"content-length", b"2")]}
        task = asyncio.create_task(gate(scope, lambda: asyncio.sleep(0, body.pop()), lambda m: asyncio.sleep(0)))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return state

    state = asyncio.run(run())
    assert state.in_flight == 0 and not state.tasks
    text = Service.metrics.render().decode()
    requests = _samples(text, "acarerank_requests_total")
    assert requests == {(("code", str(CLIENT_CLOSED)), ("endpoint", "/v1/rerank")): 1}, requests
    assert _samples(text, "acarerank_client_disconnects_total") == {(("endpoint", "/v1/rerank"),): 1}
    assert not _samples(text, "acarerank_errors_total"), text
