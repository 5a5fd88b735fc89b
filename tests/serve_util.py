"""Helpers of the server tests: a tiny model, a real uvicorn on a free port in a thread
(``serve_subprocess`` runs the CLI as a process)."""
from __future__ import annotations

import contextlib
import threading

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from acarerank.server.launch import free_port, serve_subprocess, wait_until  # noqa: F401 (re-exported)
from acarerank.tokenizer import QWEN3_VOCAB


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
