"""``acarerank serve`` as a process: SIGTERM drains (in-flight requests finish, new ones get 503; a
second SIGTERM changes nothing); SIGINT stops without a drain, what it cuts answered 503.

One subprocess server (the CLI itself, on a saved tiny checkpoint). A long request is held in
flight by many small passes (``--max-batch-tokens 64``, 300 documents, one per pass); SIGTERM arrives
while it runs.
"""
import signal
import threading

import pytest

from _optional import require

require("fastapi", "uvicorn", "httpx")
import httpx  # noqa: E402

from acarerank import PointwiseReranker
from serve_util import serve_subprocess, tiny_model, wait_until


def test_sigterm_drains_in_flight_and_refuses_new(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    # 300 documents of ~70 tokens: each pass (64-token cap) holds one, so the request spans 300 passes
    docs = [f"document {i}: " + "the tutor gives the reranker a hint about bread and rivers " * 6 for i in range(300)]
    out = {}
    with serve_subprocess("--model", str(tmp_path), "--dtype", "float32", "--max-batch-tokens", "64",
                          "--api-key", "k") as (base, proc):
        auth = {"Authorization": "Bearer k"}
        assert httpx.get(base + "/v1/models", headers=auth).json()["data"][0]["id"] == tmp_path.name

        def long_request():
            out["long"] = httpx.post(base + "/v1/rerank", json=dict(query="drain", documents=docs), headers=auth,
                                     timeout=300)

        t = threading.Thread(target=long_request)
        t.start()
        # wait (bounded) until the request is admitted, then signal
        for _ in range(600):
            m = httpx.get(base + "/metrics").text
            if "acarerank_requests_in_flight 1.0" in m:
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("the long request was never admitted")
        proc.send_signal(signal.SIGTERM)
        wait_until(base + "/ready", status=503, timeout=30, proc=proc)
        # a second SIGTERM (a wrapper's, a process group's) changes nothing: it reached uvicorn, which
        # stopped at once, answered the request a text/plain 500 and the process died by the signal
        proc.send_signal(signal.SIGTERM)
        r = httpx.post(base + "/v1/rerank", json=dict(query="late", documents=["d"]), headers=auth, timeout=30)
        assert t.is_alive(), "the long request finished before the drain began: the test proves nothing"
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == 503 and "draining" in r.json()["error"]["message"]
        assert httpx.get(base + "/health").status_code == 200
        t.join(300)
        assert proc.wait(60) == 0, f"server exited with {proc.returncode}"
    r = out["long"]
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    want = PointwiseReranker(model=model).score("drain", docs)
    assert sorted(got) == list(range(len(docs)))
    diff = max(abs(got[i] - want[i]) for i in range(len(docs)))
    assert diff <= 1e-6, f"drained request: max |server - offline| = {diff:.3g}"


@pytest.mark.parametrize("ctrl_c", [1, 2])
def test_sigint_answers_what_it_cuts_503_in_json_and_exits_130(tmp_path, ctrl_c):
    """SIGINT is uvicorn's stop (no drain): a request still running after its one-second grace is
    cancelled. uvicorn answered it a text/plain 500 ("Internal Server Error"); now the gate's JSON
    503, and the process exits 130 as documented. A second Ctrl-C (uvicorn's forced exit) did the
    same but printed a ~40-line traceback (the app's lifespan task cancelled) before the one line."""
    tiny_model().save_pretrained(tmp_path)
    # ~140 tokens each, one per pass: ~10 s of passes on a 2-core VM (1,000 of half the length took
    # 1.7 s, which a faster machine would finish inside the grace)
    docs = [f"document {i}: " + "the tutor gives the reranker a hint about bread and rivers " * 12 for i in range(3000)]
    out = {}
    with serve_subprocess("--model", str(tmp_path), "--dtype", "float32", "--max-batch-tokens", "64",
                          "--max-documents", "3000") as (base, proc):
        t = threading.Thread(target=lambda: out.setdefault("r", httpx.post(
            base + "/v1/rerank", json=dict(query="cut", documents=docs), timeout=120)))
        t.start()
        for _ in range(600):
            if "acarerank_requests_in_flight 1.0" in httpx.get(base + "/metrics").text:
                break
            threading.Event().wait(0.05)
        else:
            raise AssertionError("the long request was never admitted")
        proc.send_signal(signal.SIGINT)
        if ctrl_c == 2:
            threading.Event().wait(0.3)
            proc.send_signal(signal.SIGINT)
        t.join(120)
        assert proc.wait(60) == 130, f"server exited with {proc.returncode}"
        output = proc.output()
        assert "Traceback" not in output and output.rstrip().endswith("acarerank serve: interrupted"), output[-3000:]
    r = out["r"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", (r.status_code, r.text[:200])
    assert "server shut down before this request finished" in r.json()["error"]["message"], r.text
