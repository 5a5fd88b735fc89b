"""Memory stays bounded however many distinct shapes the CPU ops see.

oneDNN generates code per shape and its callers keep it: cpublas::brgemm one kernel per
(M, N, K, ...) and thread for the life of the process, never evicted; torch's oneDNN linear one
primitive per row count, in two caches of 1,024 entries (~1 MB each at the 0.6B shapes). A
server sees a new length in nearly every request. So the attention kernel hands brgemm a
bounded set of shapes (power-of-two row chunks, key counts rounded by ``gemm_cols``;
csrc/cpu/attn_tiles.h, "GEMMs"), and importing acarerank caps both linear caches
(acarerank/_onednn_env.py).

The check is what a server would see: random lengths, one call each, in a fresh process (its
caches start empty; the bf16 attention path is read once per process; the cache variables not
set, so that only the package's own bound applies): 200 calls, then 200 more, and the second
round must grow RSS by less than 32 MB. Without the bounds (EPYC, 2026-12-02): attention fp32
+280-340 MB a round of 400, 1.2 GB over 2,000 calls (~0.6 MB a call: ~120-170 MB a round of
200); linear +200-220 MB a round of 400, and +112-144 MB a round of 200 with the caches at
oneDNN's default 1,024 entries (2026-12-07); with them, a second round of 200 grew by 0-7 MB.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from _ext import cpu_flags, needs_native
from _repo import ROOT
from acarerank._onednn_env import CAPACITY, VARIABLES, bound_onednn_caches
from acarerank.ops.linear import onednn_why_unavailable

ONEDNN_DTYPES = [n for n in ("float32", "bfloat16") if not onednn_why_unavailable(getattr(torch, n))]

ROUND, GROWTH_MB = 200, 32




_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()

# each child prints {"path": ..., "rss": [MB at start, after a round, after another]} last
_RSS = r"""
import json, re, sys
import torch

def rss_mb():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1)) / 1024

def rounds(one_call, path, per_round, n=2):
    rss = [rss_mb()]
    for _ in range(n):
        for _ in range(per_round):
            one_call()
        rss.append(rss_mb())
    print(json.dumps({"path": path, "rss": rss}))
"""

_ATTENTION = _RSS + r"""
from acarerank.ops import _native, prefix_shared_attention_paged

dtype, per_round = getattr(torch, sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)

def rand(lo, hi):
    return int(torch.randint(lo, hi + 1, (1,), generator=g))

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

rounds(one_call, _native.bf16_attention_path(), per_round)
"""


@needs_native
@pytest.mark.parametrize("dtype,variables", [
    ("float32", {}),
    ("bfloat16", {}),
    ("bfloat16", {"ACARERANK_CPU_BASELINE": "1"}),     # bf16 through the fp32 tiles (fp32 brgemm) off AMX
    pytest.param("bfloat16", {"ACARERANK_CPU_BF16_PATH": "brgemm"},  # the AMX path's bf16 brgemm calls
                 marks=pytest.mark.skipif(not _AVX512, reason="cpublas' bf16 brgemm takes VNNI tiles only from "
                                                               "AVX-512 on: no brgemm path on this CPU")),
], ids=["fp32", "bf16", "bf16-baseline-switch", "bf16-brgemm-switch"])
def test_thousands_of_shapes_leave_memory_bounded(dtype, variables):
    env = _env_without_cache_variables()
    env.pop("ACARERANK_CPU_BASELINE", None)
    env.pop("ACARERANK_CPU_BF16_PATH", None)
    env.update(variables)
    got = _child(_ATTENTION, dtype, env)
    start, first, second = got["rss"]
    grown = second - first
    path = "fp32 tiles" if dtype == "float32" else got["path"]
    print(f"{dtype} ({path}): RSS {start:.0f} MB, {first:.0f} after {ROUND} calls, {second:.0f} after {ROUND} more")
    assert grown < GROWTH_MB, (f"{dtype} on the {path} path: {ROUND} calls of new shapes grew RSS by "
                               f"{grown:.0f} MB (from {first:.0f} MB, after {ROUND} calls), over {GROWTH_MB} MB: "
                               f"a kernel cache keyed by shape is growing")


_LINEAR = _RSS + r"""
from acarerank.ops import linear, prepare_linear_weight

dtype, per_round = getattr(torch, sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)
w = prepare_linear_weight((torch.randn(384, 128, generator=g) / 12).to(dtype), "onednn")
x = torch.randn(3000, 128, generator=g).to(dtype)

def one_call():
    M = int(torch.randint(1, 3001, (1,), generator=g))
    assert torch.isfinite(linear(x[:M], w)).all()

rounds(one_call, "onednn", per_round)
"""


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
def test_thousands_of_row_counts_leave_the_linear_memory_bounded(dtype):
    got = _child(_LINEAR, dtype, _env_without_cache_variables())
    start, first, second = got["rss"]
    print(f"linear {dtype}: RSS {start:.0f} MB, {first:.0f} after {ROUND} calls, {second:.0f} after {ROUND} more")
    assert second - first < GROWTH_MB, (f"linear {dtype} on oneDNN: {ROUND} calls of new row counts grew RSS by "
                                        f"{second - first:.0f} MB (from {first:.0f} MB), over {GROWTH_MB} MB: its "
                                        f"primitive caches are filling with one primitive per row count")


def _child(code: str, dtype: str, env: dict) -> dict:
    done = subprocess.run([sys.executable, "-c", code, dtype, str(ROUND)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _env_without_cache_variables() -> dict:
    """This environment less oneDNN's cache variables (this process's import of acarerank set
    them): the child's own import must bound the caches."""
    env = dict(os.environ)
    for name in VARIABLES:
        env.pop(name, None)
    return env


def test_the_cache_bound_leaves_a_users_setting_alone(monkeypatch):
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "500")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    bound_onednn_caches()
    assert os.environ["LRU_CACHE_CAPACITY"] == "500"
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(CAPACITY)


@pytest.mark.parametrize("given, ideep_reads", [
    ("32", 32), ("+32", 32), (" \t32", 32), ("32abc", 32), ("32 ", 32), ("007", 7),
    ("", 0), ("abc", 0), ("0", 0), ("-3", -3), ("+ 3", 0), ("\u00a032", 0), ("\u0663\u0662", 0), ("\uff13\uff12", 0),
    (str(2**31), -2**31), (str(2**32 + 5), 5), ("9" * 30, -1),
])
def test_the_capacity_is_read_as_ideeps_atoi_reads_it(monkeypatch, given, ideep_reads):
    """ideep reads LRU_CACHE_CAPACITY with std::atoi (ideep's lru_cache.hpp), and crashes at a
    capacity below 1. The check took Unicode digits (str.isdecimal: "٣٢" kept, ideep's 0, SIGSEGV at
    the first bf16 linear) and replaced values ideep reads fine ("+32", "32abc"). Now the value is
    read as glibc's atoi reads it, (int) strtol; kept where that is >= 1, else CAPACITY and a warning."""
    import ctypes

    from acarerank._onednn_env import c_atoi

    libc_reads = ctypes.CDLL(None).atoi(given.encode())  # the C library's own, in this process's locale
    assert c_atoi(given) == ideep_reads == libc_reads, (given, c_atoi(given), ideep_reads, libc_reads)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", given)
    if ideep_reads >= 1:
        bound_onednn_caches()
        assert os.environ["LRU_CACHE_CAPACITY"] == given
    else:
        with pytest.warns(RuntimeWarning, match="is not an integer >= 1"):
            bound_onednn_caches()
        assert os.environ["LRU_CACHE_CAPACITY"] == str(CAPACITY)


@pytest.mark.skipif(bool(onednn_why_unavailable(torch.float32)), reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("given", ["0", "", "abc", "-3", "\u0663\u0662"])  # the last: "32" in Arabic-Indic digits
def test_an_ideep_capacity_that_would_crash_is_replaced_with_a_warning(given):
    """LRU_CACHE_CAPACITY "", "abc" or "0" is ideep's capacity 0, and its cache then crashed the
    process (SIGSEGV, no message) at the first oneDNN linear: importing acarerank replaces it
    with CAPACITY and warns, naming it. Checked in a child (the variable is read once per process)."""
    code = ("import os, acarerank, torch\n"
            "from acarerank.ops import linear, prepare_linear_weight\n"
            "w = prepare_linear_weight(torch.randn(32, 64), 'onednn')\n"
            "print(tuple(linear(torch.randn(4, 64), w).shape), os.environ['LRU_CACHE_CAPACITY'])\n")
    env = dict(_env_without_cache_variables(), LRU_CACHE_CAPACITY=given, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.split() == ["(4,", "32)", str(CAPACITY)], done.stdout
    assert f"LRU_CACHE_CAPACITY={given!r} is not an integer >= 1" in done.stderr, done.stderr[-2000:]
