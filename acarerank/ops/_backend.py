"""Backend choice for every op: picked once per call from (argument, environment, device).

Names:
  "torch"  plain PyTorch; the reference semantics and the CPU production path
  "triton" Triton kernels in ``acarerank.kernels`` (GPU; CPU under TRITON_INTERPRET=1)
  "cpp"    the C++ CPU twins in ``acarerank._C``
  "cuda"   the CUDA kernels in ``acarerank._C``
  "flash_attn_cascade"  prefix_shared_attention only: flash-attn prefix pass + own pass + merge

Rule: an explicit ``backend=`` wins, then ``ACARERANK_BACKEND``, then the device default
("triton" on CUDA when Triton imports, else "torch"). An unknown name, or a backend the op
does not implement, or one that cannot run here, is a ``BackendError`` naming what is
missing — never a silent fallback to another backend.

Each op module keeps its own table ``{name: implementation}``; a backend module adds its
entry with ``register(op_table, name)`` so the ops never import kernels they do not use.
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

KNOWN_BACKENDS = ("torch", "triton", "cpp", "cuda", "flash_attn_cascade")
ENV_VAR = "ACARERANK_BACKEND"


class BackendError(RuntimeError):
    """An op was asked for a backend it does not have or that cannot run here."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (import is the check)
    except Exception:
        return False
    return True


def triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def default_backend(device: torch.device) -> str:
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"


def requested_backend(backend: Optional[str], device: torch.device) -> str:
    """The backend name this call asks for (argument > environment > device default)."""
    name = backend if backend is not None else os.environ.get(ENV_VAR) or None
    if name is None:
        return default_backend(device)
    if name not in KNOWN_BACKENDS:
        raise BackendError(
            f"unknown backend {name!r} (from {'backend=' if backend is not None else ENV_VAR}); "
            f"known backends: {', '.join(KNOWN_BACKENDS)}"
        )
    return name


def resolve(op_name: str, table: dict, backend: Optional[str], device: torch.device) -> tuple[str, Callable]:
    """Return (name, implementation) for ``op_name`` on ``device``; raise BackendError otherwise."""
    name = requested_backend(backend, device)
    loader = table.get(name)
    if loader is None:
        raise BackendError(
            f"{op_name} has no {name!r} backend; it has: {', '.join(sorted(table))}"
        )
    fn = loader()  # loaders import lazily and raise BackendError with the reason if unusable
    return name, fn


def check_runs_on(name: str, device: torch.device, op_name: str) -> None:
    """Refuse device/backend pairs that cannot run (e.g. "cuda" on CPU tensors)."""
    if name == "cuda" and device.type != "cuda":
        raise BackendError(f"{op_name}: backend 'cuda' needs CUDA tensors, got device {device}")
    if name == "cpp" and device.type != "cpu":
        raise BackendError(f"{op_name}: backend 'cpp' needs CPU tensors, got device {device}")
    if name in ("cpp", "torch") or device.type == "cuda":
        return
    if name == "triton" and not triton_interpreted():
        raise BackendError(
            f"{op_name}: backend 'triton' on {device} tensors needs TRITON_INTERPRET=1 "
            "(set it before importing triton) or CUDA tensors"
        )
    if name == "flash_attn_cascade":
        raise BackendError(f"{op_name}: backend 'flash_attn_cascade' needs CUDA tensors, got {device}")
