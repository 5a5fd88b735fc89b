"""Whether Triton kernels run in the interpreter: the one place that reads ``TRITON_INTERPRET``.

A leaf (imports nothing of the package): the kernels in ``acarerank.kernels`` import it
without loading ``acarerank.ops``, and the ops re-export ``triton_interpreted``
(docs/ARCHITECTURE.md, "Backend rules").
"""
from __future__ import annotations

import contextlib
import os
import threading

ENV_VAR = "TRITON_INTERPRET"

# Triton's interpreter keeps the position of the program it runs (grid index, builder) in
# module state: two threads inside interpreted kernels at once read each other's and fail with
# an InterpreterError (docs/api.md, "Threads"). Re-entrant: a launch never waits on itself.
_INTERPRETER_LOCK = threading.RLock()


def triton_interpreted(kernel=None) -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET=1).

    With ``kernel`` (a ``triton.jit`` function) also whether *that* kernel was built as an
    interpreted function: ``triton.jit`` reads the variable when the kernel's module is
    imported, so setting it later does not help. The one such check of the project.
    """
    if os.environ.get(ENV_VAR, "0") != "1":
        return False
    return kernel is None or type(kernel).__name__ == "InterpretedFunction"


def interpreter_lock():
    """What a kernel launch holds: under the interpreter one process-wide lock, so interpreted
    launches from several threads run one at a time; else nothing (compiled launches from several
    threads are Triton's ordinary use, and cost no lock)."""
    return _INTERPRETER_LOCK if triton_interpreted() else contextlib.nullcontext()


def enable_interpreter() -> None:
    """Ask for the interpreter unless the environment already says otherwise; call it before
    ``acarerank.kernels`` (and so triton.jit) is imported, or it changes nothing."""
    os.environ.setdefault(ENV_VAR, "1")


__all__ = ["triton_interpreted", "enable_interpreter", "interpreter_lock"]
