"""Shared test setup.

Without a GPU, Triton kernels run on the CPU under TRITON_INTERPRET=1; it must be set
before triton is first imported, hence here (conftest loads before any test module).
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


_PYTEST_PID = os.getpid()
_real_exit = os._exit


def _exit_outside_pytest(status):
    """os._exit, except in the pytest process itself: there it would end the whole run with the
    status it was given — 0 from a server's bounded stop read as a passing suite. A forked
    child (another pid) exits as asked."""
    if os.getpid() == _PYTEST_PID:
        raise RuntimeError(f"os._exit({status}) called in the pytest process: run this code in a child process")
    _real_exit(status)


os._exit = _exit_outside_pytest


@pytest.fixture(autouse=True)
def _keep_pytest_malloc(monkeypatch):
    """``acarerank bench`` and ``serve`` run in-process by many tests tune glibc's malloc at start
    (acarerank/malloc_tuning.py): process-wide, with no way back, and it turns the CPU pass
    default to 4,096 tokens for every later test. Here a stand-in takes its place (it changes
    nothing); the real one runs in child processes (tests/test_malloc_tuning.py)."""
    from acarerank import malloc_tuning

    monkeypatch.setattr(malloc_tuning, "tune_malloc", lambda: "tuned (not in the pytest process)")
    yield


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """torch on one thread for the test: small ops on a loaded 2-core machine lose 10-30x wall time
    to OpenMP spin-waiting (use with ``pytest.mark.usefixtures("one_thread")``)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def qwen3_tokenizer():
    from acarerank.tokenizer import load_qwen3_tokenizer
    return load_qwen3_tokenizer()


def pytest_terminal_summary(terminalreporter):
    """The CPU the suite ran on, last in the output (the part CI's report keeps): its native-bf16
    flags and the attention kernel's bf16 path, so a failure can be tied to a machine."""
    try:
        with open("/proc/cpuinfo") as f:
            words = set(f.read().split())
    except OSError:
        words = set()
    flags = " ".join(f for f in ("amx_bf16", "avx512_bf16") if f in words) or "no native bf16 flag"
    try:
        from acarerank.ops import _native
        if _native.available():
            path = (f"{_native.bf16_attention_path()}{' + AMX tile kernel' if _native.amx_tiles_kernel() else ''}; "
                    f"element-wise kernels: {_native.layer_kernel_isa()}")
        else:
            path = f"none ({_native.why_unavailable()})"
    except Exception as e:  # the summary must never fail the run
        path = f"unknown ({e!r})"
    terminalreporter.write_line(f"cpu: {flags}; torch threads {torch.get_num_threads()}; "
                                f"bf16 attention path: {path}")
