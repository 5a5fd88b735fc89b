"""The bf16 compute paths of the native CPU attention kernel (csrc/cpu/attn_tiles.h, ``bf16_path()``).

One kernel, three ways to multiply bf16 tiles, chosen once per process from the CPU:
  amx-brgemm    cpublas::brgemm on VNNI tiles (where cpublas can pack bf16: AMX)
  avx512-bf16   our vdpbf16ps tiles on the same VNNI layout (csrc/cpu/gemm_bf16_avx512.h)
  fp32-convert  tiles converted to fp32 as they are packed (no native bf16, or ACARERANK_CPU_BASELINE=1)

Every path is held to flash-attn's rule (kernel error ≤ 2× plain bf16 PyTorch's, + twice fp32's
rounding step near the outputs, both against the fp32 oracle on the same bf16 values) on shapes
that reach the tiles' edges: row counts that are not a multiple of the 6-row register block,
head_dim 72 (a masked last vector), own parts over one 256-key tile, one-token segments, empty
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

from _ext import needs_native
from _repo import ROOT
from acarerank.ops import prefix_shared_attention, prefix_shared_attention_paged
from test_op_cpu_attention_native import CASES, make, plain, ref32

pytestmark = needs_native

# seg_lens, prefix_lens, groups, Hq, Hkv, d, block_size: the tiles' edges
EDGE_CASES = CASES + [
    pytest.param([5, 11, 2], [29, 3], [0, 1, 1], 3, 1, 72, 16, id="gqa3-d72-masked-vector"),
    pytest.param([263, 1], [0, 520], [0, 1], 2, 2, 128, 64, id="own-over-a-tile-no-prefix"),
    pytest.param([13], [1031], [0], 16, 8, 128, 16, id="qwen3-0.6b-heads-prime-prefix"),
]


def _cpu_flags() -> set:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def _path() -> str:
    from acarerank.ops import _native

    return _native.bf16_attention_path()


def test_bf16_path_follows_the_cpu():
    """AMX where cpublas packs bf16, else AVX512_BF16 where /proc/cpuinfo lists it, else fp32 tiles."""
    from acarerank.ops import _native

    flags = _cpu_flags()
    if _native.could_pack_bf16():
        want = "amx-brgemm"
    elif {"avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        want = "avx512-bf16"
    else:
        want = "fp32-convert"
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
sys.path[:0] = sys.argv[1:]
import torch
from acarerank.ops import _native
from test_op_cpu_attention_bf16_paths import EDGE_CASES, _rule
rows = [list(_rule(tuple(c.values))) for c in EDGE_CASES[:4] + EDGE_CASES[-3:]]
print(json.dumps({"path": _native.bf16_attention_path(), "rows": rows}))
"""


def test_baseline_switch_runs_the_fp32_tiles_within_the_rule():
    """ACARERANK_CPU_BASELINE=1 (a fresh process: the path is read once) takes the fp32-convert path
    where the CPU would not take AMX, and it too meets the rule — so on a CPU with AVX512_BF16
    both non-AMX paths are tested here."""
    env = dict(os.environ, ACARERANK_CPU_BASELINE="1")
    tests = os.path.join(ROOT, "tests")
    done = subprocess.run([sys.executable, "-c", _CHILD, tests, os.path.join(tests, "ops")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    from acarerank.ops import _native

    assert got["path"] == ("amx-brgemm" if _native.could_pack_bf16() else "fp32-convert")
    for name, err, bound in got["rows"]:
        assert err <= bound, f"{got['path']} {name}: bf16 error {err:.3e} > bound {bound:.3e}"


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
