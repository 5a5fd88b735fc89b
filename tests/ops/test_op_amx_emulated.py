"""The AMX tile code (csrc/cpu/attn_amx.h's attention tiles, amx_gemm.h's GEMM under gate_up_amx) on
a CPU without AMX, its tile instructions emulated.

Only an AMX CPU runs that code in acarerank._cpu; the sessions without one changed the code around
it unrun. Here csrc/cpu/prefix_attention.cpp and gate_up_amx.cpp are compiled a second time with
``ACR_AMX_EMULATE`` (csrc/cpu/amx_emulate.h: each tile instruction in software, by the Intel SDM's
pseudocode) and run in a child process (they register the op names acarerank._cpu does) with
``ACARERANK_CPU_BF16_PATH=brgemm``: what an AMX CPU runs, the tiles and the softmax between their
products included, but oneDNN's AMX ukernel under cpublas. Held to the same rules as on AMX:
flash-attn's 2x rule against the fp32 oracle for the attention (test_op_cpu_attention_native.py's
cases and NaN rows), the exact-value bound for gate/up (_gate_up_bounds.py). The child also checks
that the emulated tiles ran (their product count) and that a d not a multiple of 32 took the
other tiles. What this cannot show: the matrix unit's speed, and its flushing of subnormals.
"""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from _ext import cpu_flags, needs_native

ROOT = Path(__file__).resolve().parents[2]

#: the emulated tiles' product count, as an op (the kernels' own ops come from their sources)
COUNTER_CPP = r'''
#include <torch/library.h>
#include "amx_emulate.h"
static int64_t amx_emulated_products() { return acr_amx_emu::products().load(); }
TORCH_LIBRARY_FRAGMENT(acarerank, m) { m.def("amx_emulated_products() -> int"); }
TORCH_LIBRARY_IMPL(acarerank, CompositeExplicitAutograd, m) { m.impl("amx_emulated_products", &amx_emulated_products); }
'''

CHILD = textwrap.dedent('''
    import math, sys, types
    import pytest, torch
    import torch.nn.functional as F
    from torch.utils.cpp_extension import load
    build, root = sys.argv[1], sys.argv[2]
    counter = build + "/amx_emulated_products.cpp"
    open(counter, "w").write(sys.argv[3])
    load(name="acr_amx_emulated", sources=[root + "/csrc/cpu/prefix_attention.cpp", root + "/csrc/cpu/gate_up_amx.cpp",
                                           counter],
         extra_include_paths=[root + "/csrc/cpu"], extra_cflags=["-O1", "-DACR_AMX_EMULATE", "-fopenmp"],
         is_python_module=False, build_directory=build)
    sys.path[:0] = [root + "/tests/ops", root + "/tests"]
    # keep acarerank._cpu out: the names test_op_cpu_attention_native imports from _ext, none that loads it
    sys.modules["_ext"] = types.SimpleNamespace(needs_native=pytest.mark.skipif(False, reason=""), cpu_flags=set)
    from test_op_cpu_attention_native import CASES, make, nan_rows_differ, plain, ref32
    from _gate_up_bounds import check_silu, gate_up_data
    from acarerank.ops.amx_weights import pack_gate_up  # torch only: loads no extension
    products = torch.ops.acarerank.amx_emulated_products
    attention = torch.ops.acarerank.prefix_shared_attention_cpu
    assert "acarerank._cpu" not in sys.modules
    failed = []

    # -- attention: every case, paged and packed, within flash-attn's rule
    for case in CASES:
        seg, pre, grp, Hq, Hkv, d, bs = case.values
        paged, packed = make(seg, pre, grp, Hq, Hkv, d, bs, dtype=torch.bfloat16)
        q, k, v, cu, kc, vc, bt, pl, sg = paged
        cp, scale = packed[6], 1 / math.sqrt(d)
        ref = ref32(packed)
        err_plain = (plain(packed, scale).float() - ref).abs().max().item() if ref.numel() else 0.0
        atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item() if ref.numel() else 0.0
        before = products()
        # tiles_only: a group of a few rows takes the tiles too (else the direct path, no tiles)
        for name, out in (("paged", attention(q, k, v, cu, kc, vc, bt, cp, sg, scale)),
                          ("packed", attention(q, k, v, cu, packed[4], packed[5], None, cp, sg, scale)),
                          ("paged, tiles only", attention(q, k, v, cu, kc, vc, bt, cp, sg, scale, True))):
            err = (out.float() - ref).abs().max().item() if ref.numel() else 0.0
            if not err <= 2 * err_plain + atol:
                failed.append(f"{case.id} {name}: err {err:.3e} > 2 x plain {err_plain:.3e} + {atol:.1e}")
        ran = products() - before
        if d % 32 == 0 and q.shape[0] > 0 and ran == 0:
            failed.append(f"{case.id}: d = {d}, but no emulated tile product ran (the AMX tiles were not taken)")
        if d % 32 != 0 and ran != 0:
            failed.append(f"{case.id}: d = {d} is no multiple of 32, yet {ran} emulated tile products ran")
    if nan_rows_differ(attention):
        failed.append("attention: NaN rows differ from the oracle")

    # -- gate/up: M across the 32-row blocks and 256-row chunks, K across the 256-k chunks, I
    # across the 256-column macros; the SiLU epilogue and the plain one
    for M, K, I in [(1, 32, 16), (2, 64, 48), (31, 96, 16), (33, 288, 144), (257, 288, 272)]:
        x, w = gate_up_data(M, K, I, seed=M + K + I)
        packed_w = pack_gate_up(w)
        before = products()
        try:
            check_silu(torch.ops.acarerank.gate_up_amx(x, packed_w, I, True), x, w, f"gate_up M={M} K={K} I={I}")
        except AssertionError as e:
            failed.append(str(e))
        plain_y = torch.ops.acarerank.gate_up_amx(x, packed_w, I, False).double()
        want = x.double() @ w.double().T
        bound = 2 * K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 2.0 ** -8 * want.abs()
        over = (plain_y - want).abs() - bound
        if (over > 0).any():
            failed.append(f"linear M={M} K={K} I={I}: over the bound by up to {over.max().item():.3e}")
        if products() == before:
            failed.append(f"gate_up M={M} K={K} I={I}: no emulated tile product ran")
    print("\\n".join(failed) or "ok")
    sys.exit(1 if failed else 0)
''')


@pytest.mark.slow
@needs_native  # same toolchain and torch headers as acarerank._cpu
@pytest.mark.skipif(not {"avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags(),
                    reason="the AMX code's vector parts (the softmax, the epilogues) need AVX512_BF16")
def test_amx_tile_code_with_emulated_tiles_within_the_rules(tmp_path):
    script = tmp_path / "amx_child.py"
    script.write_text(CHILD)
    build = tmp_path / "build"
    build.mkdir()
    env = {**__import__("os").environ, "ACARERANK_CPU_BF16_PATH": "brgemm", "ACARERANK_CPU_AMX_TILES": "1"}
    r = subprocess.run([sys.executable, str(script), str(build), str(ROOT), COUNTER_CPP], capture_output=True,
                       text=True, timeout=1200, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
