"""The "native" backend of an element-wise op: a kernel of ``acarerank._cpu`` (``csrc/cpu/``).

``native_backend(op, kernel, fake)`` declares ``torch.ops.acarerank.<kernel>`` as an op's
"native" backend (CPU tensors only). Its loader imports the module through
``acarerank.ops._native`` (which refuses a module built against another torch) and registers
``fake`` as the kernel's fake (meta) implementation, so the kernel traces under torch.compile
and ``torch.library.opcheck``. Any failure is a ``BackendError`` naming the op and the reason,
so the CPU default walks on to "torch" when the extension is not built.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ._backend import Backend, BackendError

_FAKES_REGISTERED: set = set()


def native_kernel(kernel: str):
    """``torch.ops.acarerank.<kernel>`` (its module loaded); BackendError when unavailable."""
    try:
        native = importlib.import_module("acarerank.ops._native")
    except Exception as e:  # the loader module itself missing or broken
        raise BackendError(f"{kernel}: native backend unavailable: {type(e).__name__}: {e}") from e
    native.load()  # BackendError with the loader's one-line reason
    try:
        return getattr(torch.ops.acarerank, kernel)
    except (AttributeError, RuntimeError) as e:
        raise BackendError(f"{kernel}: acarerank._cpu was built without this kernel; rebuild it") from e


def native_backend(op: str, kernel: str, fake: Callable) -> Backend:
    """The "native" ``Backend`` of ``op``: ``torch.ops.acarerank.<kernel>`` with ``fake`` registered."""
    def load():
        try:
            fn = native_kernel(kernel)
        except BackendError as e:
            raise BackendError(f"{op}: native backend unavailable: {e}") from e
        if kernel not in _FAKES_REGISTERED:
            torch.library.register_fake(f"acarerank::{kernel}")(fake)
            _FAKES_REGISTERED.add(kernel)
        return fn
    return Backend(load, ("cpu",))
