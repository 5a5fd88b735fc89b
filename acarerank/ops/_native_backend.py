"""How an op declares a kernel of ``acarerank._cpu`` (``csrc/cpu/``) as its "native" backend.

    register_fake_once(kernel, fake)     ``fake`` as the fake (meta) kernel of torch.ops.acarerank.<kernel>
                                         (defined in ``_native``, the loader, re-exported here)
    native_kernel(kernel, fake=None)     torch.ops.acarerank.<kernel>, its module loaded and its fake registered
    native_backend(op, kernel, fake, wrap=None)   the "native" ``Backend`` of ``op`` (CPU tensors)
    native_first_decl(name, torch_impl, fake, aliases)  an element-wise op's ``OpDecl``: "torch" and
                                         "native" (kernel ``<name>_cpu``), native first on CPU
    register_op(decl, fake, mutates_args)  decorator: the op's ``torch.library.custom_op`` with ``fake``

The module is imported through ``acarerank.ops._native`` (which refuses a module built against
another torch). Every native kernel's fake is registered here, once, so the kernel traces under
torch.compile and ``torch.library.opcheck``; an op's own custom op gets the same fake (its one
extra argument, ``backend``, dropped). Any failure to load is a ``BackendError`` naming the op and
the reason, so the CPU default walks on to "torch" when the extension is not built.
"""
from __future__ import annotations

import inspect
from typing import Callable, Optional

import torch

from . import _native
from ._backend import Backend, BackendError, BackendLimitError, OpDecl, _env_preference, backend_for
from ._native import register_fake_once


def native_kernel(kernel: str, fake: Optional[Callable] = None):
    """``torch.ops.acarerank.<kernel>`` (its module loaded; ``fake``, when given, registered as its
    fake kernel); BackendError when unavailable."""
    _native.load()  # BackendError with the loader's one-line reason
    try:
        fn = getattr(torch.ops.acarerank, kernel)
    except (AttributeError, RuntimeError) as e:
        raise BackendError(f"{kernel}: acarerank._cpu was built without this kernel; rebuild it") from e
    if fake is not None:
        register_fake_once(kernel, fake)
    return fn


def native_backend(op: str, kernel: str, fake: Callable, wrap: Optional[Callable] = None) -> Backend:
    """The "native" ``Backend`` of ``op``: ``torch.ops.acarerank.<kernel>`` with ``fake`` registered,
    passed through ``wrap`` (an op's calling convention) when given."""
    def load():
        try:
            fn = native_kernel(kernel, fake)
        except BackendError as e:
            raise BackendError(f"{op}: native backend unavailable: {e}") from e
        return fn if wrap is None else wrap(fn)
    return Backend(load, ("cpu",))


def native_first_decl(name: str, torch_impl: Callable, fake: Callable, aliases: tuple = ()) -> OpDecl:
    """The ``OpDecl`` of an element-wise op: "torch" (``torch_impl``, the plain-PyTorch order) and
    "native" (the kernel ``<name>_cpu``, taking the same arguments); the CPU default is native
    where built, else torch; CUDA runs torch."""
    return OpDecl(name, aliases=aliases,
                  backends={"torch": Backend(lambda: torch_impl), "native": native_backend(name, f"{name}_cpu", fake)},
                  defaults={"cpu": ("native", "torch"), "cuda": ("torch",)})


#: the dtypes the native element-wise kernels read and write (csrc/cpu/norm.cpp, qk_norm_rope.cpp,
#: activation.cpp); float16 runs the "torch" backend
NATIVE_LAYER_DTYPES = (torch.float32, torch.bfloat16)


#: the largest head_dim the native attention and qk_norm_rope kernels take (their per-row buffers:
#: MAX_HEAD_DIM in csrc/cpu/prefix_attention.cpp, kMaxHeadDim in csrc/cpu/layer_kernels.h)
NATIVE_MAX_HEAD_DIM = 512


def resolve_within_limits(decl: OpDecl, backend, device: torch.device, why_not: dict) -> str:
    """``decl.resolve(backend, device)`` for a call some backends' kernels may not take: ``why_not``
    maps a backend name to the reason completing "the <name> backend ..." (None: it can). The
    device default then walks past that backend to "torch" (which takes any input); the backend
    asked for by name (argument, mapping or ``ACARERANK_BACKEND``) is a ``BackendLimitError`` naming
    the reason, never the kernel's own check from inside the call."""
    name = decl.resolve(backend, device)
    if why_not.get(name) is None:
        return name
    if isinstance(backend, str):
        asked = backend
    else:
        asked = backend_for(decl.name, backend if backend is not None else _env_preference())
    if asked == name:
        raise BackendLimitError(f"{decl.name}: the {name} backend {why_not[name]}; use the 'torch' backend for it")
    return "torch"


def resolve_past_native(decl: OpDecl, backend, device: torch.device, why_not: Optional[str]) -> str:
    """``resolve_within_limits`` for the native kernel alone: ``why_not`` completes "the native
    backend ..." with the reason it cannot take the call (None: it can)."""
    return resolve_within_limits(decl, backend, device, {"native": why_not})


def head_dim_limit(head_dim: int) -> Optional[str]:
    """``resolve_within_limits``' reason for a head_dim past ``NATIVE_MAX_HEAD_DIM``, else None."""
    return None if head_dim <= NATIVE_MAX_HEAD_DIM else \
        f"takes head_dim up to {NATIVE_MAX_HEAD_DIM}, got {head_dim}"


def resolve_elementwise(decl: OpDecl, backend, device: torch.device, dtype: torch.dtype,
                        head_dim: Optional[int] = None) -> str:
    """``decl.resolve(backend, device)`` for an element-wise op on ``dtype`` (and, for
    qk_norm_rope, heads of ``head_dim``): the device default walks past "native" to "torch" for a
    dtype the kernel lacks (float16) or a head_dim past ``NATIVE_MAX_HEAD_DIM``; "native" asked for
    by name (argument, mapping or ``ACARERANK_BACKEND``) is then a BackendError naming it."""
    why_not = None
    if dtype not in NATIVE_LAYER_DTYPES:
        why_not = f"runs float32 and bfloat16, not {dtype}"
    elif head_dim is not None:
        why_not = head_dim_limit(head_dim)
    return resolve_past_native(decl, backend, device, why_not)


def register_op(decl: OpDecl, fake: Callable, mutates_args: tuple = ()) -> Callable:
    """Decorator: ``fn`` — the op's arguments plus ``backend`` (a resolved backend name) — becomes
    the custom op ``acarerank::<decl.name>`` (torch.compile-opaque), whose fake is ``fake`` called
    with every argument but ``backend``, by name (the same fake its native kernel has)."""
    def register(fn: Callable):
        op = torch.library.custom_op(f"acarerank::{decl.name}", mutates_args=mutates_args)(fn)
        signature = inspect.signature(fn)

        def op_fake(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.arguments.pop("backend")
            return fake(**bound.arguments)

        op.register_fake(op_fake)
        return op
    return register
