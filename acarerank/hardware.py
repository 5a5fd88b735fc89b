"""What the CPU can do natively, and the dtype a model runs in when the caller names none.

bf16 pays on a CPU only where it has bf16 dot-product instructions: AVX512_BF16
(``vdpbf16ps``: Zen 4+, Cooper Lake+) or AMX (``amx_bf16``: Sapphire Rapids+) on x86, the
BF16 extension (``bf16`` feature, e.g. Graviton 3) on Arm. There a bf16 GEMM runs ~2.2–2.5×
faster than fp32 (2-core EPYC with AVX512_BF16: ~430 vs ~190 GFLOP/s at the default
model's shapes); elsewhere oneDNN emulates bf16 through fp32 and it is
slower than fp32 itself. So the automatic dtype is bf16 exactly when one of those flags is
present, fp32 otherwise, and an explicit dtype always wins.

torch reports its vectorisation level (``torch.backends.cpu.get_cpu_capability()``:
"AVX2", "AVX512", ...) but no bf16 flag, so the flags come from /proc/cpuinfo (Linux);
both are quoted in the reason string that the CLI and ``acarerank bench`` print.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

#: /proc/cpuinfo flags that mean native bf16 arithmetic (x86 "flags", Arm "Features")
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16")


def _cpuinfo_flags(path: str = "/proc/cpuinfo") -> Optional[set]:
    """The first CPU's flag set, or None when /proc/cpuinfo is unreadable (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                key, sep, val = line.partition(":")
                if sep and key.strip().lower() in ("flags", "features"):
                    return set(val.split())
    except OSError:
        return None
    return set()


@functools.lru_cache(maxsize=None)
def native_bf16() -> tuple:
    """(has_native_bf16: bool, reason: str) for this machine's CPU; computed once."""
    cap = torch.backends.cpu.get_cpu_capability()
    flags = _cpuinfo_flags()
    if flags is None:
        return False, f"torch CPU capability {cap}; /proc/cpuinfo unreadable, native bf16 unknown"
    found = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if found:
        return True, f"CPU has native bf16 ({', '.join(found)} in /proc/cpuinfo; torch CPU capability {cap})"
    return False, (f"CPU has no native bf16 (no {'/'.join(NATIVE_BF16_FLAGS)} in /proc/cpuinfo; torch CPU "
                   f"capability {cap}): bf16 would be emulated, slower than fp32")


def default_dtype(device="cpu") -> tuple:
    """(dtype, reason) for a model on ``device`` when the caller gives no dtype.

    CPU: bf16 with native bf16 (``native_bf16``), else fp32. Other devices: fp32 (the
    automatic choice is a CPU decision; a GPU user names bf16 explicitly).
    """
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a valid torch device: {e}") from e
    if dev.type != "cpu":
        return torch.float32, f"device type {dev.type}: fp32 unless a dtype is given"
    ok, why = native_bf16()
    return (torch.bfloat16 if ok else torch.float32), why


def resolve_dtype(dtype, device="cpu") -> tuple:
    """(torch dtype, reason): ``dtype`` as given ("auto"/None → ``default_dtype``).

    dtype: None, "auto", a torch dtype, or its name ("float32", "bfloat16", "float16").
    """
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, str):
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16; got {dtype!r}")
        return getattr(torch, dtype), "asked for explicitly"
    if isinstance(dtype, torch.dtype):
        return dtype, "asked for explicitly"
    raise TypeError(f"dtype must be None, 'auto', a dtype name or a torch.dtype; got {type(dtype).__name__}")
