"""Run a command with optional packages hidden (see ``tests/hide_modules/sitecustomize.py``)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HIDE_DIR = Path(__file__).resolve().parent / "hide_modules"

# Everything outside the base install (setup.py install_requires) that some module or test
# imports: the serve extras, the test extras, Ray, the compiled extension, flash-attn.
OPTIONAL_MODULES = ("fastapi", "uvicorn", "starlette", "pydantic", "prometheus_client", "httpx", "cohere",
                    "hypothesis", "ray", "flash_attn", "matplotlib", "scipy", "acarerank._C")


def hidden_env(hide=OPTIONAL_MODULES, **extra) -> dict:
    """os.environ with ``hide`` hidden and this checkout first on the path."""
    env = dict(os.environ)
    env["ACARERANK_HIDE_MODULES"] = ",".join(hide)
    if "acarerank._C" in hide:  # the extension is hidden on purpose: its tests must skip, not error
        env.pop("ACARERANK_REQUIRE_EXT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HIDE_DIR), str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra)
    return env


def run_hidden(args, hide=OPTIONAL_MODULES, timeout=300, **extra) -> subprocess.CompletedProcess:
    """Run ``args`` (a list; a leading "python" means this interpreter) with ``hide`` hidden."""
    args = [sys.executable if a == "python" and i == 0 else a for i, a in enumerate(args)]
    return subprocess.run(args, cwd=ROOT, env=hidden_env(hide, **extra), capture_output=True, text=True,
                          timeout=timeout)
