"""The gate reads a request's body before the request takes its ``--max-queue`` slot, under a
bound of its own (``--max-uploads``), as nginx buffers a body before its upstream sees it.

Until 2026-12-06 the slot was taken at the head and held while the body arrived (up to
``--body-timeout``, 60 s by default): with ``--max-queue 4``, four clients that sent half a body
and stalled made every other client a 429 for 60 s. One in-process server (uvicorn in a thread,
``create_app`` over a started ``RerankService`` of the tiny model), raw loopback sockets for the
stalled uploads, ``--body-timeout`` 1.5 s.
"""
import contextlib
import json
import socket
import threading
import time

import pytest
from _optional import require

require("httpx", "fastapi", "uvicorn", "prometheus_client")

import httpx  # noqa: E402

from acarerank import PointwiseReranker  # noqa: E402
from serve_util import thread_server, tiny_model  # noqa: E402

BODY_TIMEOUT = 1.5
MARGIN = 3.0   # seconds of slack on a loaded 2-core machine
BODY = json.dumps(dict(query="q", documents=["a document about bread"])).encode()


@pytest.fixture(scope="module")
def reranker():
    return PointwiseReranker(model=tiny_model())


@contextlib.contextmanager
def serving(reranker, service_queue=None, **limits):
    """(base URL, port, service, the gate's state) of a server with ``limits`` (ServeConfig fields);
    ``service_queue``: the service's own max_queue, the config's left as it is (an embedding
    application's create_app(service))."""
    from acarerank.server import RerankService, create_app
    from acarerank.server.config import ServeConfig
    from acarerank.server.gate import GateState

    svc = RerankService(reranker, "tiny", max_queue=service_queue or limits.get("max_queue", 512)).start(warmup=False)
    state = GateState()
    try:
        with thread_server(create_app(svc, ServeConfig(**{"body_timeout": BODY_TIMEOUT, **limits}), state=state)) as base:
            yield base, int(base.rsplit(":", 1)[1]), svc, state
    finally:
        svc.stop()


def stall(port, sent: bytes = BODY[:10], length=len(BODY), path: str = "/v1/rerank") -> socket.socket:
    """A connection that sent a POST's head (to ``path``) and ``sent`` of its body, then nothing;
    ``length`` None: a chunked body (``sent`` is its first chunk, if any)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    framing = "Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}"
    if length is None and sent:
        sent = f"{len(sent):x}\r\n".encode() + sent + b"\r\n"
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              f"{framing}\r\n\r\n".encode() + sent)
    return s


def answer(s: socket.socket, limit: float) -> tuple:
    """(status, headers, JSON body or None, seconds until the whole response had arrived) of the
    one response on ``s``; AssertionError if none came within ``limit`` seconds."""
    s.settimeout(0.05)
    t0, data = time.monotonic(), b""
    while time.monotonic() - t0 < limit:
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            chunk = None
        except ConnectionResetError:
            break
        if chunk == b"":
            break
        data += chunk or b""
        head, sep, body = data.partition(b"\r\n\r\n")
        if sep:
            lines = head.decode("latin-1").split("\r\n")
            headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
            if len(body) >= int(headers.get("content-length", -1)):
                return int(lines[0].split()[1]), headers, json.loads(body), time.monotonic() - t0
    raise AssertionError(f"no whole response within {limit} s: {data[:300]!r}")


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def uploading_gauge(base) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for sample in fam.samples:
            if sample.name == "acarerank_requests_uploading":
                return sample.value
    raise AssertionError("no acarerank_requests_uploading in /metrics")


def settled(svc, state) -> None:
    """Every count back to 0: nothing leaked by a 408, 413, 429, 499 or a cancel."""
    wait_for(lambda: state.uploading == 0 and state.in_flight == 0 and svc.admitted == 0,
             f"counts back to 0 (uploading {state.uploading}, in flight {state.in_flight}, admitted {svc.admitted})")


def test_stalled_uploads_hold_no_queue_slot_and_get_408(reranker):
    """--max-queue 1 and three stalled uploads: a whole request is still answered 200 (before: 429
    for the body timeout), and the stalled ones get their 408 at --body-timeout."""
    with serving(reranker, max_queue=1) as (base, port, svc, state):
        stalled = [stall(port) for _ in range(3)]
        t0 = time.monotonic()
        try:
            wait_for(lambda: state.uploading == 3, "three uploads in progress")
            assert svc.admitted == 0 and uploading_gauge(base) == 3
            r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["bread", "rivers"]), timeout=30)
            assert r.status_code == 200, r.text
            for s in stalled:
                code, _, err, _ = answer(s, BODY_TIMEOUT + MARGIN)
                assert code == 408 and "--body-timeout" in err["error"]["message"], (code, err)
            assert time.monotonic() - t0 <= BODY_TIMEOUT + MARGIN
        finally:
            for s in stalled:
                s.close()
        settled(svc, state)
        assert uploading_gauge(base) == 0


def test_uploads_past_max_uploads_get_429_before_their_body(reranker):
    """One upload more than --max-uploads is a 429 naming the flag, with Retry-After, at its head
    (a chunked body, not a byte of it sent); the uploads that leave (499) or go past
    --max-body-bytes (413, chunked) give their place back, and the next request is answered."""
    with serving(reranker, max_queue=4, max_uploads=2, max_body_bytes=4096) as (base, port, svc, state):
        first, second = stall(port), stall(port, b"x" * 100, None)
        try:
            wait_for(lambda: state.uploading == 2, "two uploads in progress")
            with stall(port, b"", None) as third:
                code, headers, err, _ = answer(third, 10)
            assert code == 429 and "--max-uploads 2" in err["error"]["message"], (code, err)
            assert headers.get("retry-after") == "1", headers
            assert svc.admitted == 0 and state.uploading == 2
            first.close()   # 499
            second.sendall(b"1388\r\n" + b"x" * 5000 + b"\r\n")   # past --max-body-bytes: 413
            code, _, err, _ = answer(second, 10)
            assert code == 413 and "4096" in err["error"]["message"], (code, err)
        finally:
            first.close()
            second.close()
        settled(svc, state)
        assert httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["d"]), timeout=30).status_code == 200
        settled(svc, state)


@pytest.mark.parametrize("queue", [dict(max_queue=70), dict(service_queue=70)], ids=["config", "service"])
def test_left_out_max_uploads_is_never_below_the_queue(reranker, queue):
    """Without --max-uploads the gate takes the larger of 64 and the queue the service admits to:
    with a queue of 70, 70 stalled uploads are all read and the 71st is the 429 (naming 70) — a
    bound of 64 would let fewer stalled clients refuse everyone than the 70 that filling the queue
    took before. "service": create_app(service) with a config that leaves both out (an embedding
    application's, the service holding its own max_queue) took the config's default 512 and read
    the 71st too; a service with max_queue 1,000 was refused to everyone by 512 stalled uploads."""
    with serving(reranker, **queue) as (base, port, svc, state):
        stalled = []
        try:
            stalled = [stall(port) for _ in range(70)]
            wait_for(lambda: state.uploading == 70, "70 uploads in progress")
            with stall(port, b"", None) as extra:
                code, _, err, _ = answer(extra, 10)
            assert code == 429 and "--max-uploads 70" in err["error"]["message"], (code, err)
        finally:
            for s in stalled:
                s.close()
        settled(svc, state)


def test_a_full_queue_is_refused_at_the_head_and_again_after_the_upload(reranker):
    """A queue already full at the head: 429 naming --max-queue before the body is read (a look,
    no slot taken). One that fills while a body arrives: that request's 429 once its body is whole,
    saying so; the connection stays open (its body was read) and the slot count is unchanged."""
    with serving(reranker, max_queue=1) as (base, port, svc, state):
        held = svc.admit()
        held.__enter__()   # the queue's one slot, as a request in the engine holds it
        try:
            with stall(port, b"", 31_000_000) as s:
                code, headers, err, _ = answer(s, 10)
            assert code == 429 and "--max-queue 1" in err["error"]["message"], (code, err)
            assert headers.get("retry-after") == "1" and state.uploading == 0
        finally:
            held.__exit__(None, None, None)
        with stall(port) as s:
            wait_for(lambda: state.uploading == 1, "the upload in progress")
            assert svc.admitted == 0
            held = svc.admit()
            held.__enter__()   # the queue fills during the upload
            try:
                s.sendall(BODY[10:])
                code, headers, err, _ = answer(s, 10)
                assert code == 429 and "--max-queue 1" in err["error"]["message"], (code, err)
                assert "filled while this request's body arrived" in err["error"]["message"], err
                assert headers.get("retry-after") == "1" and headers.get("connection") != "close", headers
                assert svc.admitted == 1
            finally:
                held.__exit__(None, None, None)
            # the same connection: the next request on it is answered
            s.sendall(b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY)
            code, _, out, _ = answer(s, 30)
            assert code == 200 and len(out["results"]) == 1, (code, out)
        settled(svc, state)


def test_the_drain_deadline_answers_an_upload_in_progress(reranker):
    """An upload still arriving at the drain deadline is answered 503 as before (the drain waits
    for it: it is in flight), and gives its place back."""
    with serving(reranker, max_queue=1) as (base, port, svc, state):
        with stall(port) as s:
            wait_for(lambda: state.uploading == 1 and state.in_flight == 1, "the upload in flight")
            state.draining = True
            loop = next(iter(state.tasks)).get_loop()
            loop.call_soon_threadsafe(state.expire)   # as DrainingServer calls it
            code, _, err, _ = answer(s, 10)
            assert code == 503 and "--drain-timeout" in err["error"]["message"], (code, err)
        settled(svc, state)


def test_bodies_of_requests_to_no_api_path_are_bounded_in_time_and_number(reranker):
    """A POST to no API path is read within LINGER_S (408), not --body-timeout, and at most
    LINGER_READS such bodies at once: the next is a 429 at its head. Before, each was read for the
    whole --body-timeout, uncounted: under Ray Serve, 140 stalled ones held every request the
    ingress takes, and its proxy queued /health behind them with no answer for 20 s."""
    from acarerank.server.gate import LINGER_READS, LINGER_S

    with serving(reranker, body_timeout=60.0) as (base, port, svc, state):
        stalled = [stall(port, b"x", 1000, path="/nope") for _ in range(LINGER_READS)]
        t0 = time.monotonic()
        try:
            wait_for(lambda: state.lingering == LINGER_READS, f"{LINGER_READS} bodies of /nope being read")
            with stall(port, b"x", 1000, path="/nope") as extra:
                code, headers, err, _ = answer(extra, 5)
            assert code == 429 and "no API path" in err["error"]["message"], (code, err)
            assert headers.get("retry-after") == "1" and headers.get("connection") == "close", headers
            assert httpx.get(base + "/health", timeout=5).status_code == 200
            r = httpx.post(base + "/v1/rerank", json=dict(query="q", documents=["bread"]), timeout=30)
            assert r.status_code == 200, r.text
            for s in stalled:
                code, _, err, _ = answer(s, LINGER_S + MARGIN)
                assert code == 408 and "/nope" in err["error"]["message"], (code, err)
            assert time.monotonic() - t0 <= LINGER_S + MARGIN
        finally:
            for s in stalled:
                s.close()
        settled(svc, state)
        wait_for(lambda: state.lingering == 0, "no body of /nope being read")
        # a small body to no API path sent whole is read and answered by the app, as before
        r = httpx.post(base + "/nope", content=b"x" * 100, timeout=10)
        assert r.status_code == 404, r.text


def test_max_uploads_is_a_flag_checked_as_the_others():
    """Left out, the bound is the larger of 64 and --max-queue: never fewer uploads than the queue's
    slots, which uploads held before they had their own bound (64 with the default --max-queue 512
    let 64 stalled clients refuse everyone, where it took 512); set, it is what it says."""
    from acarerank.server.config import DEFAULT_MAX_UPLOADS, ServeConfig

    assert DEFAULT_MAX_UPLOADS == 64 and ServeConfig().max_uploads is None
    assert ServeConfig().uploads_beside(None) == ServeConfig().max_queue == 512
    assert ServeConfig(max_queue=4).uploads_beside(None) == 64
    assert ServeConfig(max_queue=100).uploads_beside(None) == 100
    assert ServeConfig(max_queue=100, max_uploads=3).uploads_beside(None) == 3
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="--max-uploads"):
            ServeConfig(max_uploads=bad)
    import argparse

    args = ServeConfig.add_cli_args(argparse.ArgumentParser()).parse_args(["--max-uploads", "3"])
    assert ServeConfig.from_cli_args(args).uploads_beside(None) == 3
    args = ServeConfig.add_cli_args(argparse.ArgumentParser()).parse_args(["--max-queue", "200"])
    assert ServeConfig.from_cli_args(args).uploads_beside(None) == 200
