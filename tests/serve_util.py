"""Helpers of the server tests: a real uvicorn on a free port, in a thread or a subprocess."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from acarerank.tokenizer import QWEN3_VOCAB

STARTUP_TIMEOUT_S = 120.0


def tiny_model(seed: int = 0):
    """A 2-layer random Qwen3 with the real vocabulary; yes/no rows spread so scores vary."""
    cfg = Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000.0,
                      tie_word_embeddings=True, attn_implementation="eager")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        m.lm_head.weight[[9693, 2152]] *= 20
    return m


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(url: str, status: int = 200, timeout: float = STARTUP_TIMEOUT_S, proc=None) -> None:
    """Poll ``url`` until it answers ``status`` (bounded); fail early if ``proc`` died."""
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
def thread_server(app):
    """uvicorn serving ``app`` on a free port in a daemon thread; yields the base URL; stops it after."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
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


@contextlib.contextmanager
def subprocess_server(*cli_args: str):
    """``acarerank serve ...`` on a free port; yields (base URL, Popen); always stopped.

    The server's output goes to a temporary file, shown when startup fails.
    """
    import tempfile

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    log = tempfile.TemporaryFile(mode="w+")
    cmd = [sys.executable, "-c", "import sys; from acarerank.cli import main; sys.exit(main())", "serve",
           "--port", str(port), *cli_args]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(base + "/ready", proc=proc)
        except (RuntimeError, TimeoutError) as e:
            log.seek(0)
            raise RuntimeError(f"{e}\n--- server output ---\n{log.read()[-4000:]}") from None
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        log.close()
