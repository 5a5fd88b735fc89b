"""``acarerank serve`` as a process whose engine dies (a ``BaseException`` escapes the scoring
pass, injected by ``fault_serve.py``, or every pass fails and so does the canary): the waiting
request, the probes and a later request get 503 with the reason, the traceback is logged, and the
process exits non-zero on its own."""
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from _optional import require

require("fastapi", "uvicorn", "httpx")
import httpx  # noqa: E402

from acarerank.server.front import EXIT_ENGINE_DEAD  # noqa: E402
from _repo import ROOT  # noqa: E402
from serve_util import free_port, tiny_model, wait_until  # noqa: E402

HELPER = Path(__file__).with_name("fault_serve.py")


def helper_env(fault: str) -> dict:
    """The helper's environment: this checkout's package first (run as a script, the helper would
    import whichever acarerank is installed — another checkout's, in a git worktree)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # --malloc's own default holds
    return dict(env, FAULT=fault, OMP_NUM_THREADS="1", PYTHONPATH=path)


def serve_until_exit(tmp_path, fault: str, drive, *flags) -> tuple:
    """Start the helper server with ``fault`` injected, ``drive(base_url, proc)`` once it is ready, then
    wait for the process to exit on its own: (its exit status, its log)."""
    tiny_model().save_pretrained(tmp_path)
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen([sys.executable, str(HELPER), "serve", "--model", str(tmp_path), "--dtype",
                                 "float32", "--port", str(port), *flags], env=helper_env(fault), stdout=log,
                                stderr=subprocess.STDOUT, text=True)
        try:
            base = f"http://127.0.0.1:{port}"
            wait_until(base + "/ready", timeout=180, proc=proc)
            drive(base, proc)
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
            log.seek(0)
            out = log.read()
    return code, out


@pytest.mark.parametrize("fault", ["SystemExit", "KeyboardInterrupt"])
def test_dead_engine_answers_503_then_the_process_exits_nonzero(tmp_path, fault):
    def drive(base, _proc):
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        r = httpx.post(base + "/v1/rerank", json=dict(query="poison", documents=["a", "b"]), timeout=30)
        assert r.status_code == 503 and fault in r.json()["error"]["message"], r.text
        for path in ("/health", "/ready"):
            r = httpx.get(base + path, timeout=5)
            assert r.status_code == 503 and fault in r.json()["error"]["message"], f"{path}: {r.text}"
        r = httpx.post(base + "/v1/rerank", json=dict(query="later", documents=["a"]), timeout=5)
        assert r.status_code == 503, r.text

    code, out = serve_until_exit(tmp_path, fault, drive)
    assert code == EXIT_ENGINE_DEAD, f"exit status {code}\n{out[-3000:]}"
    assert "engine dead" in out and "Traceback" in out and "injected into the scoring pass" in out, out[-3000:]
    # the start-up line: the server's process tuned its malloc (--malloc tuned), so CPU passes hold 4,096 tokens
    assert "max_batch_tokens 4096" in out and "malloc tuned (mmap threshold 512 MB, trim threshold 1024 MB)" in out, \
        out[-3000:]


def test_sticky_fault_fails_the_canary_then_the_process_exits_nonzero(tmp_path):
    """Every pass fails once a poisoned one has (a device broken for good): with
    ``--canary-after-failures 2`` the first request gets its 500, the second failure runs the canary,
    it fails, and the server answers 503 and exits with EXIT_ENGINE_DEAD, as for a dead loop."""
    def drive(base, _proc):
        r = httpx.post(base + "/v1/rerank", json=dict(query="poison", documents=["a", "b"]), timeout=30)
        assert r.status_code == 500, r.text
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        r = httpx.post(base + "/v1/rerank", json=dict(query="later", documents=["a"]), timeout=30)
        assert r.status_code == 503 and "canary" in r.json()["error"]["message"], r.text
        for path in ("/health", "/ready"):
            r = httpx.get(base + path, timeout=5)
            assert r.status_code == 503 and "canary" in r.json()["error"]["message"], f"{path}: {r.text}"

    code, out = serve_until_exit(tmp_path, "sticky", drive, "--canary-after-failures", "2")
    assert code == EXIT_ENGINE_DEAD, f"exit status {code}\n{out[-3000:]}"
    assert out.count("engine dead: the engine is broken: the model failed 2 requests in a row") == 1, out[-3000:]


def test_an_engine_that_dies_during_the_shutdown_exits_nonzero(tmp_path):
    """SIGTERM with a request in its pass: the drain gives up (--drain-timeout 0.2, a 503), uvicorn
    stops, and the pass, still running, raises SystemExit during the final stop — the engine dies
    after uvicorn. The exit status was computed before that stop: 0, as for a clean shutdown."""
    import signal
    import threading
    import time

    def drive(base, proc):
        answers = []
        poisoned = threading.Thread(target=lambda: answers.append(httpx.post(
            base + "/v1/rerank", json=dict(query="poison", documents=["a"]), timeout=30).status_code))
        poisoned.start()
        deadline = time.monotonic() + 30
        while httpx.get(base + "/health", timeout=5).json()["engine"]["state"] != "busy":  # the pass holds it
            assert time.monotonic() < deadline and proc.poll() is None, "the poisoned pass never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        poisoned.join(30)
        assert answers == [503], answers

    code, out = serve_until_exit(tmp_path, "at_shutdown", drive, "--drain-timeout", "0.2")
    assert code == EXIT_ENGINE_DEAD, f"exit status {code}\n{out[-3000:]}"
    assert "engine dead" in out and "SystemExit: injected into the scoring pass" in out, out[-3000:]


def test_a_step_past_max_pass_timeout_answers_503_then_the_process_exits_nonzero(tmp_path):
    """--max-pass-timeout 2 and a pass that never returns (a wedged kernel): the request in it gets
    the dead engine's 503 naming the flag once the step passed 2 s, as do the probes and a later
    request; the process exits EXIT_ENGINE_DEAD on its own (the wedged model thread cannot be
    joined: the stop's hard exit), one 'engine dead' line with the wedged thread's stack. Without
    the flag the request waited for ever, /health and /ready stayed 200 and the process served on."""
    import time

    def drive(base, _proc):
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/rerank", json=dict(query="poison", documents=["a", "b"]), timeout=30)
        assert r.status_code == 503 and "--max-pass-timeout 2 s" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 15, f"answered after {time.monotonic() - t0:.1f} s"
        for path in ("/health", "/ready"):
            r = httpx.get(base + path, timeout=5)
            assert r.status_code == 503 and "--max-pass-timeout" in r.json()["error"]["message"], f"{path}: {r.text}"
        r = httpx.post(base + "/v1/rerank", json=dict(query="later", documents=["a"]), timeout=5)
        assert r.status_code == 503, r.text

    code, out = serve_until_exit(tmp_path, "hang", drive, "--max-pass-timeout", "2")
    assert code == EXIT_ENGINE_DEAD, f"exit status {code}\n{out[-3000:]}"
    assert out.count("engine dead: the model thread has been in one step for") == 1, out[-3000:]
    assert "score_or_die" in out and "exiting with model work still running" in out, out[-3000:]


def test_a_wedged_warm_up_exits_with_its_error_line(tmp_path):
    """The warm-up pass never returns and --max-pass-timeout ends it: one runtime-error line naming
    the flag and exit 1, within seconds. The start failed, but Python's exit waited for the
    model thread still in that pass: the process printed nothing and hung (until killed)."""
    tiny_model().save_pretrained(tmp_path)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(HELPER), "serve", "--model", str(tmp_path), "--dtype", "float32",
                           "--port", str(free_port()), "--max-pass-timeout", "2"], env=helper_env("hang_always"),
                          capture_output=True, text=True, timeout=150)
    err = [x for x in proc.stderr.splitlines() if x.startswith("acarerank serve:")]
    assert proc.returncode == 1 and len(err) == 1 and err[0].startswith("acarerank serve: runtime error: ") \
        and "--max-pass-timeout" in err[0], (proc.returncode, proc.stderr[-3000:])
    # the start's stop does not wait for the wedged step (it took its whole 30 s timeout first)
    assert time.monotonic() - t0 < 25, time.monotonic() - t0


def test_a_failed_warm_up_exits_with_its_error_line(tmp_path):
    """The warm-up pass fails (every pass does): one runtime-error line and exit 1, at once. The
    scheduler and model threads were left running, so the process printed its error and then hung
    at interpreter exit (until killed)."""
    tiny_model().save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, str(HELPER), "serve", "--model", str(tmp_path), "--dtype", "float32",
                           "--port", str(free_port())], env=helper_env("always"), capture_output=True, text=True,
                          timeout=120)
    err = [x for x in proc.stderr.splitlines() if x.startswith("acarerank serve:")]
    assert proc.returncode == 1 and err == ["acarerank serve: runtime error: EngineFault: RuntimeError: injected into "
                                            "the scoring pass"], (proc.returncode, proc.stderr[-3000:])


def test_a_model_too_short_for_its_warm_up_request_is_a_usage_error_line_and_exit_2(tmp_path):
    """A model of 128 positions cannot score the warm-up request: the start stops its threads and
    raises a ValueError, main's 'error:' line and exit 2 (a usage error: serve a longer model). The
    model thread, told to end but not yet ended when the error reached the CLI, took the wedged
    start's hard exit instead: 'runtime error: ValueError: ...' and exit 1."""
    from _tiny import random_qwen3

    random_qwen3(seed=0, spread_yes_no=20, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                 tie=True, max_position_embeddings=128).save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, str(HELPER), "serve", "--model", str(tmp_path), "--dtype", "float32",
                           "--port", str(free_port())], env=helper_env("RuntimeError"), capture_output=True,
                          text=True, timeout=120)
    err = [x for x in proc.stderr.splitlines() if x.startswith("acarerank serve:")]
    assert proc.returncode == 2 and len(err) == 1 and err[0].startswith(
        "acarerank serve: error: the server cannot score its own warm-up request"), \
        (proc.returncode, proc.stderr[-3000:])
