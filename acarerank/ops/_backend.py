"""How an op declares its backends, and how one is chosen (docs/ARCHITECTURE.md, "Backend rules").

Backend names:
  "torch"  plain PyTorch; the reference semantics and the CPU production path
  "triton" Triton kernels in ``acarerank.kernels`` (GPU; CPU only under TRITON_INTERPRET=1)
  "cpp"    the C++ CPU twins in ``acarerank._C``
  "cuda"   the CUDA kernels in ``acarerank._C``
  "flash_attn_cascade"  prefix_shared_attention only: flash-attn prefix pass + own pass + merge
  "native" the native CPU kernels in ``acarerank._cpu`` (``csrc/cpu/``, linked against libtorch)
  "onednn" linear only: oneDNN (torch.ops.mkldnn) on a weight reordered once (``ops/linear.py``)

An op module declares itself once with ``OpDecl(name, aliases, backends, defaults)``:
``backends`` maps a name to a ``Backend(load, devices)`` whose loader imports lazily (and is
called at most once per process; ``lazy_backend`` builds one from a module and an attribute
name); ``defaults`` lists, per device type, the backends to try in order when nothing is
asked for. Declaring a backend is all it takes for
``available_backends`` (and the op's test file, which parametrizes over it) to see it.

Choice, per call of an op with ``backend=``:
  * a name ("cpp")        -> exactly that backend for this op;
  * a mapping ({"attention": "triton", "yes_no": "cuda"}) -> this op's entry, else the first
                             default of the device that runs here (the environment unread:
                             ``{}`` is "the default", what ``backend_choice`` passes);
  * None                  -> ``ACARERANK_BACKEND`` read as a *preference* (below), else the
                             first default of the device that runs here.
A *preference* (what the rerankers and ``ACARERANK_BACKEND`` take) is a name or a mapping:
a name is used by every op that declares that backend, the others keep their default
(``backend_for``); ``ACARERANK_BACKEND`` holds a name or "op=name,op=name", and is read only
where no preference was given (``backend_choice``).
Whatever was asked for explicitly (by argument, mapping or environment) that this op cannot
run here is a ``BackendError`` naming what is missing — never a silent fallback. Only the
device default walks its list to the first backend that runs.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Union

import torch

from .._triton_env import triton_interpreted

KNOWN_BACKENDS = ("torch", "triton", "cpp", "cuda", "flash_attn_cascade", "native", "onednn")
ENV_VAR = "ACARERANK_BACKEND"

Preference = Union[None, str, Mapping[str, str]]


class BackendError(RuntimeError):
    """An op was asked for a backend it does not have or that cannot run here."""


class BackendLimitError(BackendError, ValueError):
    """A backend asked for by name cannot take this call's input (a head_dim past its kernel's
    limit, a dtype it lacks): a ``BackendError`` (that backend cannot run the call) and a
    ``ValueError`` (the input is why). The device default walks past such a backend instead."""


@dataclass(frozen=True)
class Backend:
    """One implementation of an op: ``load()`` imports it (raising BackendError with the reason
    when it cannot) and returns the callable; ``devices`` are the tensor device types it reads
    ("cpu" for "triton" means: under the interpreter only)."""
    load: Callable[[], Callable]
    devices: tuple = ("cpu", "cuda")


#: the devices of a "torch" backend whose op's fake kernel answers for it on "meta" tensors (the
#: registered op's Meta kernel is its fake, so no backend code runs): shapes and dtypes without
#: data, as ``linear_logprob`` gives them; docs/api.md, "Training modes"
META_TOO = ("cpu", "cuda", "meta")


def lazy_backend(op: str, backend: str, module: str, attr: str, devices: tuple = ("cpu", "cuda"),
                 needs_cuda_build: bool = False, wrap: Optional[Callable] = None) -> Backend:
    """The one backend loader: a ``Backend`` whose ``load()`` imports ``module`` (absolute name)
    and returns its ``attr`` (passed through ``wrap`` when given).

    *Any* failure to import — ImportError (triton or acarerank._C missing), AttributeError (a
    Triton too old for the kernel module), RuntimeError or anything else raised while the
    module runs — becomes a ``BackendError`` naming the op, the backend and the cause, so
    ``available_backends`` and the device default's walk to the next backend survive it.
    ``needs_cuda_build``: ``module`` is ``acarerank.ops._cpp`` and its ``require_cuda(op)`` must
    pass (the extension was built with CUDA; BackendError naming the build's reason if not).
    """
    def load() -> Callable:
        try:
            mod = importlib.import_module(module)
            if needs_cuda_build:
                mod.require_cuda(op)
            fn = getattr(mod, attr)
        except BackendError:
            raise
        except Exception as e:  # see the docstring: nothing an import raises may escape as itself
            raise BackendError(f"{op}: {backend} backend unavailable: {type(e).__name__}: {e}") from e
        return fn if wrap is None else wrap(fn)
    return Backend(load, tuple(devices))


_REGISTRY: dict = {}   # op name -> OpDecl
_ALIASES: dict = {}    # alias or name -> op name


@dataclass
class OpDecl:
    """The declaration of one op (see the module docstring)."""
    name: str
    backends: dict
    defaults: dict                  # device type -> tuple of backend names, best first
    aliases: tuple = ()
    _loaded: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for n in self.backends:
            if n not in KNOWN_BACKENDS:
                raise ValueError(f"{self.name}: backend {n!r} is not one of {KNOWN_BACKENDS}")
        _REGISTRY[self.name] = self
        for a in (self.name, *self.aliases):
            _ALIASES[a] = self.name

    # -- implementations
    def impl(self, name: str) -> Callable:
        """The implementation of backend ``name`` (imported on first use, then cached)."""
        fn = self._loaded.get(name)
        if fn is None:
            if name not in self.backends:
                raise BackendError(f"{self.name} has no {name!r} backend; it has: {', '.join(sorted(self.backends))}")
            fn = self._loaded[name] = self.backends[name].load()
        return fn

    def why_not(self, name: str, device: torch.device) -> Optional[str]:
        """None if backend ``name`` runs on ``device`` tensors here, else the reason."""
        if name not in self.backends:
            return f"{self.name} has no {name!r} backend; it has: {', '.join(sorted(self.backends))}"
        if device.type not in self.backends[name].devices:
            want = " or ".join(d.upper() for d in self.backends[name].devices)
            return f"{self.name}: backend {name!r} needs {want} tensors, got one on {device}"
        if name == "triton" and device.type != "cuda" and not triton_interpreted():
            return (f"{self.name}: backend 'triton' on {device} tensors needs TRITON_INTERPRET=1 "
                    "(set it before importing triton) or CUDA tensors")
        try:
            self.impl(name)
        except BackendError as e:
            return str(e)
        return None

    def available(self, device) -> list:
        """Backends that run on ``device`` here: the device defaults first (in order), then the rest."""
        device = torch.device(device)
        order = list(self.defaults.get(device.type, ())) + sorted(self.backends)
        seen = []
        for n in order:
            if n not in seen and self.why_not(n, device) is None:
                seen.append(n)
        return seen

    # -- choice
    def default(self, device: torch.device) -> str:
        reasons = []
        for n in self.defaults.get(device.type, ()):
            why = self.why_not(n, device)
            if why is None:
                return n
            reasons.append(why)
        raise BackendError(f"{self.name}: no backend runs on {device} here ({'; '.join(reasons) or 'none declared'})")

    def resolve(self, backend: Preference, device: torch.device) -> str:
        """The backend this call runs (module docstring); BackendError if it cannot run here.

        Under torch.compile (eager calls are unchanged) the choice is made once, when the graph
        is traced, and kept in it as a constant (``_resolve``; docs/ARCHITECTURE.md, "Backend
        rules"): the choice imports the backend on first use and reads ``ACARERANK_BACKEND``,
        and Dynamo cannot trace ``importlib.import_module`` (a graph break, an error under
        fullgraph=True, whenever a compiled call was the first to ask)."""
        if not torch.compiler.is_compiling():
            return self._resolve_now(backend, device)
        name, error, why = _resolve(self.name, backend, device)
        if error is not None:  # raised here, in traced code: Dynamo re-raises it as itself
            raise error(why)
        return name

    def _resolve_now(self, backend: Preference, device: torch.device) -> str:
        if isinstance(backend, str):
            name, where = _known(backend, "backend="), "backend="
        elif backend is not None:
            name, where = backend_for(self.name, backend), "backend mapping"
        else:
            name, where = backend_for(self.name, _env_preference()), ENV_VAR
        if name is None:
            return self.default(device)
        why = self.why_not(name, device)
        if why is not None:
            raise BackendError(why if where == "backend=" else f"{why} (asked for by {where})")
        return name


@torch.compiler.assume_constant_result
def _resolve(op: str, backend: Preference, device: torch.device) -> tuple:
    """(``OpDecl.resolve``'s name, None, None), or (None, its BackendError's class, message).
    Dynamo runs it as plain Python while tracing and puts the result in the graph as a constant
    (the graph never changes backend); an exception raised in it would reach the caller as an
    InternalTorchDynamoError, hence the class and message for the caller to raise."""
    try:
        return _REGISTRY[op]._resolve_now(backend, device), None, None
    except BackendError as e:
        return None, type(e), str(e)


def _known(name: str, where: str) -> str:
    if name not in KNOWN_BACKENDS:
        raise BackendError(f"unknown backend {name!r} (from {where}); known backends: {', '.join(KNOWN_BACKENDS)}")
    return name


def parse_preference(text: Optional[str], where: str = "backend preference") -> Preference:
    """A preference from text (``ACARERANK_BACKEND``, the CLI's --backend): "" or None -> None,
    "triton" -> "triton", "attention=triton,yes_no=cuda" -> {"attention": "triton", "yes_no": "cuda"}."""
    raw = (text or "").strip() or None
    if raw is None or "=" not in raw:
        return _known(raw, where) if raw else None
    out = {}
    for part in raw.split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip():
            raise BackendError(f"{where}={raw!r}: expected a backend name or 'op=backend,op=backend'")
        if key.strip() in out:   # a dict keeps the last: the first was dropped, silently
            raise BackendError(f"{where}={raw!r}: {key.strip()!r} is given twice; give each op once")
        out[key.strip()] = val.strip()
    return out


def _env_preference() -> Preference:
    return parse_preference(os.environ.get(ENV_VAR), ENV_VAR)


def op_decl(op: str) -> OpDecl:
    """The declaration of ``op`` (its name or an alias such as "attention", "yes_no")."""
    try:
        return _REGISTRY[_ALIASES[op]]
    except KeyError:
        raise BackendError(f"unknown op {op!r}; ops: {', '.join(sorted(_ALIASES))}") from None


def backend_for(op: str, preference: Preference) -> Optional[str]:
    """What ``preference`` asks of ``op``: a backend name, or None for the op's own default.

    A name: that name if ``op`` declares it, else None (another op has it); a name no op
    declares is a BackendError. A mapping: ``op``'s entry (by name or alias), else None;
    every key must name an op and every value a backend that op declares.
    """
    decl = op_decl(op)
    if preference is None:
        return None
    if isinstance(preference, str):
        _known(preference, "backend preference")
        if preference in decl.backends:
            return preference
        if not any(preference in d.backends for d in _REGISTRY.values()):
            raise BackendError(f"no op has a {preference!r} backend")
        return None
    if not isinstance(preference, Mapping):
        raise BackendError(f"a backend preference is a name or a mapping op -> name, got {type(preference).__name__}")
    mine, keys = None, {}
    for key, name in preference.items():
        other = op_decl(key)
        if other.name in keys:   # by its name and an alias: the last entry won, silently
            raise BackendError(f"the backend mapping names {other.name} twice ({keys[other.name]!r} and {key!r}); "
                               f"give each op once")
        keys[other.name] = key
        _known(name, f"backend mapping entry {key!r}")
        if name not in other.backends:
            raise BackendError(f"{other.name} has no {name!r} backend; it has: {', '.join(sorted(other.backends))}")
        if other is decl:
            mine = name
    return mine


def backend_choice(op: str, preference: Preference) -> Preference:
    """What to pass as ``op``'s ``backend=`` for a preference given to a whole reranker or runner:
    None where there is none (``ACARERANK_BACKEND`` applies), ``backend_for``'s name where it names
    one for ``op``, else ``{}`` — an empty mapping, which resolves to the op's device default. Passing
    ``backend_for``'s None there let ``ACARERANK_BACKEND`` choose for the ops a ``--backend`` name or
    mapping leaves out (``ACARERANK_BACKEND=torch`` put ``--backend native``'s linear layers on F.linear),
    where a preference given is the whole choice (docs/ARCHITECTURE.md, "Backend rules")."""
    if preference is None:
        return None
    name = backend_for(op, preference)
    return {} if name is None else name


def per_op_backends(preference: Preference) -> dict:
    """``{op name: backend_for(op, preference)}`` for every declared op (validates the preference)."""
    return {name: backend_for(name, preference) for name in sorted(_REGISTRY)}


def available_backends(op: str, device="cpu") -> list:
    """Backends of ``op`` (name or alias) that run on ``device`` tensors here, device defaults first.

    >>> available_backends("yes_no_score", "cpu")   # with acarerank._C built, interpreter on
    ['torch', 'cpp', 'triton']
    """
    return op_decl(op).available(device)



# -- process_group= implementations
# An op's ``process_group=`` path lives in ``vocab_parallel``, which builds on the op (its core,
# its checks); the op finds that path here instead of importing it back, so the imports stay a
# tree. ``acarerank/ops/__init__.py`` imports vocab_parallel, and a package's __init__ runs
# before any of its modules, so the entries exist whenever an op can be called.
_PROCESS_GROUP_IMPLS: dict = {}   # op name -> callable


def register_process_group_impl(op: str, fn: Callable) -> Callable:
    """Declare ``fn`` as ``op``'s implementation over a ``torch.distributed`` process group."""
    _PROCESS_GROUP_IMPLS[op] = fn
    return fn


def process_group_impl(op: str) -> Callable:
    """``op``'s process-group implementation; BackendError when none was registered."""
    try:
        return _PROCESS_GROUP_IMPLS[op]
    except KeyError:
        raise BackendError(f"{op}: process_group= has no implementation registered "
                           f"(acarerank.ops.vocab_parallel registers it when acarerank.ops is imported)") from None

__all__ = ["KNOWN_BACKENDS", "ENV_VAR", "BackendError", "Backend", "OpDecl", "lazy_backend", "triton_interpreted",
           "op_decl", "backend_choice", "backend_for", "per_op_backends", "available_backends", "parse_preference",
           "register_process_group_impl", "process_group_impl"]
