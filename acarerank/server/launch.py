"""Start ``acarerank serve`` as a child process on a free port and wait until it is ready.

A public helper (docs/serving.md, "Starting a server from Python") for whoever needs a real
server for a while — an integration test of a client, a benchmark (``bench/bench_serve.py``),
this package's own tests::

    from acarerank.server.launch import serve_subprocess
    with serve_subprocess("--model", "DIR", "--dtype", "float32") as (base, proc):
        httpx.post(base + "/v1/rerank", json={"query": "q", "documents": ["d"]})

It stays in the package rather than in ``tests/``: a benchmark script cannot import the tests,
and what it does (the CLI on a free port, readiness polled, always stopped) is the same for
every caller. Needs ``httpx`` (the ``serve`` extra).
"""
from __future__ import annotations

import contextlib
from typing import Optional
import os
import socket
import subprocess
import sys
import tempfile
import time

STARTUP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(url: str, status: int = 200, timeout: float = STARTUP_TIMEOUT_S, proc=None) -> None:
    """Poll ``url`` until it answers ``status`` (bounded); fail early if ``proc`` died."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server process exited with {proc.returncode} before {url} answered {status}")
        try:
            if httpx.get(url, timeout=2.0).status_code == status:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer {status} within {timeout} s")


@contextlib.contextmanager
def serve_subprocess(*cli_args: str, timeout: float = STARTUP_TIMEOUT_S, omp_threads: Optional[int] = 1,
                     preexec_fn=None):
    """``acarerank serve CLI_ARGS`` on a free port; yields (base URL, Popen) once /ready; always stopped.

    omp_threads: the server's OMP_NUM_THREADS unless the caller's environment sets it — 1 for
    tests (a test process and a server on 2 cores would oversubscribe); None = torch's default
    (all cores), which a benchmark needs to compare the server with offline scoring fairly.
    The server's output goes to a temporary file, shown if startup fails and readable meanwhile
    as ``proc.output()``. preexec_fn: run in the child before it starts (e.g. a resource limit).
    """
    port = free_port()
    env = dict(os.environ)
    if omp_threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(omp_threads))
    log = tempfile.TemporaryFile(mode="w+")
    cmd = [sys.executable, "-c", "import sys; from acarerank.cli import main; sys.exit(main())", "serve",
           "--port", str(port), *cli_args]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True, preexec_fn=preexec_fn)

    def output() -> str:
        log.seek(0)
        return log.read()

    proc.output = output
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(base + "/ready", timeout=timeout, proc=proc)
        except (RuntimeError, TimeoutError) as e:
            log.seek(0)
            raise RuntimeError(f"{e}\n--- server output ---\n{log.read()[-4000:]}") from None
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.close()
