"""A kernel module that fails to import — with any exception, not only ImportError — costs its
backend and nothing else: ``available_backends`` still answers (without it), the device default
falls back to the next backend, and an explicit request is a ``BackendError`` naming the cause.

The failure is planted in a fresh process (the loaders cache what they load): the kernel
module raises at import what an old Triton raises for ``triton.constexpr_function`` (an
AttributeError), or a broken Triton install (a RuntimeError). docs/ARCHITECTURE.md, "Backend rules".
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A meta-path finder that makes importing MODULE raise EXC(MESSAGE), then the checks.
_PROBE = r'''
import importlib.abc, importlib.machinery, json, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # the triton backend would run on CPU tensors here
MODULE, EXC, MESSAGE, OP = sys.argv[1:5]

class Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == MODULE else None
    def create_module(self, spec):
        return None
    def exec_module(self, module):
        raise {"AttributeError": AttributeError, "RuntimeError": RuntimeError}[EXC](MESSAGE)

sys.meta_path.insert(0, Broken())
import torch
import acarerank.ops as ops
import acarerank.ops._backend as B
out = {"available": ops.available_backends(OP, "cpu")}
try:
    B.op_decl(OP).resolve("triton", torch.device("cpu"))
    out["explicit"] = "no error"
except ops.BackendError as e:
    out["explicit"] = "BackendError: " + str(e)
except Exception as e:  # what the test forbids: the failure escaping as itself
    out["explicit"] = f"{type(e).__name__}: {e}"
out["default"] = B.op_decl(OP).resolve(None, torch.device("cpu"))
print(json.dumps(out))
'''

CASES = [
    ("acarerank.kernels.topk_logprobs", "AttributeError",
     "module 'triton' has no attribute 'constexpr_function'", "topk_logprobs"),
    ("acarerank.kernels.prefix_shared_attention", "RuntimeError", "0 active drivers ([]). There should only be 1.",
     "prefix_shared_attention"),
    ("acarerank.kernels.yes_no_head", "AttributeError", "module 'triton.language' has no attribute 'dot_scaled'",
     "yes_no_score"),
]


@pytest.mark.parametrize("module,exc,message,op", CASES, ids=[c[3] for c in CASES])
def test_kernel_import_failure_costs_only_its_backend(module, exc, message, op):
    r = subprocess.run([sys.executable, "-c", _PROBE, module, exc, message, op], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, f"available_backends/resolve crashed:\n{r.stderr[-3000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "torch" in out["available"] and "triton" not in out["available"], out
    assert out["default"] == "torch", out
    assert out["explicit"].startswith("BackendError: "), f"explicit backend='triton' gave {out['explicit']!r}"
    assert message in out["explicit"] and op.split("_score")[0] in out["explicit"], out["explicit"]
