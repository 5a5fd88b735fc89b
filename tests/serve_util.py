"""Helpers of the server tests: a tiny model, a real uvicorn on a free port in a thread
(``serve_subprocess`` runs the CLI as a process)."""
from __future__ import annotations

import contextlib
import re
import threading

from _tiny import random_qwen3
from acarerank.server.launch import free_port, serve_subprocess, wait_until  # noqa: F401 (re-exported)


def tiny_model(seed: int = 0):
    """A 2-layer random Qwen3 with the real vocabulary; yes/no rows spread so scores vary."""
    return random_qwen3(seed=seed, spread_yes_no=20, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                        head_dim=32, tie=True)


@contextlib.contextmanager
def thread_server(app, **uvicorn_options):
    """uvicorn serving ``app`` on a free port in a daemon thread; yields the base URL; stops it after.
    uvicorn_options: more of ``uvicorn.Config``'s (``root_path``)."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, **uvicorn_options))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(base + "/health")
        yield base
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "uvicorn thread did not stop"


def expect_tei_error(r, code: int, error_type: str, words=()):
    """``r`` is Text Embeddings Inference's error shape ``{"error": message, "error_type": type}``
    (its router's ``ErrorResponse``), what ``/rerank`` answers a TEI request (docs/serving.md, "Errors")."""
    assert r.status_code == code, f"expected {code}, got {r.status_code}: {r.text}"
    body = r.json()
    assert set(body) == {"error", "error_type"} and isinstance(body["error"], str), body
    assert body["error_type"] == error_type, body
    for w in words:
        assert w in body["error"], f"{w!r} not in {body['error']!r}"
    return r


def rss_mb(pid) -> float:
    """Resident memory of process ``pid`` in MB (VmRSS)."""
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024


def expect_error(r, code: int, words=()):
    """``r`` (an httpx response) is the documented error shape ``{"error": {message, type, code}}``
    with status ``code`` and each of ``words`` in its message (docs/serving.md, "Errors")."""
    assert r.status_code == code, f"expected {code}, got {r.status_code}: {r.text}"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code"} and err["code"] == code, err
    for w in words:
        assert w in err["message"], f"{w!r} not in {err['message']!r}"
    return r
