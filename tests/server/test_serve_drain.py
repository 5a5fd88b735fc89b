"""``acarerank serve`` as a process: SIGTERM drains (in-flight requests finish, new ones get 503).

One subprocess server (the CLI itself, on a saved tiny checkpoint). A long request is held in
flight by many small passes (``--max-batch-tokens 64``, 300 documents, one per pass); SIGTERM arrives
while it runs.
"""
import signal
import threading

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
