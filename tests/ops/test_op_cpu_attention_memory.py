"""The native CPU attention kernel's memory stays bounded however many distinct shapes it sees.

cpublas::brgemm keeps every oneDNN kernel it generates, one per (M, N, K, ...) and thread, for the
life of the process; the kernel calls it with power-of-two row chunks and key counts rounded by
``gemm_cols`` so that the set is bounded (csrc/cpu/attn_tiles.h, "GEMMs"). A server sees a new
segment length in nearly every request, so the check is what a server would see: random lengths,
prefixes and head counts, one call each.

Each path runs in a fresh process (its kernel cache starts empty; the bf16 path is read once per
process): 400 calls, then 400 more, and the second round must grow RSS by less than 32 MB.
Before the bound, fp32 grew ~300 MB a round of 400 and 1.2 GB over 2,000 calls (EPYC, AVX2 and
AVX-512 oneDNN kernels); with it, +6 MB (the last kernels of the bounded set).
"""
import json
import os
import subprocess
import sys

import pytest

from _ext import needs_native
from _repo import ROOT

pytestmark = needs_native

ROUND, GROWTH_MB = 400, 32

_CHILD = r"""
import json, re, sys
import torch
from acarerank.ops import _native, prefix_shared_attention_paged

dtype, rounds, per_round = getattr(torch, sys.argv[1]), 2, int(sys.argv[2])
g = torch.Generator().manual_seed(0)

def rand(lo, hi):
    return int(torch.randint(lo, hi + 1, (1,), generator=g))

def rss_mb():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024

def one_call():
    # one group: a prefix of 0-300 tokens in 16-token pages, 1-3 segments of 1-60 tokens
    Hkv, d, bs = 2, 64, 16
    Hq, P, S = Hkv * rand(1, 2), rand(0, 300), rand(1, 3)
    lens = [rand(1, 60) for _ in range(S)]
    nb = max(1, -(-P // bs))
    kc = torch.randn(nb, bs, Hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, Hkv, d, generator=g).to(dtype)
    bt = torch.arange(nb, dtype=torch.int32)[None]
    T = sum(lens)
    q, k, v = (torch.randn(T, h, d, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, torch.tensor([P], dtype=torch.int32),
                                        torch.zeros(S, dtype=torch.int32), backend="native")
    assert torch.isfinite(out).all()

rss = [rss_mb()]
for _ in range(rounds):
    for _ in range(per_round):
        one_call()
    rss.append(rss_mb())
print(json.dumps({"path": _native.bf16_attention_path(), "rss": rss}))
"""


@pytest.mark.parametrize("dtype,baseline", [("float32", False), ("bfloat16", False), ("bfloat16", True)],
                         ids=["fp32", "bf16", "bf16-baseline-switch"])
def test_thousands_of_shapes_leave_memory_bounded(dtype, baseline):
    env = dict(os.environ)
    env.pop("ACARERANK_CPU_BASELINE", None)
    if baseline:
        env["ACARERANK_CPU_BASELINE"] = "1"   # bf16 through the fp32 tiles (cpublas brgemm) off AMX
    done = subprocess.run([sys.executable, "-c", _CHILD, dtype, str(ROUND)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    start, first, second = got["rss"]
    grown = second - first
    path = "fp32 tiles" if dtype == "float32" else got["path"]
    print(f"{dtype} ({path}): RSS {start:.0f} MB, {first:.0f} after {ROUND} calls, {second:.0f} after {ROUND} more")
    assert grown < GROWTH_MB, (f"{dtype} on the {path} path: {ROUND} calls of new shapes grew RSS by "
                               f"{grown:.0f} MB (from {first:.0f} MB, after {ROUND} calls), over {GROWTH_MB} MB: "
                               f"a kernel cache keyed by shape is growing")
