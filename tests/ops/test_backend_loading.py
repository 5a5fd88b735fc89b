"""The one backend loader (``acarerank.ops._backend.lazy_backend``): whatever a kernel module
raises while it is imported becomes a BackendError naming the op, the backend and the cause, so
``available_backends`` and the device default's walk to "torch" survive a broken backend.

The broken kernels are real modules written to a temporary directory: one raising
AttributeError at import (what an old Triton without a ``tl`` function does), one raising
RuntimeError, one importing a package that is not installed.
"""
import sys

import pytest
import torch

from acarerank.ops import BackendError, available_backends, yes_no_score, yes_no_score_ref
from acarerank.ops._backend import lazy_backend, op_decl

BROKEN = {
    "acarerank_test_old_triton_kernel": "import math\nmath.no_such_function  # AttributeError at import\n",
    "acarerank_test_runtime_kernel": "raise RuntimeError('driver too old for this kernel')\n",
    "acarerank_test_missing_dep_kernel": "import acarerank_no_such_package_xyz\n",
}
CAUSES = {"acarerank_test_old_triton_kernel": "AttributeError", "acarerank_test_runtime_kernel": "RuntimeError",
          "acarerank_test_missing_dep_kernel": "ModuleNotFoundError"}


@pytest.fixture
def broken_modules(tmp_path, monkeypatch):
    for name, body in BROKEN.items():
        (tmp_path / f"{name}.py").write_text(body)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    return list(BROKEN)


def _head_inputs():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(3, 16, generator=g), 1 + 0.1 * torch.randn(16, generator=g), torch.randn(16, generator=g),
            torch.randn(16, generator=g))


@pytest.mark.parametrize("module", list(BROKEN))
def test_any_import_failure_is_a_backend_error_naming_the_cause(broken_modules, module):
    backend = lazy_backend("yes_no_score", "triton", module, "yes_no_score_triton")
    with pytest.raises(BackendError) as info:
        backend.load()
    msg = str(info.value)
    assert "yes_no_score" in msg and "triton backend unavailable" in msg and CAUSES[module] in msg, msg


@pytest.mark.parametrize("module", list(BROKEN))
def test_a_broken_backend_leaves_the_others_and_the_default_working(broken_modules, module, monkeypatch):
    """yes_no's triton and cpp backends replaced by broken modules: available_backends lists
    what still runs, the CPU default runs torch, and asking for a broken one names the cause."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so triton is a candidate on CPU and gets loaded
    monkeypatch.delenv("ACARERANK_BACKEND", raising=False)
    decl = op_decl("yes_no")
    monkeypatch.setattr(decl, "_loaded", {})
    monkeypatch.setitem(decl.backends, "triton", lazy_backend("yes_no_score", "triton", module, "x"))
    monkeypatch.setitem(decl.backends, "cpp", lazy_backend("yes_no_score", "cpp", module, "x", ("cpu",)))
    assert available_backends("yes_no", "cpu") == ["torch"]
    args = _head_inputs()
    score, _ = yes_no_score(*args)
    ref, _ = yes_no_score_ref(*args, 1e-6)
    assert torch.allclose(score, ref, atol=1e-6, rtol=0), (score - ref).abs().max()
    for name in ("triton", "cpp"):
        with pytest.raises(BackendError, match=f"{name} backend unavailable: {CAUSES[module]}"):
            yes_no_score(*args, backend=name)


def test_a_missing_attribute_is_a_backend_error_too(broken_modules):
    backend = lazy_backend("yes_no_score", "cpp", "math", "no_such_kernel")
    with pytest.raises(BackendError, match="cpp backend unavailable: AttributeError"):
        backend.load()


def test_a_working_backend_returns_the_wrapped_attribute():
    calls = []
    backend = lazy_backend("op", "torch", "math", "sqrt", wrap=lambda f: calls.append(f) or f)
    assert backend.load()(9.0) == 3.0 and len(calls) == 1
