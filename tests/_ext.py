"""The compiled extension in the tests: where ``acarerank._C`` is not built, its tests skip and
say why (pytest -rs prints it), instead of failing the collection of every module importing it.

``ACARERANK_REQUIRE_EXT=1`` (set by scripts/test.sh, whose setup builds the extension) turns the
skip into an error, so that a broken build cannot hide behind skipped tests in CI.
"""
import os

import pytest


def _missing_reason():
    try:
        import acarerank._C  # noqa: F401
    except ImportError as e:
        return (f"acarerank._C is not built here ({e}); `pip install -e .` builds it "
                "(needs cmake>=3.24, ninja, pybind11; nvcc for the CUDA kernels)")
    return None


#: None where acarerank._C imports, else why not
EXT_MISSING = _missing_reason()
if EXT_MISSING and os.environ.get("ACARERANK_REQUIRE_EXT") == "1":
    raise RuntimeError(f"ACARERANK_REQUIRE_EXT=1 but {EXT_MISSING}")
#: mark for a test (or ``pytestmark``) that needs the extension
needs_ext = pytest.mark.skipif(EXT_MISSING is not None, reason=EXT_MISSING or "")


def _native_missing_reason():
    from acarerank.ops import _native

    return None if _native.available() else _native.why_unavailable()


#: None where acarerank._cpu (the native CPU kernels) loads, else why not; scripts/test.sh's
#: ACARERANK_REQUIRE_EXT=1 makes a missing one an error, as for acarerank._C
NATIVE_MISSING = _native_missing_reason()
if NATIVE_MISSING and os.environ.get("ACARERANK_REQUIRE_EXT") == "1":
    raise RuntimeError(f"ACARERANK_REQUIRE_EXT=1 but {NATIVE_MISSING}")
#: mark for a test (or ``pytestmark``) that needs acarerank._cpu
needs_native = pytest.mark.skipif(NATIVE_MISSING is not None, reason=NATIVE_MISSING or "")


def cpu_flags() -> set:
    """The CPU's flags from /proc/cpuinfo (empty where there is none): which native paths and
    builds this CPU can run (AVX2, AVX-512, AVX512_BF16, AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()
