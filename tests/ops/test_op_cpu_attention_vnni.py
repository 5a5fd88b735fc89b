"""The bf16 VNNI path of the native attention kernel on any CPU.

That path (bf16 tiles through ``cpublas::brgemm`` on VNNI-packed B) runs only where
``cpublas::could_pack(kBFloat16)`` (AMX); elsewhere brgemm refuses a VNNI B. To test its packing,
padding, bf16 rounding of P and NaN handling everywhere, csrc/cpu/prefix_attention.cpp is compiled
a second time with ``ACR_VNNI_REFERENCE_GEMM`` (attn_tiles.h: the GEMM reads the VNNI layout
element by element, B(k, n) at ((k/2)·ldb + n)·2 + k%2, the layout oneDNN's brgemm takes) and run
in a child process (it registers the same op name as acarerank._cpu), held to flash-attn's 2x
rule against the fp32 oracle. What it cannot test: oneDNN's own brgemm, which needs AMX.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _ext import needs_native

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent('''
    import math, sys, types
    import pytest, torch
    from torch.utils.cpp_extension import load
    build, root = sys.argv[1], sys.argv[2]
    load(name="acr_vnni_reference", sources=[root + "/csrc/cpu/prefix_attention.cpp"],
         extra_include_paths=[root + "/csrc/cpu"], extra_cflags=["-O1", "-DACR_VNNI_REFERENCE_GEMM", "-fopenmp"],
         is_python_module=False, build_directory=build)
    sys.path[:0] = [root + "/tests/ops", root + "/tests"]
    # keep _cpu out: the names test_op_cpu_attention_native imports from _ext, none that loads it
    sys.modules["_ext"] = types.SimpleNamespace(needs_native=pytest.mark.skipif(False, reason=""), cpu_flags=set)
    from test_op_cpu_attention_native import CASES, make, nan_rows_differ, plain, ref32
    fn = torch.ops.acarerank.prefix_shared_attention_cpu
    failed = []
    for case in CASES[:4]:
        seg, pre, grp, Hq, Hkv, d, bs = case.values
        paged, packed = make(seg, pre, grp, Hq, Hkv, d, bs, dtype=torch.bfloat16)
        q, k, v, cu, kc, vc, bt, pl, sg = paged
        cp, scale = packed[6], 1 / math.sqrt(d)
        ref = ref32(packed)
        err_plain = (plain(packed, scale).float() - ref).abs().max().item()
        atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
        for name, out in (("paged", fn(q, k, v, cu, kc, vc, bt, cp, sg, scale)),
                          ("packed", fn(q, k, v, cu, packed[4], packed[5], None, cp, sg, scale))):
            err = (out.float() - ref).abs().max().item()
            if not err <= 2 * err_plain + atol:
                failed.append(f"{case.id} {name}: err {err:.3e} > 2 x plain {err_plain:.3e} + {atol:.1e}")
    if nan_rows_differ(fn):
        failed.append("NaN rows differ from the oracle")
    print("\\n".join(failed) or "ok")
    sys.exit(1 if failed else 0)
''')


@pytest.mark.slow
@needs_native  # same toolchain and torch headers as acarerank._cpu
def test_vnni_path_with_reference_gemm_obeys_the_2x_rule(tmp_path):
    script = tmp_path / "vnni_child.py"
    script.write_text(CHILD)
    build = tmp_path / "build"
    build.mkdir()
    r = subprocess.run([sys.executable, str(script), str(build), str(ROOT)], capture_output=True, text=True,
                       timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
