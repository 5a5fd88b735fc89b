"""``--drain-timeout`` is a bound: past it, requests still in flight are answered 503 (their work
dropped) and the process exits 0, even with a client still sending its body.

One subprocess server (the CLI, a tiny checkpoint, ``--drain-timeout 2``). Three requests of
1,000 documents (``--max-documents``) of ~1,700 characters (~350 tokens) under a query of
~32,000 characters (~6,400 tokens; one document per pass: ``--max-batch-tokens 64``;
``--max-request-chars`` raised to let them in) keep the engine busy far past the deadline. Every
document's pass attends to the whole query, so a document costs the engine as much as a
~7,200-character one under a short query (one such request took ~11 s on a 2-core Zen 5 EPYC,
2026-12-06) at a third of the tokenizing, the test's and the server's (3x): on a loaded 2-core
box (2026-12-07) ~39 ms a document in the engine against ~0.6 ms tokenizing it, where the
~7,200-character ones took 23-30 ms and 1.8 ms. The three are admitted sooner, so the drain
cuts the first request earlier in the same work. Documents of ~2,400 characters under a short
query took ~6 s on 2026-12-02 but 2.5–2.7 s on the Zen 5 with 2 threads, and a request finished
inside the drain (a 200 where the test wants 503: fresh-clone CI at a0cb05b); ~370 characters
took 1.8 s. A fourth client sends its head and half of its body, then nothing (in flight for
the drain, not admitted: its body is not whole).
``--max-queue-tokens`` holds two of the three: the third waits for room in it (a wait the drain
ends as it ends the rest, 503).
"""
import json
import signal
import socket
import threading
import time

import pytest
from _optional import require

require("httpx", "fastapi", "uvicorn")

import httpx  # noqa: E402

from acarerank import PointwiseReranker, ScoreRequest  # noqa: E402
from serve_util import serve_subprocess, tiny_model  # noqa: E402

DRAIN = 2.0
MARGIN = 5.0   # seconds of slack for the exit on a loaded machine


def test_drain_deadline_answers_503_and_exits(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    docs = [f"document {i}: " + "the tutor gives the reranker a hint about bread and rivers " * 28 for i in range(1000)]
    question = " what does the tutor say about bread" * 900   # the long shared part (module docstring)
    enc = PointwiseReranker(model=model).encode(ScoreRequest("drain 0" + question, docs))
    tokens = len(enc.shared_ids) + sum(map(len, enc.segment_ids))   # what --max-queue-tokens counts
    out = {}
    with serve_subprocess("--model", str(tmp_path), "--dtype", "float32", "--max-batch-tokens", "64",
                          "--drain-timeout", str(DRAIN), "--max-queue-tokens", str(tokens * 5 // 2),
                          "--max-request-chars", "8000000") as (base, proc):
        port = int(base.rsplit(":", 1)[1])

        def long_request(k):
            out[k] = httpx.post(base + "/v1/rerank", json=dict(query=f"drain {k}" + question, documents=docs),
                                timeout=120)

        threads = [threading.Thread(target=long_request, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        slow = socket.create_connection(("127.0.0.1", port), timeout=10)
        body = json.dumps(dict(query="slow", documents=["d"])).encode()
        slow.sendall(f"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:10])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # three admitted, one waiting for tokens, one uploading (bounded wait)
            m = httpx.get(base + "/metrics").text
            if "acarerank_requests_in_flight 3.0" in m and "acarerank_requests_waiting_for_tokens 1.0" in m \
                    and "acarerank_requests_uploading 1.0" in m:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the four requests were never in flight together, one waiting for tokens and "
                                 "one still uploading")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(DRAIN + MARGIN)
        took = time.monotonic() - t0
        assert code == 0, f"server exited with {code}"
        assert took <= DRAIN + MARGIN, f"exited {took:.1f} s after SIGTERM (--drain-timeout {DRAIN})"
        assert took >= DRAIN - 0.5, f"exited {took:.1f} s after SIGTERM: before the drain deadline"
        for t in threads:
            t.join(30)
        slow.settimeout(5)
        answer = b""
        while True:
            chunk = slow.recv(65536)
            if not chunk:
                break
            answer += chunk
        slow.close()
    for k in range(3):
        r = out[k]
        assert r.status_code == 503, f"request {k}: {r.status_code} {r.text[:200]}"
        err = r.json()["error"]
        assert err["code"] == 503 and "drain-timeout" in err["message"], err
    assert answer.startswith(b"HTTP/1.1 503"), answer[:200]
    assert b"drain-timeout" in answer, answer[:400]


def test_a_request_cut_during_its_parse_is_answered_as_one_not_parsed(monkeypatch):
    """On TEI's /rerank a body's fields pick the error shape (docs/serving.md, "Errors"); the app
    set the field set before the parse and the worker thread filled it, so a Cohere body cut by
    the drain deadline during its parse got our shape or TEI's by how far the worker had got.
    Now the fields count once the parse has ended: cut during it, the body is one not parsed
    (TEI's shape), whatever the worker had read."""
    from acarerank.server import RerankService, create_app
    from acarerank.server import app as app_module
    from acarerank.server.gate import GateState
    from serve_util import expect_tei_error, thread_server

    parsing, release = threading.Event(), threading.Event()
    real = app_module.parse_body

    def slow_parse(body, model_cls, fields=None, max_items=None):
        req = real(body, model_cls, fields, max_items)   # the fields are known here: "documents"
        parsing.set()
        release.wait(30)
        return req

    monkeypatch.setattr(app_module, "parse_body", slow_parse)
    service = RerankService(PointwiseReranker(model=tiny_model()), "tiny").start(warmup=False)   # never reached
    state = GateState()
    out = {}
    try:
        with thread_server(create_app(service, state=state)) as base:
            def post():
                out["r"] = httpx.post(base + "/rerank", json=dict(query="q", documents=["d"]), timeout=30)

            t = threading.Thread(target=post)
            t.start()
            assert parsing.wait(30), "the parse never started"
            loop = next(iter(state.tasks)).get_loop()
            loop.call_soon_threadsafe(state.expire)   # the drain deadline, as DrainingServer calls it
            t.join(30)
            release.set()
        expect_tei_error(out["r"], 503, "Unhealthy", ["--drain-timeout"])
    finally:
        release.set()
        service.stop()
