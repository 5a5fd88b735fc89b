"""acarerank._C: what the build holds, and that a CPU-only build works and says so."""
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _ext import EXT_MISSING

if EXT_MISSING:  # the import itself is the first check where the extension was built
    pytest.skip(EXT_MISSING, allow_module_level=True)
import acarerank._C as _C  # noqa: E402

from _repo import ROOT


def _nvcc_on_this_machine():
    """Where CMakeLists.txt looks: $CUDA_HOME/bin, $PATH, /usr/local/cuda/bin."""
    cands = [Path(os.environ[v]) / "bin" / "nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands += [Path(p) for p in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc") if p]
    return next((str(p) for p in cands if p.is_file()), None)


def test_build_info_is_complete():
    info = _C.build_info()
    expected = {"has_cuda": bool, "cuda_archs": str, "cuda_compiler_version": str, "no_cuda_reason": str,
                "cuda_runtime": str, "openmp": bool, "topk_max_k": int, "cxx_compiler": str}
    assert {k: type(info.get(k)) for k in expected} == expected, info
    assert info["has_cuda"] is _C.has_cuda
    if _C.has_cuda:
        assert info["cuda_archs"] and info["cuda_compiler_version"] and not info["no_cuda_reason"], info
    else:
        assert not info["cuda_archs"] and info["no_cuda_reason"], info


def test_cuda_kernels_compiled_when_nvcc_is_present():
    """CI builds from a clean checkout: with nvcc there, the .cu files must be in the module."""
    nvcc = _nvcc_on_this_machine()
    if nvcc is None or os.environ.get("ACARERANK_NO_CUDA") == "1":
        assert not _C.has_cuda or _C.build_info()["cuda_compiler_version"], "inconsistent build info"
        return
    assert _C.has_cuda, (f"nvcc is at {nvcc} but acarerank._C was built without CUDA "
                         f"({_C.build_info()['no_cuda_reason']}); rebuild with `pip install -e .`")
    assert _C.cuda_archs, "a CUDA build must name its architectures"
    if os.environ.get("ACARERANK_CUDA_ARCHS"):  # else the default "80;90", unless built under another env
        archs = os.environ["ACARERANK_CUDA_ARCHS"].replace(";", ",")
        assert _C.cuda_archs == archs, f"built for {_C.cuda_archs}, ACARERANK_CUDA_ARCHS asks for {archs}"
    for name in ("topk_merge_update_cuda", "yes_no_cuda", "merge_states_cuda"):
        assert hasattr(_C, name), f"acarerank._C lacks {name}"


@pytest.mark.slow
def test_cpu_only_build_imports_and_says_so(tmp_path):
    """CMake with ACARERANK_NO_CUDA=ON (what a machine without nvcc gets): the module imports,
    reports no CUDA with the reason, runs the C++ ops, and the 'cuda' backend refuses clearly."""
    import pybind11

    cmake = shutil.which("cmake")
    assert cmake and shutil.which("ninja"), "cmake and ninja must be on PATH (pip install cmake ninja)"
    out = tmp_path / "out"
    configure = [cmake, str(ROOT), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Debug", "-DACARERANK_NO_CUDA=ON",
                 f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
                 f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out}"]
    for cmd in (configure, [cmake, "--build", "."]):
        r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
        assert r.returncode == 0, f"{' '.join(cmd)} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    probe = textwrap.dedent(f"""
        import acarerank, torch
        acarerank.__path__.insert(0, {str(out)!r})  # this build's _C shadows the installed one
        import acarerank._C as C
        assert C.__file__.startswith({str(out)!r}), C.__file__
        assert C.has_cuda is False and C.cuda_archs == ""
        assert "ACARERANK_NO_CUDA" in C.build_info()["no_cuda_reason"], C.build_info()
        assert not hasattr(C, "yes_no_cuda")
        from acarerank.ops import BackendError, yes_no_score
        h, w = torch.randn(3, 16), torch.randn(16)
        s_cpp, _ = yes_no_score(h, w, w, -w, backend="cpp")
        s_ref, _ = yes_no_score(h, w, w, -w, backend="torch")
        torch.testing.assert_close(s_cpp, s_ref, atol=1e-5, rtol=1e-5)
        from acarerank.ops import _cpp
        try:
            _cpp.yes_no_score_cuda(h, w, w, -w, 1e-6)
        except BackendError as e:
            assert "built without CUDA" in str(e), e
            print("OK:", e)
        else:
            raise AssertionError("the cuda backend ran on a CPU-only build")
    """)
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "OK:" in r.stdout, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr[-3000:]}"
