"""The bf16 compute paths of the native CPU attention kernel (csrc/cpu/attn_tiles.h, ``bf16_path()``).

One kernel, three ways to multiply bf16 tiles, chosen once per process from the CPU:
  amx-brgemm    cpublas::brgemm on VNNI tiles (where cpublas can pack bf16: AMX)
  avx512-bf16   our vdpbf16ps tiles on the same VNNI layout (csrc/cpu/gemm_bf16_avx512.h)
  fp32-convert  tiles converted to fp32 as they are packed (no native bf16, or ACARERANK_CPU_BASELINE=1 without AMX)
and a fourth, ``ACARERANK_CPU_BF16_PATH=brgemm`` on a CPU without AMX: the amx-brgemm code (VNNI
packing, row chunks, leading dimensions, release) on cpublas' non-AMX bf16 brgemm, so that code
is tested on every CPU; only oneDNN's AMX ukernel underneath is not.

Every path is held to flash-attn's rule (kernel error ≤ 2× plain bf16 PyTorch's, + twice fp32's
rounding step near the outputs, both against the fp32 oracle on the same bf16 values) on shapes
that reach the tiles' edges: row counts that are not a multiple of the 6-row register block,
head_dim 72 (a masked last vector), own parts over one key tile, one-token segments, empty
prefixes, GQA 1..8. The path this CPU takes is checked against /proc/cpuinfo, so a build that
silently falls back to the slow path fails here.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from _ext import cpu_flags, needs_native
from _repo import ROOT
from acarerank.ops import prefix_shared_attention, prefix_shared_attention_paged
from test_op_cpu_attention_native import CASES, KT, make, plain, ref32

pytestmark = needs_native

# seg_lens, prefix_lens, groups, Hq, Hkv, d, block_size: the tiles' edges
EDGE_CASES = CASES + [
    pytest.param([5, 11, 2], [29, 3], [0, 1, 1], 3, 1, 72, 16, id="gqa3-d72-masked-vector"),
    pytest.param([KT + 7, 1], [0, KT + 8], [0, 1], 2, 2, 128, 64, id="own-over-a-tile-no-prefix"),
    pytest.param([13], [1031], [0], 16, 8, 128, 16, id="qwen3-0.6b-heads-prime-prefix"),
]




def _path() -> str:
    from acarerank.ops import _native

    return _native.bf16_attention_path()


def _has_avx512_bf16() -> bool:
    return {"avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()


def _auto_path() -> str:
    """The path the CPU alone picks (neither variable set)."""
    from acarerank.ops import _native

    return "amx-brgemm" if _native.could_pack_bf16() else "avx512-bf16" if _has_avx512_bf16() else "fp32-convert"


def test_bf16_path_follows_the_cpu():
    """AMX where cpublas packs bf16, else AVX512_BF16 where /proc/cpuinfo lists it, else fp32 tiles;
    a run of the suite under ACARERANK_CPU_BF16_PATH or ACARERANK_CPU_BASELINE gets what it asked for."""
    from acarerank.ops import _native

    forced = os.environ.get("ACARERANK_CPU_BF16_PATH", "auto") or "auto"
    if forced in ("brgemm", "amx-brgemm"):
        want = "amx-brgemm" if _native.could_pack_bf16() else "brgemm"
    elif forced != "auto":
        want = forced
    elif os.environ.get("ACARERANK_CPU_BASELINE") == "1" and not _native.could_pack_bf16():
        want = "fp32-convert"
    else:
        want = _auto_path()
    flags = cpu_flags()
    assert _path() == want, f"bf16 path {_path()!r} on a CPU with {sorted(flags & {'avx512_bf16', 'amx_bf16'})}"


def _rule(case_args, dtype=torch.bfloat16):
    """(worst name, err, bound) of both ops on one case under flash-attn's rule."""
    seg_lens, prefix_lens, groups, Hq, Hkv, d, bs = case_args
    paged, packed = make(seg_lens, prefix_lens, groups, Hq, Hkv, d, bs, dtype=dtype, seed=3)
    ref = ref32(packed)
    base = plain(packed, 1.0 / math.sqrt(d))
    bound = 2 * (base.float() - ref).abs().max().item() + 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    worst = ("", 0.0)
    for name, out in (("paged", prefix_shared_attention_paged(*paged, backend="native")),
                      ("packed", prefix_shared_attention(*packed, backend="native"))):
        assert out.dtype == dtype and out.shape == ref.shape
        err = (out.float() - ref).abs().nan_to_num(float("inf")).max().item()
        worst = max(worst, (name, err), key=lambda x: x[1])
    return worst[0], worst[1], bound


@pytest.mark.parametrize("seg_lens,prefix_lens,groups,Hq,Hkv,d,bs", EDGE_CASES)
def test_bf16_within_twice_plain_bf16_on_the_tiles_edges(seg_lens, prefix_lens, groups, Hq, Hkv, d, bs):
    name, err, bound = _rule((seg_lens, prefix_lens, groups, Hq, Hkv, d, bs))
    assert err <= bound, f"{_path()} {name}: bf16 error {err:.3e} > bound {bound:.3e} (2x plain bf16 + rounding)"


_CHILD = r"""
import json, sys
sys.path[:0] = sys.argv[2:]
import torch
from acarerank.ops import _native
from test_op_cpu_attention_bf16_paths import EDGE_CASES, _rule
cases = EDGE_CASES if sys.argv[1] == "all" else EDGE_CASES[:4] + EDGE_CASES[-3:]
rows = [list(_rule(tuple(c.values))) for c in cases]
print(json.dumps({"path": _native.bf16_attention_path(), "amx_tiles": _native.amx_tiles_kernel(), "rows": rows}))
"""


def _run_child(cases: str, **variables) -> subprocess.CompletedProcess:
    """The edge cases in a fresh process (the path is read once per process) with these variables
    set and the other path variable cleared."""
    env = dict(os.environ)
    for name in ("ACARERANK_CPU_BASELINE", "ACARERANK_CPU_BF16_PATH", "ACARERANK_CPU_AMX_TILES"):
        env.pop(name, None)
    env.update(variables)
    tests = os.path.join(ROOT, "tests")
    return subprocess.run([sys.executable, "-c", _CHILD, cases, tests, os.path.join(tests, "ops")], env=env,
                          capture_output=True, text=True, timeout=600)


def _rows_within_the_rule(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    for name, err, bound in got["rows"]:
        assert err <= bound, f"{got['path']} {name}: bf16 error {err:.3e} > bound {bound:.3e}"
    return got["path"]


def test_baseline_switch_runs_the_fp32_tiles_within_the_rule():
    """ACARERANK_CPU_BASELINE=1 takes the fp32-convert path where the CPU would not take AMX, and
    it too meets the rule — so on a CPU with AVX512_BF16 both non-AMX paths are tested here."""
    from acarerank.ops import _native

    path = _rows_within_the_rule(_run_child("some", ACARERANK_CPU_BASELINE="1"))
    assert path == ("amx-brgemm" if _native.could_pack_bf16() else "fp32-convert")


@pytest.mark.parametrize("baseline", [False, True], ids=["brgemm", "brgemm+baseline"])
def test_brgemm_switch_runs_the_amx_code_within_the_rule(baseline):
    """ACARERANK_CPU_BF16_PATH=brgemm runs the amx-brgemm path's code on any AVX-512 CPU: every edge
    case within the rule. On AMX it is that path; elsewhere cpublas' non-AMX bf16 brgemm (oneDNN's
    ukernel) does the products, on the same VNNI operands. Without AVX-512 cpublas refuses them:
    then the switch is a clear error.

    With ACARERANK_CPU_BASELINE=1 too: on an AMX CPU the baseline switch keeps the amx-brgemm
    products (the path is chosen by cpublas' could_pack first) but turns off the AVX-512 code
    around them: the K/V tiles are packed into the VNNI layout by the scalar loop, the softmax
    writes bf16 P in its scalar loop, and no row block takes the direct path, so decode rows go
    through brgemm too. That mix runs nowhere but an AMX CPU; both switches together run it here
    on cpublas' AVX-512 ukernel."""
    from acarerank.ops import _native

    done = _run_child("all", ACARERANK_CPU_BF16_PATH="brgemm", **({"ACARERANK_CPU_BASELINE": "1"} if baseline else {}))
    if _native.could_pack_bf16():
        assert _rows_within_the_rule(done) == "amx-brgemm"
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags():
        assert _rows_within_the_rule(done) == "brgemm"
    else:
        assert done.returncode != 0 and "refuses VNNI tiles on this CPU" in done.stderr, done.stderr[-3000:]


_CHILD_MKLDNN_OFF = r"""
import json, sys
sys.path[:0] = sys.argv[1:]
import torch
from acarerank.ops import _native
from test_op_cpu_attention_bf16_paths import EDGE_CASES, _rule
cases = EDGE_CASES[:4] + EDGE_CASES[-3:]
_rule(tuple(cases[0].values))  # the path is chosen with mkldnn on
torch.backends.mkldnn.enabled = False
rows = [list(_rule(tuple(c.values))) for c in cases]
print(json.dumps({"path": _native.bf16_attention_path(), "rows": rows}))
"""


def test_brgemm_paths_with_mkldnn_turned_off_after_the_first_call_stay_within_the_rule():
    """cpublas runs its bf16 brgemm only while torch.backends.mkldnn is enabled and raises on a VNNI
    B while it is off; the path is chosen once per process. Turned off after the first bf16 call,
    every later call on the brgemm paths (amx-brgemm: AMX's default) raised cpublas' "BFloat16 Brgemm
    VNNI format is only supported ..." from inside the kernel; now those tiles run the avx512-bf16
    ones while it is off, within the same rule. ACARERANK_CPU_BF16_PATH=brgemm runs it here."""
    from acarerank.ops import _native

    env = dict(os.environ)
    for name in ("ACARERANK_CPU_BASELINE", "ACARERANK_CPU_BF16_PATH"):
        env.pop(name, None)
    env["ACARERANK_CPU_BF16_PATH"] = "brgemm"
    tests = os.path.join(ROOT, "tests")
    done = subprocess.run([sys.executable, "-c", _CHILD_MKLDNN_OFF, tests, os.path.join(tests, "ops")], env=env,
                          capture_output=True, text=True, timeout=600)
    if _native.could_pack_bf16() or _has_avx512_bf16():
        assert _rows_within_the_rule(done) == ("amx-brgemm" if _native.could_pack_bf16() else "brgemm")
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags():  # no own tiles to fall back to
        assert done.returncode != 0 and "torch.backends.mkldnn is disabled" in done.stderr, done.stderr[-3000:]
    else:
        assert done.returncode != 0 and "refuses VNNI tiles on this CPU" in done.stderr, done.stderr[-3000:]


def test_brgemm_switch_where_cpublas_refuses_vnni_is_an_error_not_a_crash():
    """With oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA, as on a CPU without AVX-512) cpublas' bf16
    brgemm raises on a VNNI B; asking for the brgemm path there says so and names the variable."""
    done = _run_child("some", ACARERANK_CPU_BF16_PATH="brgemm", ONEDNN_MAX_CPU_ISA="AVX2")
    assert done.returncode != 0
    assert "ACARERANK_CPU_BF16_PATH=brgemm, but cpublas' bf16 brgemm refuses VNNI tiles" in done.stderr, \
        done.stderr[-3000:]


def test_avx512_bf16_switch_runs_the_own_tiles_or_names_the_missing_instructions():
    """ACARERANK_CPU_BF16_PATH=avx512-bf16 takes the vdpbf16ps tiles where the CPU has them, even on
    AMX (so an AMX machine tests them too); without AVX512_BF16 a bf16 call is a clear error,
    never an illegal instruction."""
    done = _run_child("some", ACARERANK_CPU_BF16_PATH="avx512-bf16")
    if _has_avx512_bf16():
        assert _rows_within_the_rule(done) == "avx512-bf16"
    else:
        assert done.returncode != 0 and "has no AVX512_BF16" in done.stderr, done.stderr[-3000:]


def _amx_cpu() -> bool:
    from acarerank.ops import _native

    return _native.could_pack_bf16() and {"amx_bf16", "amx_tile"} <= cpu_flags()


def test_amx_tiles_kernel_runs_where_the_cpu_has_amx():
    """bf16 prefix tiles take the interleaved AMX kernel (csrc/cpu/attn_amx.h) on the amx-brgemm
    path of a CPU whose /proc/cpuinfo lists amx_bf16 and amx_tile, unless ACARERANK_CPU_AMX_TILES=0;
    nowhere else (so on this CPU the edge cases above ran it, or could not)."""
    from acarerank.ops import _native

    want = _path() == "amx-brgemm" and _amx_cpu() and os.environ.get("ACARERANK_CPU_AMX_TILES") != "0"
    assert _native.amx_tiles_kernel() == want, f"path {_path()}, AMX CPU {_amx_cpu()}"


def test_amx_tiles_switch_off_runs_the_brgemm_tiles_within_the_rule():
    """ACARERANK_CPU_AMX_TILES=0 sends the prefix tiles through cpublas' brgemm again, as every
    other tile: every edge case within the rule, and the kernel reported off. With the default on
    (the in-process edge cases) and this, an AMX CPU tests both tile loops."""
    done = _run_child("all", ACARERANK_CPU_AMX_TILES="0")
    _rows_within_the_rule(done)
    assert json.loads(done.stdout.strip().splitlines()[-1])["amx_tiles"] is False


def test_bad_amx_tiles_value_is_an_error_that_names_the_variable():
    done = _run_child("some", ACARERANK_CPU_AMX_TILES="yes")
    assert done.returncode != 0
    assert "ACARERANK_CPU_AMX_TILES must be 0 or 1, got 'yes'" in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("value", ["amx", "AVX512-BF16"])
def test_unknown_bf16_path_is_an_error_that_names_the_variable(value):
    done = _run_child("some", ACARERANK_CPU_BF16_PATH=value)
    assert done.returncode != 0
    assert "ACARERANK_CPU_BF16_PATH must be auto, brgemm, avx512-bf16 or fp32-convert" in done.stderr, \
        done.stderr[-3000:]
    assert f"got '{value}'" in done.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_value_of_a_long_segment_reaches_only_the_rows_that_see_it(dtype):
    """A segment longer than one row block has its keys packed once for every task that reads
    them: a NaN in its value row j still reaches exactly the rows that see j (its tokens j.., the
    query heads of that kv head, that one dim), in the row block holding j and in the later ones."""
    paged, packed = make([300, 6], [37, 10], [0, 1], 4, 2, 64, 16, dtype=dtype)
    ref = ref32(packed)
    paged[2][8, 1, 3] = float("nan")   # v of token 8 (segment 0, 300 tokens > 128 per row block), kv head 1
    out = prefix_shared_attention_paged(*paged, backend="native").float()
    sees = torch.zeros(out.shape[:2], dtype=torch.bool)
    sees[8:300, 2:4] = True
    assert torch.equal(torch.isnan(out).any(-1), sees), f"NaN rows: {torch.nonzero(torch.isnan(out).any(-1))[:6]}"
    assert torch.isnan(out[sees][:, 3]).all() and not torch.isnan(out[sees][:, :3]).any()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out[~sees] - ref[~sees]).abs().max().item() <= tol
