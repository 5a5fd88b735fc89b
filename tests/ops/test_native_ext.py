"""acarerank._cpu, the native CPU extension: it loads, says how it was built, and its smallest
op (``vec_add``) equals torch's add through the dispatcher (``torch.ops.acarerank.vec_add``)."""
import pytest
import torch

from _ext import needs_native
from acarerank.ops import _native

pytestmark = needs_native


def test_build_info_matches_running_torch():
    info = _native.build_info()
    assert info["torch_version"] == torch.__version__, info
    assert info["cxx11_abi"] == int(torch._C._GLIBCXX_USE_CXX11_ABI), info
    assert info["openmp"] is True, info
    assert _native.why_unavailable() == ""


@pytest.mark.parametrize("n", [1, 7, 8, 97, 4096 * 3 + 5])
def test_vec_add_equals_torch_add(n):
    _native.load()
    a = torch.randn(n)
    b = torch.randn(n)
    got = torch.ops.acarerank.vec_add(a, b)
    want = a + b
    assert torch.equal(got, want), (got - want).abs().max()


def test_vec_add_non_contiguous_and_threads():
    _native.load()
    a = torch.randn(300, 70).t()            # non-contiguous view
    b = torch.randn(70, 300)
    torch.testing.assert_close(torch.ops.acarerank.vec_add(a, b), a + b, rtol=0, atol=0)


def test_vec_add_opcheck():
    _native.load()
    torch.library.opcheck(torch.ops.acarerank.vec_add.default, (torch.randn(5, 3), torch.randn(5, 3)))


def test_vec_add_bad_inputs_name_the_problem():
    _native.load()
    with pytest.raises(RuntimeError, match="a must be Float"):
        torch.ops.acarerank.vec_add(torch.zeros(3, dtype=torch.float64), torch.zeros(3))
    with pytest.raises(RuntimeError, match="differ in shape"):
        torch.ops.acarerank.vec_add(torch.zeros(3), torch.zeros(4))


def test_why_unavailable_is_one_line_when_not_built(monkeypatch):
    import importlib

    real = importlib.import_module

    def fake(name, *a, **k):
        if name == "acarerank._cpu":
            raise ModuleNotFoundError("No module named 'acarerank._cpu'", name="acarerank._cpu")
        return real(name, *a, **k)

    _native._load.cache_clear()
    monkeypatch.setattr(importlib, "import_module", fake)
    try:
        assert not _native.available()
        why = _native.why_unavailable()
        assert "not built" in why and "\n" not in why, why
    finally:
        monkeypatch.undo()
        _native._load.cache_clear()
    assert _native.available()


def test_why_unavailable_names_both_torch_versions(monkeypatch):
    mod = _native.load()
    info = dict(mod.build_info())
    info["torch_version"] = "0.0.1"

    class Stale:
        build_info = staticmethod(lambda: info)

    import importlib

    real = importlib.import_module
    _native._load.cache_clear()
    monkeypatch.setattr(importlib, "import_module", lambda n, *a, **k: Stale if n == "acarerank._cpu" else real(n))
    try:
        why = _native.why_unavailable()
        assert "built against torch 0.0.1" in why and torch.__version__ in why, why
    finally:
        monkeypatch.undo()
        _native._load.cache_clear()


def test_a_truncated_module_is_named_not_a_bus_error(tmp_path):
    """A _cpu .so cut short (an interrupted copy) once killed the process with SIGBUS at the lazy
    load; the loader checks the ELF file reaches its section header table and names the file."""
    import subprocess
    import sys

    good = _native.load().__file__
    bad = tmp_path / "acarerank" / (good.rsplit("/", 1)[1])
    bad.parent.mkdir()
    with open(good, "rb") as f:
        bad.write_bytes(f.read(100_000))
    probe = (f"import acarerank; acarerank.__path__.insert(0, {str(bad.parent)!r})\n"
             "from acarerank.ops import _native\n"
             "assert not _native.available()\n"
             "print(_native.why_unavailable())\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"rc {r.returncode} (-7: SIGBUS)\nstdout:\n{r.stdout}\nstderr:\n{r.stderr[-2000:]}"
    why = r.stdout.strip()
    assert f"{bad} is truncated (100000 bytes" in why and "\n" not in why, why
