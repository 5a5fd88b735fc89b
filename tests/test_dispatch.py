"""Backend choice for the ops: explicit backend= > ACARERANK_BACKEND > device default; never a silent fallback."""
import pytest
import torch

import acarerank.ops.attention as attention
import acarerank.ops.yes_no as yes_no
from acarerank.ops import BackendError, prefix_shared_attention, yes_no_score
from acarerank.ops._backend import ENV_VAR, default_backend


# triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (conftest.py sets it without a GPU)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _attn_inputs(device="cpu"):
    q, k, v = torch.randn(5, 2, 16), torch.randn(5, 1, 16), torch.randn(5, 1, 16)
    pk, pv = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    return tuple(t.to(device) for t in (q, k, v, torch.tensor([0, 2, 5], dtype=torch.int32), pk, pv,
                                        torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)))


def _head_inputs(device="cpu"):
    return tuple(t.to(device) for t in (torch.randn(3, 32), torch.rand(32) + 0.5, torch.randn(32), torch.randn(32)))


@pytest.fixture
def ran(monkeypatch):
    """Wrap the torch and triton implementations of both ops to record which one ran."""
    log = []
    for module in (attention, yes_no):
        table = dict(module.IMPLEMENTATIONS)
        for name in ("torch", "triton"):
            def loader(name=name, real=table[name], op=module.__name__.rsplit(".", 1)[1]):
                fn = real()

                def recorded(*args):
                    log.append((op, name))
                    return fn(*args)
                return recorded
            table[name] = loader
        monkeypatch.setattr(module, "IMPLEMENTATIONS", table)
    monkeypatch.delenv(ENV_VAR, raising=False)
    return log


def test_cpu_default_is_torch(ran):
    prefix_shared_attention(*_attn_inputs())
    yes_no_score(*_head_inputs())
    assert ran == [("attention", "torch"), ("yes_no", "torch")]


def test_cuda_default_is_triton_when_triton_imports():
    assert default_backend(torch.device("cuda")) == "triton"
    assert default_backend(torch.device("cpu")) == "torch"


def test_environment_overrides_device_default(ran, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    args = _attn_inputs(TRITON_DEVICE)
    out = prefix_shared_attention(*args)
    yes_no_score(*_head_inputs(TRITON_DEVICE))
    ref = attention.prefix_shared_attention_ref(*args)
    assert ran == [("attention", "triton"), ("yes_no", "triton")]
    assert (out - ref).abs().max() <= 1e-5


def test_explicit_argument_overrides_environment(ran, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    prefix_shared_attention(*_attn_inputs(), backend="torch")
    yes_no_score(*_head_inputs(), backend="torch")
    assert ran == [("attention", "torch"), ("yes_no", "torch")]


def test_unknown_backend_argument_is_an_error(ran):
    with pytest.raises(BackendError, match=r"unknown backend 'tritn'.*backend="):
        prefix_shared_attention(*_attn_inputs(), backend="tritn")
    with pytest.raises(BackendError, match="unknown backend 'numpy'"):
        yes_no_score(*_head_inputs(), backend="numpy")
    assert ran == []


def test_unknown_backend_in_environment_is_an_error(ran, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(BackendError, match=f"unknown backend 'fast'.*{ENV_VAR}"):
        prefix_shared_attention(*_attn_inputs())
    with pytest.raises(BackendError, match=ENV_VAR):
        yes_no_score(*_head_inputs())
    assert ran == []


def test_backend_the_op_lacks_is_an_error(ran):
    with pytest.raises(BackendError, match="prefix_shared_attention has no 'cpp' backend"):
        prefix_shared_attention(*_attn_inputs(), backend="cpp")
    with pytest.raises(BackendError, match="yes_no_score has no 'flash_attn_cascade' backend"):
        yes_no_score(*_head_inputs(), backend="flash_attn_cascade")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU tensors refusing GPU-only backends")
def test_backend_that_cannot_run_here_is_an_error(ran):
    with pytest.raises(BackendError, match="flash_attn_cascade"):
        prefix_shared_attention(*_attn_inputs(), backend="flash_attn_cascade")
    with pytest.raises(BackendError, match="cuda"):
        yes_no_score(*_head_inputs(), backend="cuda")
    assert ran == []


def test_triton_on_cpu_without_interpreter_is_an_error(ran, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        prefix_shared_attention(*_attn_inputs(), backend="triton")
    with pytest.raises(BackendError, match="TRITON_INTERPRET=1"):
        yes_no_score(*_head_inputs(), backend="triton")
    assert ran == []


def test_unimportable_triton_is_an_error_not_a_fallback(ran, monkeypatch):
    import sys

    # a None entry in sys.modules makes the import raise ImportError, as a missing package would
    monkeypatch.setitem(sys.modules, "acarerank.kernels.prefix_shared_attention", None)
    monkeypatch.setitem(sys.modules, "acarerank.kernels.yes_no_head", None)
    with pytest.raises(BackendError, match="triton backend unavailable"):
        prefix_shared_attention(*_attn_inputs(), backend="triton")
    with pytest.raises(BackendError, match="triton backend unavailable"):
        yes_no_score(*_head_inputs(), backend="triton")
    assert ran == []
