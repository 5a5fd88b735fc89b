"""Loader of ``acarerank._cpu``, the native CPU kernels (``csrc/cpu/``, linked against libtorch).

The module registers its ops with the dispatcher when it is imported (``torch.ops.acarerank.*``,
declared by ``TORCH_LIBRARY_FRAGMENT`` in each ``csrc/cpu/*.cpp``). It is built against one torch
(headers, libtorch, C++ ABI: see setup.py) and only that torch may load it: a different one could
crash inside the dispatcher, so ``available()`` refuses it and ``why_unavailable()`` says so.

    available() -> bool           the module imported and matches the running torch
    why_unavailable() -> str      one line: not built / failed to import (why) / built against
                                  torch X, running Y; "" when available
    load() -> module              the module; BackendError (with that line) when unavailable
    build_info() -> dict          torch_version, cxx11_abi, openmp, as built

The import is tried once per process, on first use (never at ``import acarerank``).
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import struct

import torch

from ._backend import BackendError

NOT_BUILT = ("acarerank._cpu is not built (it is built when torch is importable at build time: "
             "install torch, then `pip install --no-build-isolation -e .`, as scripts/setup.sh does)")


@functools.lru_cache(maxsize=None)
def _load():
    """(module, None) or (None, one-line reason); runs once."""
    spec = importlib.util.find_spec("acarerank._cpu")
    cut = _truncated_elf(spec.origin) if spec is not None and spec.origin else ""
    if cut:
        return None, f"acarerank._cpu failed to import: {cut}; rebuild it (`pip install --no-build-isolation -e .`)"
    try:
        mod = importlib.import_module("acarerank._cpu")
    except ModuleNotFoundError as e:
        if e.name == "acarerank._cpu":
            return None, NOT_BUILT
        return None, f"acarerank._cpu failed to import: {type(e).__name__}: {e}"
    except Exception as e:  # a missing libtorch symbol (another torch), a bad .so: say which
        return None, f"acarerank._cpu failed to import: {type(e).__name__}: {e}"
    built = mod.build_info()["torch_version"]
    if built != torch.__version__:
        return None, f"acarerank._cpu was built against torch {built}, running {torch.__version__}; rebuild it"
    _register_fakes()
    return mod, None


def _truncated_elf(path: str) -> str:
    """Why the shared object at ``path`` is cut short, "" if it is whole (or not ELF: the import
    says what is wrong then). dlopen maps a truncated one and the process dies of SIGBUS when it
    touches the missing pages; the section header table is the file's last part, so the size
    must reach e_shoff + e_shnum * e_shentsize (ELF header, 32- or 64-bit, either byte order)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return ""
    if head[:4] != b"\x7fELF":
        return ""
    is64 = head[4:5] == b"\x02"  # EI_CLASS; EI_DATA 1 is little-endian
    fmt = ("<" if head[5:6] == b"\x01" else ">") + ("Q" if is64 else "I") + "10xHH"  # e_shoff .. e_shentsize, e_shnum
    at = 0x28 if is64 else 0x20  # offset of e_shoff
    if len(head) < at + struct.calcsize(fmt):
        return f"{path} is truncated ({size} bytes, shorter than its ELF header)"
    shoff, shentsize, shnum = struct.unpack_from(fmt, head, at)
    end = shoff + shnum * shentsize
    return f"{path} is truncated ({size} bytes, its ELF section headers end at byte {end})" if size < end else ""


_FAKES_REGISTERED: set = set()


def register_fake_once(kernel: str, fake) -> None:
    """``fake`` as the fake kernel of ``acarerank::<kernel>`` (a no-op after the first call)."""
    if kernel not in _FAKES_REGISTERED:
        torch.library.register_fake(f"acarerank::{kernel}")(fake)
        _FAKES_REGISTERED.add(kernel)


def _register_fakes() -> None:
    """vec_add has no op module of its own: its fake (meta) kernel is registered with the loader."""
    register_fake_once("vec_add", lambda a, b: torch.empty_like(a, memory_format=torch.contiguous_format))


def available() -> bool:
    """Whether the native CPU kernels can run here (imports the module on first call)."""
    return _load()[0] is not None


def why_unavailable() -> str:
    """One line saying why ``available()`` is False; "" when it is True."""
    return _load()[1] or ""


def load():
    """The ``acarerank._cpu`` module, or BackendError naming why not."""
    mod, why = _load()
    if mod is None:
        raise BackendError(why)
    return mod


def build_info() -> dict:
    """How the loaded module was built (torch_version, cxx11_abi, openmp); BackendError if unavailable."""
    return dict(load().build_info())


def could_pack_bf16() -> bool:
    """Whether cpublas' bf16 brgemm has its fast VNNI path here (AMX; cpublas' check)."""
    return bool(load().could_pack_bf16())


def bf16_logits_gemm() -> bool:
    """Whether the ops' bf16 logits chunks run ``acarerank::mm_bf16_f32`` (fp32 logits from bf16
    rows, csrc/cpu/logits_gemm.cpp; ``ops/_logits_gemm.py``) here: the CPU has AVX512_BF16,
    ACARERANK_CPU_BASELINE is not 1 and the attention's bf16 path (``bf16_attention_path``, whose
    tile GEMM it shares: brgemm on AMX) is not "fp32-convert"; elsewhere the chunk is upcast to an
    fp32 GEMM. RuntimeError if ACARERANK_CPU_BF16_PATH names a path this CPU cannot take."""
    return bool(load().bf16_logits_gemm())


def amx_tiles_kernel() -> bool:
    """Whether the attention's bf16 key tiles (prefix and own, head_dim a multiple of 32) run on
    AMX tiles directly, the softmax interleaved with the tile products (csrc/cpu/attn_amx.h),
    chosen once per process: on the "amx-brgemm" path where Linux grants this process the tile
    state, unless ACARERANK_CPU_AMX_TILES=0 (then through cpublas' brgemm). RuntimeError if that
    variable is not 0 or 1. docs/cpu.md, "Native CPU kernels"."""
    return bool(load().amx_tiles_kernel())


def layer_kernel_isa() -> str:
    """The build of the element-wise row kernels (rms_norm, fused_add_rms_norm, qk_norm_rope,
    silu_and_mul) this process runs, chosen once: "avx512", "avx2" or "baseline" — the widest
    the CPU has, unless ACARERANK_CPU_LAYER_ISA names one (or ACARERANK_CPU_BASELINE=1).
    RuntimeError if that variable names a build this CPU cannot run, or none.
    docs/cpu.md, "Native CPU kernels"."""
    return str(load().layer_kernel_isa())


def bf16_attention_path() -> str:
    """How the attention kernel multiplies bf16 tiles on this CPU, chosen once per process:
    "amx-brgemm" (cpublas brgemm, AMX), "avx512-bf16" (the kernel's own vdpbf16ps tiles),
    "fp32-convert" (tiles converted to fp32; no native bf16, or ACARERANK_CPU_BASELINE=1), or
    "brgemm" (AMX's code on cpublas' non-AMX brgemm: only with ACARERANK_CPU_BF16_PATH=brgemm).
    RuntimeError if ACARERANK_CPU_BF16_PATH names a path this CPU cannot take.
    docs/cpu.md, "Native CPU kernels"."""
    return str(load().bf16_attention_path())
