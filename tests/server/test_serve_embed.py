"""``run_server`` embedded in an application's process: its bounded stop waits for the service's
own threads only and returns the status; only ``acarerank serve`` exits the process when model work
outlives the bound (docs/serving.md, "A dead engine is loud"). Child processes: a stop that exits
the process (os._exit) must not end the pytest run."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _optional import require

require("httpx", "fastapi", "uvicorn")

import httpx  # noqa: E402

from serve_util import free_port, tiny_model, wait_until  # noqa: E402

TESTS = Path(__file__).resolve().parent.parent

# an application: a worker thread of its own (non-daemon), the server in its main thread
_EMBEDDER = """
import sys, threading
from acarerank.server.build import build_service
from acarerank.server.config import ServeConfig
from acarerank.server.front import run_server

config = ServeConfig(model=sys.argv[1], dtype="float32", port=int(sys.argv[2]), drain_timeout=0.5)
done = threading.Event()
worker = threading.Thread(target=done.wait, name="app-worker")   # the application's, not model work
worker.start()
service = build_service(config).start(warmup=True)
status = run_server(service, config)
print("run_server returned", status, "app-worker alive", worker.is_alive(), flush=True)
done.set()
"""



def _signal_and_wait(child, sig) -> tuple:
    """Send ``sig`` to ``child`` and wait (30 s at most) for it to exit: (its stderr, seconds taken)."""
    t0 = time.monotonic()
    child.send_signal(sig)
    err = child.communicate(timeout=30)[1]
    return err, time.monotonic() - t0

def test_an_embedding_process_survives_the_stop_and_gets_the_status(tmp_path):
    tiny_model().save_pretrained(tmp_path)
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, "-c", _EMBEDDER, str(tmp_path), str(port)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(f"http://127.0.0.1:{port}/ready", timeout=120, proc=child)
        assert httpx.post(f"http://127.0.0.1:{port}/v1/rerank", json={"query": "q", "documents": ["d"]}).status_code == 200
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        child.kill()
    assert child.returncode == 0, (child.returncode, err[-2000:])
    assert "run_server returned 0 app-worker alive True" in out, (out, err[-2000:])
    assert "exiting with model work" not in err and "model work still running" not in err, err[-2000:]


def test_acarerank_serve_exits_within_its_bound_when_a_model_call_hangs(tmp_path):
    """The CLI keeps its hard exit: a pass that never returns does not hold the process past the
    drain deadline plus the stop's bound (front.SHUTDOWN_GRACE_S + 1 s after uvicorn stops)."""
    tiny_model().save_pretrained(tmp_path)
    port = free_port()
    env = dict(os.environ, FAULT="hang", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen([sys.executable, str(TESTS / "server" / "fault_serve.py"), "serve", "--model",
                              str(tmp_path), "--dtype", "float32", "--port", str(port), "--drain-timeout", "0.5"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until(base + "/ready", timeout=120, proc=child)
        with httpx.Client() as client:
            try:
                client.post(base + "/v1/rerank", json={"query": "poison", "documents": ["d"]}, timeout=1.5)
            except httpx.TimeoutException:
                pass   # the pass hangs, as meant
        err, took = _signal_and_wait(child, signal.SIGTERM)
    finally:
        child.kill()
    assert child.returncode == 0, (child.returncode, err[-2000:])
    assert took < 0.5 + 2.0 + 2.0 + 5.0, f"exited {took:.1f} s after SIGTERM"
    assert "exiting with model work still running (acarerank-model" in err, err[-2000:]


# ``acarerank serve`` with a slow model load (``load``) or a pause between the service's start and
# run_server (``gap``: uvicorn's SIGINT handler not yet in place); argv: WHERE MODEL PORT
_SLOW_START = """
import sys, time
import acarerank.server.build as build
import acarerank.server.front as front

where, model, port = sys.argv[1:4]
load, run_server = build.build_rerankers, front.run_server

def slow_load(config):   # on the model thread: a call Ctrl-C cannot interrupt
    sys.stderr.write("MARK\\n"); sys.stderr.flush()
    time.sleep(60)
    return load(config)

def late_run_server(*a, **kw):
    sys.stderr.write("MARK\\n"); sys.stderr.flush()
    time.sleep(60)
    return run_server(*a, **kw)

if where == "load":
    build.build_rerankers = slow_load
else:
    front.run_server = late_run_server
from acarerank.cli import main
sys.exit(main(["serve", "--model", model, "--dtype", "float32", "--port", port]))
"""


@pytest.mark.parametrize("where", ["load", "gap"])
def test_ctrl_c_before_serving_exits_130_at_once(tmp_path, where):
    """Ctrl-C during the model's load printed "interrupted" and then waited for the load to finish
    (Python's exit joins the model thread: 7.5 s after it for a 6 s load); after the service had
    started but before uvicorn's handler it hung for ever (the service's loop holds the model
    thread). Both exit 130 at once, one line, no traceback (docs/serving.md, "A dead engine is loud")."""
    tiny_model().save_pretrained(tmp_path)
    child = subprocess.Popen([sys.executable, "-c", _SLOW_START, where, str(tmp_path), str(free_port())],
                             env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        lines = []
        while not lines or lines[-1] not in ("MARK\n", ""):
            lines.append(child.stderr.readline())
        assert lines[-1] == "MARK\n", "".join(lines)[-2000:]
        err, took = _signal_and_wait(child, signal.SIGINT)
    finally:
        child.kill()
    assert child.returncode == 130 and err.splitlines()[-1:] == ["acarerank serve: interrupted"], (child.returncode, err)
    assert "Traceback" not in err, err
    assert took < 10, f"exited {took:.1f} s after SIGINT"
