"""Whether Triton kernels run in the interpreter: the one place that reads ``TRITON_INTERPRET``.

A leaf (imports nothing of the package): the kernels in ``acarerank.kernels`` import it
without loading ``acarerank.ops``, and the ops re-export ``triton_interpreted``
(docs/ARCHITECTURE.md, "Backend rules").
"""
from __future__ import annotations

import os

ENV_VAR = "TRITON_INTERPRET"


def triton_interpreted(kernel=None) -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET=1).

    With ``kernel`` (a ``triton.jit`` function) also whether *that* kernel was built as an
    interpreted function: ``triton.jit`` reads the variable when the kernel's module is
    imported, so setting it later does not help. The one such check of the project.
    """
    if os.environ.get(ENV_VAR, "0") != "1":
        return False
    return kernel is None or type(kernel).__name__ == "InterpretedFunction"


def enable_interpreter() -> None:
    """Ask for the interpreter unless the environment already says otherwise; call it before
    ``acarerank.kernels`` (and so triton.jit) is imported, or it changes nothing."""
    os.environ.setdefault(ENV_VAR, "1")


__all__ = ["triton_interpreted", "enable_interpreter"]
