"""The bf16 logits GEMM of acarerank._cpu (csrc/cpu/logits_gemm.cpp) and the "native" top-k core
that runs it (acarerank/ops/topk_logprobs.py).

    acarerank::mm_bf16_f32(a [M, K] bf16, b [N, K] bf16, out [M, N] fp32):  out = a · bᵀ

Reference: the product in fp64. Bound: an fp32 GEMM's, K · 2⁻²⁴ · (|a| · |b|ᵀ) per entry — the
bf16 products are exact in fp32, so only the fp32 sums round (in another order than MKL's).
"""
import contextlib
import importlib
import math
import os
import subprocess
import sys

import pytest
import torch

from _ext import needs_native
from _repo import ROOT
from acarerank.ops import _native, topk_logprobs, topk_logprobs_ref

pytestmark = needs_native
TOPK = importlib.import_module("acarerank.ops.topk_logprobs")  # the module (the package exports the function)


def _has_gemm():
    return _native.available() and _native.bf16_logits_gemm()


needs_bf16_gemm = pytest.mark.skipif(not _has_gemm(), reason="this CPU has no AVX512_BF16 (or "
                                     "ACARERANK_CPU_BASELINE=1 / ACARERANK_CPU_BF16_PATH=fp32-convert): the ops "
                                     "upcast to an fp32 GEMM there")


@needs_bf16_gemm
@pytest.mark.skipif(os.environ.get("ACARERANK_LOGITS_GEMM_CHILD") == "1", reason="the child's own run")
@pytest.mark.parametrize("path,uses_gemm", [("brgemm", True), ("fp32-convert", False)])
def test_the_gemm_follows_the_attention_bf16_path(path, uses_gemm):
    """The GEMM's tiles are the attention's (attn_tiles.h's gemm): ACARERANK_CPU_BF16_PATH=brgemm runs
    them through cpublas::brgemm (AMX's code; oneDNN's AVX-512 ukernel on a CPU without AMX) and this
    module's GEMM and native-core tests pass there too; fp32-convert turns the GEMM off (the upcast
    fp32 GEMM). The path is read once per process: a child process runs them."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACARERANK_CPU_BASELINE", "ACARERANK_CPU_BF16_PATH")}
    env.update(ACARERANK_CPU_BF16_PATH=path, ACARERANK_LOGITS_GEMM_CHILD="1", OMP_NUM_THREADS="2")
    # this checkout's package first: from tests/ops an editable install of another checkout would win
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    probe = ("import acarerank.ops._native as n; print(n.bf16_attention_path(), n.bf16_logits_gemm())")
    with _side_by_side([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "gemm_is or strided_rows or empty_and_zero or native_core_runs or gaussian or linear_logprob_bf16 "
                        "or transposed_bf16 or gemm_writes_nothing"] if uses_gemm else None, env) as tests:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        # on AMX the brgemm switch is amx-brgemm itself (attn_tiles.h's choose_bf16_path)
        want = "amx-brgemm" if path == "brgemm" and _native.could_pack_bf16() else path
        assert done.returncode == 0 and done.stdout.split() == [want, str(uses_gemm)], done.stdout + done.stderr[-2000:]
        if not uses_gemm:
            return
        out, _ = tests.communicate(timeout=600)
    assert tests.returncode == 0 and " passed" in out and "skipped" not in out, out[-3000:]


@contextlib.contextmanager
def _side_by_side(cmd, env):
    """``cmd`` (a child pytest run, stdout and stderr together) started now, while the caller runs
    its probe child: each is one core's work for most of its time (mostly imports), so on 2 cores
    the two take little more than the longer one. Yields the Popen (None for no ``cmd``); kills it
    if the caller leaves before reading it (a failed probe)."""
    if cmd is None:
        yield None
        return
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=os.path.dirname(__file__))
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def _mm():
    from acarerank.ops._native_backend import native_kernel

    return native_kernel("mm_bf16_f32", TOPK._mm_bf16_f32_fake)


def _check_gemm(out, a, b, what):
    ref = a.double() @ b.double().T
    bound = (a.double().abs() @ b.double().abs().T) * a.shape[1] * 2.0 ** -24
    err = (out.double() - ref).abs()
    bad = (err > bound).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} entries past K·2⁻²⁴·|a||b|, first (row, col) "
                              f"{bad[:5].tolist()}, max err {err.max().item():.3e}")


@needs_bf16_gemm
@pytest.mark.parametrize("M,N,K", [
    (1, 1, 2), (5, 17, 30), (6, 64, 256), (7, 65, 258), (13, 130, 1024), (3, 200, 2),
    (64, 100, 4096), (12, 63, 512), (1, 2049, 64), (300, 70, 290),
])
def test_gemm_is_an_fp32_gemm_of_the_bf16_inputs(M, N, K):
    """Row blocks of 6 and their tails, panels of 64 columns and their masked tails, K in blocks
    of 256 and a last partial one. On the brgemm path (AMX, or ACARERANK_CPU_BF16_PATH=brgemm:
    test_the_gemm_follows_the_attention_bf16_path) M 300 is the only M past one 256-row chunk
    (256 + 32 + 8 + 4 rows, A and C advanced between them; the attention's row blocks stop at 256
    rows up to a GQA ratio of 256), its last panel 6 columns read at ldb 64, and its last K block
    34 (= 2·17, which no AMX tile width of 32 bf16 divides)."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    a = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, K, generator=g).bfloat16()
    out = torch.full((M, N), float("nan"))
    _mm()(a, b, out)
    _check_gemm(out, a, b, f"M={M} N={N} K={K}")


@needs_bf16_gemm
def test_gemm_reads_strided_rows_and_writes_every_entry():
    """a and b as row slices of wider tensors (the weight chunk of a vocabulary walk, a hidden
    state's columns), every entry of out written whatever it held."""
    g = torch.Generator().manual_seed(3)
    wide_a = torch.randn(9, 300, generator=g).bfloat16()
    wide_b = torch.randn(150, 260, generator=g).bfloat16()
    a, b = wide_a[:, 10:138], wide_b[20:, :128]
    out = torch.full((9, 130), float("nan"))
    _mm()(a, b, out)
    _check_gemm(out, a, b, "strided rows")


@needs_bf16_gemm
@pytest.mark.parametrize("M,N,K", [(1, 1, 2), (7, 65, 258), (13, 127, 66), (6, 64, 512)])
def test_gemm_writes_nothing_outside_out(M, N, K):
    """out as a window of a larger buffer (a row block of 6 and its tail, a panel's masked last
    vector, a K tail): the guard values before and after it stay as they were, on every path."""
    g = torch.Generator().manual_seed(M + N + K)
    a, b = torch.randn(M, K, generator=g).bfloat16(), torch.randn(N, K, generator=g).bfloat16()
    buf = torch.full((M * N + 2 * 67,), 7.0)
    out = buf[67:67 + M * N].view(M, N)
    _mm()(a, b, out)
    _check_gemm(out, a, b, f"M={M} N={N} K={K}")
    assert (buf[:67] == 7.0).all() and (buf[67 + M * N:] == 7.0).all()


@needs_bf16_gemm
def test_gemm_is_an_fp32_gemm_with_mkldnn_turned_off_after_the_first_call():
    """cpublas' bf16 brgemm runs only while torch.backends.mkldnn is enabled; the path is chosen at
    the first call. On the brgemm paths (AMX's default; this module's child run under
    ACARERANK_CPU_BF16_PATH=brgemm) a call with mkldnn off raised cpublas' "BFloat16 Brgemm VNNI
    format is only supported ..."; now the avx512-bf16 tiles do it, the same GEMM."""
    g = torch.Generator().manual_seed(11)
    a = torch.randn(70, 258, generator=g).bfloat16()
    b = torch.randn(130, 258, generator=g).bfloat16()
    out = torch.full((70, 130), float("nan"))
    _mm()(a, b, out)
    _check_gemm(out, a, b, "mkldnn on")
    out = torch.full((70, 130), float("nan"))
    torch.backends.mkldnn.enabled = False
    try:
        _mm()(a, b, out)
    finally:
        torch.backends.mkldnn.enabled = True
    _check_gemm(out, a, b, "mkldnn off")


@needs_bf16_gemm
def test_gemm_empty_and_zero_k():
    out = torch.empty(0, 5)
    _mm()(torch.empty(0, 8, dtype=torch.bfloat16), torch.ones(5, 8, dtype=torch.bfloat16), out)
    out = torch.full((3, 4), 7.0)
    _mm()(torch.empty(3, 0, dtype=torch.bfloat16), torch.empty(4, 0, dtype=torch.bfloat16), out)
    assert torch.equal(out, torch.zeros(3, 4))


@needs_bf16_gemm
@pytest.mark.parametrize("a,b,out,match", [
    (torch.ones(2, 3, dtype=torch.bfloat16), torch.ones(4, 3, dtype=torch.bfloat16), torch.empty(2, 4),
     "K must be even"),
    (torch.ones(2, 4), torch.ones(4, 4, dtype=torch.bfloat16), torch.empty(2, 4), "a must be BFloat16"),
    (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16), torch.empty(2, 4, dtype=torch.bfloat16),
     "out must be Float"),
    (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 6, dtype=torch.bfloat16), torch.empty(2, 4), "the same K"),
    (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16), torch.empty(4, 2), r"out must be \[2, 4\]"),
    (torch.ones(4, 2, dtype=torch.bfloat16).T, torch.ones(4, 4, dtype=torch.bfloat16).T, torch.empty(2, 4),
     "rows must be contiguous"),
    (torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, 4, dtype=torch.bfloat16), torch.empty(4, 2).T,
     "out must be contiguous"),
])
def test_gemm_names_bad_input(a, b, out, match):
    with pytest.raises(RuntimeError, match=match):
        _mm()(a, b, out)


@needs_bf16_gemm
def test_opcheck_mm_bf16_f32():
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(7, 34, generator=g).bfloat16(), torch.randn(70, 34, generator=g).bfloat16()
    _mm()  # loads it, registers its fake
    torch.library.opcheck(torch.ops.acarerank.mm_bf16_f32.default, (a, b, torch.empty(7, 70)))


def _spy(monkeypatch, module=TOPK):
    """Counts the chunk GEMMs ``module`` (the top-k op's, or linear_logprob's) runs through mm_bf16_f32."""
    calls = []
    real = module.native_bf16_gemm_for

    def spying(hidden, weight):
        fn = real(hidden, weight)
        if fn is None:
            return None

        def gemm(a, b, out):
            calls.append(tuple(out.shape))
            return fn(a, b, out)
        return gemm
    monkeypatch.setattr(module, "native_bf16_gemm_for", spying)
    return calls


@needs_bf16_gemm
@pytest.mark.parametrize("T,H,V,chunk", [(1, 64, 1543, None), (13, 30, 1543, 100), (70, 258, 4099, 2048)])
def test_native_core_runs_the_bf16_gemm_and_equals_the_reference(T, H, V, chunk, monkeypatch):
    """Dyadic bf16 inputs (quarters in [-2, 2]): every logit is exact in fp32 whatever the sum
    order, so ids and log-probs equal the fp64 oracle's and the torch core's bitwise."""
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(T + H + V)
    h = (torch.randint(-8, 9, (T, H), generator=g).float() / 4).bfloat16()
    w = (torch.randint(-8, 9, (V, H), generator=g).float() / 4).bfloat16()
    tg = torch.randint(0, V, (T,), generator=g)
    got = topk_logprobs(h, w, tg, k=32, chunk=chunk, temperature=0.5, backend="native")
    assert calls and all(c[0] == T for c in calls), calls
    want = topk_logprobs_ref(h, w, tg, k=32, temperature=0.5)
    torch_core = topk_logprobs(h, w, tg, k=32, chunk=chunk, temperature=0.5, backend="torch")
    for res, what in ((want, "fp64 oracle"), (torch_core, "torch core")):
        assert torch.equal(got.topk_ids, res.topk_ids), what
        assert torch.equal(got.in_topk, res.in_topk), what
        assert (got.topk_logprobs - res.topk_logprobs).abs().max() <= 1e-6, what
        assert (got.target_logprob - res.target_logprob).abs().max() <= 1e-6, what


@needs_bf16_gemm
def test_native_core_on_gaussian_bf16_is_within_the_fp32_rule(monkeypatch):
    """Random bf16 (non-dyadic): the logits differ from the upcast GEMM's by summation order only;
    the log-probs agree with the oracle's to fp32 rounding."""
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(11)
    h, w = torch.randn(9, 128, generator=g).bfloat16(), (0.1 * torch.randn(3001, 128, generator=g)).bfloat16()
    tg = torch.randint(0, 3001, (9,), generator=g)
    got = topk_logprobs(h, w, tg, k=16, outside="full", backend="native")
    want = topk_logprobs_ref(h, w, tg, k=16, outside="full")
    assert calls
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert (got.topk_logprobs - want.topk_logprobs).abs().max() <= 1e-5
    assert (got.target_logprob - want.target_logprob).abs().max() <= 1e-5


@pytest.mark.parametrize("case", ["fp32", "odd hidden", "transposed weight", "baseline"])
def test_native_core_is_the_torch_core_where_the_gemm_cannot_run(case, monkeypatch):
    """fp32 inputs, an odd hidden size, weight rows that are not contiguous, or
    ACARERANK_CPU_BASELINE=1 (and a CPU without AVX512_BF16): the upcast fp32 GEMM, so the torch
    core's logits: its ids bitwise, its log-probs within the fp32 rounding of the log-sum-exp
    (the candidates kernel's exp and sum order)."""
    calls = _spy(monkeypatch)
    g = torch.Generator().manual_seed(2)
    H = 31 if case == "odd hidden" else 32
    h, w = torch.randn(5, H, generator=g), torch.randn(777, H, generator=g)
    if case != "fp32":
        h, w = h.bfloat16(), w.bfloat16()
    if case == "transposed weight":
        w = w.T.contiguous().T
    if case == "baseline":
        monkeypatch.setenv("ACARERANK_CPU_BASELINE", "1")
    tg = torch.randint(0, 777, (5,), generator=g)
    got = topk_logprobs(h, w, tg, k=8, backend="native")
    want = topk_logprobs(h, w, tg, k=8, backend="torch")
    assert not calls, calls
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.in_topk, want.in_topk)
    assert (got.topk_logprobs - want.topk_logprobs).abs().max() <= 1e-6
    assert (got.target_logprob - want.target_logprob).abs().max() <= 1e-6


# --------------------------------------------------------------------- topk_chunk_update
def _update():
    from acarerank.ops._native_backend import native_kernel

    return native_kernel("topk_chunk_update", TOPK._topk_chunk_update_fake)


def _held(T, k, id_hi, g, low=0.0):
    """A state as the core holds it after its first chunk: k sorted entries per row with ids below id_hi."""
    v = (torch.randn(T, k, generator=g) + low).sort(dim=1, descending=True).values
    i = torch.stack([torch.randperm(id_hi, generator=g)[:k] for _ in range(T)])
    m = v[:, 0] + torch.rand(T, generator=g)  # the max so far, at or above every held value
    s = torch.rand(T, generator=g, dtype=torch.float64) + 1.0
    return v, i, m, s


def _update_ref(x, id0, targets, run_v, run_i, m, s, tgt):
    """The held k and the chunk's entries sorted by (value desc, id asc) — the held ids are below the
    chunk's, so a stable sort of [held; chunk] by value is that order — cut to k; the running max
    ignoring NaN, Σ exp in fp64 with shift = the new max unless ±inf; the target's logit."""
    T, n = x.shape
    k = run_v.shape[1]
    ids = torch.arange(id0, id0 + n).expand(T, n)
    v, i = torch.cat([run_v, x], 1), torch.cat([run_i, ids], 1)
    key = torch.where(torch.isnan(v), torch.full_like(v, float("-inf")), v)  # NaN never enters
    order = key.sort(dim=1, descending=True, stable=True).indices[:, :k]
    xm = torch.where(torch.isnan(x), torch.full_like(x, float("-inf")), x)
    m_new = torch.maximum(m, xm.max(dim=1).values) if n else m.clone()
    shift = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
    s_new = s * torch.exp((m - shift).double()) + torch.exp(x.double() - shift[:, None].double()).sum(1)
    t_new = tgt.clone()
    inside = (targets >= id0) & (targets < id0 + n)
    t_new[inside] = x[inside, targets[inside] - id0]
    return v.gather(1, order), i.gather(1, order), m_new, s_new, t_new


def _run_update(x, id0, targets, run_v, run_i, m, s, tgt):
    state = [t.clone() for t in (run_v, run_i, m, s, tgt)]
    _update()(x, id0, targets, *state)
    return state


def _check_update(got, want, what):
    for name, a, b in zip(("run_v", "run_i", "m"), got[:3], want[:3]):
        assert torch.equal(a, b), f"{what}: {name} differs at {(a != b).nonzero()[:5].tolist()}"
    a, b = got[4], want[4]
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), f"{what}: tgt differs"
    # s: fp32 sums of a 2-ulp exp, rescaled in fp64; equal NaN / inf, else within 1e-6 relative
    a, b = got[3], want[3]
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    err = torch.where(same, torch.zeros_like(a), (a - b).abs() / b.abs().clamp_min(1e-300))
    assert (err <= 1e-6).all(), f"{what}: s off by {err.max().item():.2e} (rel) at {(err > 1e-6).nonzero()[:5].tolist()}"


@pytest.mark.parametrize("T,n,k", [(1, 1, 1), (7, 2048, 16), (33, 100, 128), (5, 64, 4), (3, 300, 40)])
def test_update_merges_the_entries_above_the_kth_into_the_held_k(T, n, k):
    """Rows where none, a few, and more than k of the chunk's entries beat the k-th held value
    (then the row is read again and sorted: the row held at −1e30); NaN never enters; targets in
    and out of the chunk."""
    g = torch.Generator().manual_seed(T * n + k)
    id0 = 4096
    run_v, run_i, m, s = _held(T, k, id0, g, low=1.5)
    run_v[-1] = -1e30  # every finite entry beats it
    x = torch.randn(T, n, generator=g)
    x[0, : min(3, n)] = float("nan")
    targets = torch.randint(id0 - n, id0 + 2 * n, (T,), generator=g)
    tgt = torch.full((T,), float("nan"))
    args = (x, id0, targets, run_v, run_i, m, s, tgt)
    _check_update(_run_update(*args), _update_ref(*args), f"T={T} n={n} k={k}")


@pytest.mark.parametrize("k", [4, 32])
def test_update_rows_with_every_count_of_entries_above_the_kth(k):
    """Rows with 0 to 40 entries above the k-th held value: below and above both k and the
    kernel's one-by-one insertion limit (24), which take other ways into the held k (one by one,
    sorted and merged, the row read again when more than k)."""
    g = torch.Generator().manual_seed(k)
    T, n = 41, 300
    run_v, run_i, m, s = _held(T, k, 1000, g, low=5.0)
    x = torch.randn(T, n, generator=g) - 10.0
    for t in range(T):
        cols = torch.randperm(n, generator=g)[:t]
        x[t, cols] = run_v[t, -1] + 0.5 + 3 * torch.rand(t, generator=g)
    args = (x, 1000, torch.arange(T) + 1000, run_v, run_i, m, s, torch.zeros(T))
    _check_update(_run_update(*args), _update_ref(*args), f"k={k}")


def test_update_ties_lose_to_the_held_and_go_by_id_among_themselves():
    """An entry equal to the k-th held value does not enter (its id is higher); equal entries of
    the chunk enter lowest id first; −0.0 and +0.0 tie as values; integer logits tie everywhere."""
    k = 6
    run_v = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    run_i = torch.tensor([[9, 3, 7, 1, 0, 2]])
    x = torch.tensor([[0.0, 2.0, -0.0, 2.0, 1.0, 7.0, 2.0, 0.5]])
    args = (x, 100, torch.tensor([103]), run_v, run_i, torch.tensor([5.0]), torch.tensor([1.0], dtype=torch.float64),
            torch.tensor([float("nan")]))
    got = _run_update(*args)
    assert got[0].tolist() == [[7.0, 5.0, 4.0, 3.0, 2.0, 2.0]] and got[1].tolist() == [[105, 9, 3, 7, 1, 101]], got[:2]
    _check_update(got, _update_ref(*args), "ties")
    g = torch.Generator().manual_seed(3)
    xi = torch.randint(-3, 4, (9, 500), generator=g).float()
    run_v, run_i, m, s = _held(9, 32, 50, g)
    run_v = run_v.round()
    args = (xi, 50, torch.zeros(9, dtype=torch.int64), run_v.sort(dim=1, descending=True).values, run_i, m, s,
            torch.zeros(9))
    _check_update(_run_update(*args), _update_ref(*args), "integer logits")


def test_update_log_sum_exp_at_the_edges():
    """Rows of only −inf (sum unchanged, max −inf: shift 0), a +inf (max +inf: shift 0, the sum
    overflows to a huge or inf value — the op's log-sum-exp check then names the row), entries 100
    below the max (exp under fp32's range: they count 0, ~1e-44 in fp64) and a held max above the
    chunk's."""
    x = torch.randn(4, 300)
    x[0] = float("-inf")
    x[1, 5] = float("inf")
    x[2, :100] = x[2].max() - 100.0
    m = torch.tensor([float("-inf"), 0.0, float("-inf"), 50.0])
    s = torch.tensor([0.0, 1.0, 0.0, 2.0], dtype=torch.float64)
    run_v, run_i = torch.full((4, 2), float("inf")), torch.zeros(4, 2, dtype=torch.int64)  # nothing enters
    args = (x, 10, torch.full((4,), 3), run_v, run_i, m, s, torch.zeros(4))
    got, want = _run_update(*args), _update_ref(*args)
    assert got[2].tolist()[:2] == [float("-inf"), float("inf")] and got[3][0] == 0.0
    assert got[3][1] >= 3e38  # exp(+inf - 0) clamped: never a finite row sum a log-sum-exp could pass
    for r in (2, 3):
        assert abs(got[3][r].item() - want[3][r].item()) <= 1e-6 * want[3][r].item() + 1e-38, (r, got[3][r], want[3][r])
    assert torch.equal(got[0], run_v) and torch.equal(got[1], run_i)


def test_update_writes_nothing_outside_its_outputs():
    """Every state tensor a window of a larger buffer: the guard values around each stay as they were."""
    g = torch.Generator().manual_seed(5)
    T, n, k, pad = 5, 300, 4, 33
    x = torch.randn(T, n, generator=g)
    run_v, run_i, m, s = _held(T, k, 100, g, low=-1.0)

    def window(t, fill):
        buf = torch.full((t.numel() + 2 * pad,), fill, dtype=t.dtype)
        view = buf[pad:pad + t.numel()].view(t.shape)
        view.copy_(t)
        return buf, view

    bufs = [window(run_v, 7.0), window(run_i, 7), window(m, 7.0), window(s, 7.0), window(torch.zeros(T), 7.0)]
    targets = torch.arange(T) * 70 + 100
    want = _update_ref(x, 100, targets, *(v.clone() for _, v in bufs))
    _update()(x, 100, targets, *(v for _, v in bufs))
    _check_update([v for _, v in bufs], want, "windows")
    for buf, _ in bufs:
        assert (buf[:pad] == 7).all() and (buf[-pad:] == 7).all()


def test_update_reads_strided_rows_and_empty_shapes():
    g = torch.Generator().manual_seed(6)
    wide = torch.randn(6, 300, generator=g)
    run_v, run_i, m, s = _held(6, 8, 50, g, low=-1.0)
    args = (wide[:, 7:207], 50, torch.arange(6) + 60, run_v, run_i, m, s, torch.zeros(6))
    _check_update(_run_update(*args), _update_ref(*args), "strided")
    _run_update(torch.empty(0, 5), 0, torch.empty(0, dtype=torch.int64), torch.empty(0, 3),
                torch.empty(0, 3, dtype=torch.int64), torch.empty(0), torch.empty(0, dtype=torch.float64), torch.empty(0))
    args = (torch.empty(6, 0), 50, torch.arange(6), run_v, run_i, m, s, torch.zeros(6))
    got = _run_update(*args)
    assert torch.equal(got[0], run_v) and torch.equal(got[2], m) and torch.equal(got[3], s)


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.ones(2, 4, dtype=torch.float64)), "x must be Float"),
    (dict(m=torch.ones(3)), r"targets, m, s and tgt must be \[2\]"),
    (dict(s=torch.ones(2)), "s must be Double"),
    (dict(run_i=torch.zeros(2, 3, dtype=torch.int32)), "run_i must be Long"),
    (dict(run_v=torch.zeros(2, 5)), "run_v and run_i must be"),
    (dict(run_v=torch.zeros(2, 0), run_i=torch.zeros(2, 0, dtype=torch.int64)), "k >= 1"),
    (dict(x=torch.ones(4, 2).T), "rows must be contiguous"),
    (dict(id0=2 ** 31 - 3), "below 2\\*\\*31 - 1"),
])
def test_update_names_bad_input(change, match):
    args = dict(x=torch.ones(2, 4), id0=0, targets=torch.zeros(2, dtype=torch.int64), run_v=torch.zeros(2, 3),
                run_i=torch.zeros(2, 3, dtype=torch.int64), m=torch.zeros(2), s=torch.zeros(2, dtype=torch.float64),
                tgt=torch.zeros(2))
    args.update(change)
    with pytest.raises(RuntimeError, match=match):
        _update()(**args)


def test_opcheck_topk_chunk_update():
    g = torch.Generator().manual_seed(8)
    run_v, run_i, m, s = _held(5, 8, 100, g)
    args = (torch.randn(5, 70, generator=g), 100, torch.arange(5) + 120, run_v, run_i, m, s, torch.zeros(5))
    _update()
    torch.library.opcheck(torch.ops.acarerank.topk_chunk_update.default, args)


@pytest.mark.parametrize("order", ["random", "rising", "ties"])
def test_native_core_in_fp32_is_the_torch_core(order):
    """fp32: the native core differs from the torch core only in where a chunk is merged and its
    log-sum-exp terms summed (C++), so the top-k ids and in_topk are bitwise the same and the
    log-probs within fp32 rounding of the log-sum-exp — random logits, logits rising with the id
    (more than k candidates per chunk: the exact chunk top-k) and integer logits (ties everywhere)."""
    g = torch.Generator().manual_seed(7)
    T, H, V = 11, 16, 5000
    h = torch.randn(T, H, generator=g)
    w = torch.randn(V, H, generator=g)
    if order == "rising":
        h[:, 0], w[:, 0] = 1.0, torch.linspace(-50, 50, V)
    if order == "ties":
        h, w = torch.randint(-2, 3, (T, H), generator=g).float(), torch.randint(-2, 3, (V, H), generator=g).float()
    tg = torch.randint(0, V, (T,), generator=g)
    for chunk in (None, 300):
        got = topk_logprobs(h, w, tg, k=64, chunk=chunk, outside="full", backend="native")
        want = topk_logprobs(h, w, tg, k=64, chunk=chunk, outside="full", backend="torch")
        for name in ("topk_ids", "in_topk"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (order, chunk, name)
        for name in ("topk_logprobs", "target_logprob"):
            err = (getattr(got, name) - getattr(want, name)).abs().max().item()
            assert err <= 1e-5, (order, chunk, name, err)


# --------------------------------------------------------------------- linear_logprob on bf16
def _bound_of_bf16_dz(h, w, tg, tau, g_lp, g_ent=None):
    """Per entry, how far rounding ∂z to bf16 can move each gradient: ∂z_tj → ∂z_tj(1 + δ), |δ| ≤ 2⁻⁷
    (one bf16 rounding, 2⁻⁸, of an fp32 ∂z that may sit on the other side of a rounding boundary
    than the exact one), so |Δ∂h| ≤ 2⁻⁷ · |∂z| · |W| and |Δ∂W| ≤ 2⁻⁷ · |∂z|ᵀ · |h| (∂z here is ∂L/∂(h·Wᵀ),
    the 1/τ included), computed in fp64 from materialised logits."""
    h64, w64 = h.double(), w.double()
    z = (h64 @ w64.T).requires_grad_()
    lsm = (z / tau).log_softmax(dim=1)
    loss = (lsm.gather(1, tg[:, None])[:, 0] * g_lp.double()).sum()
    if g_ent is not None:
        loss = loss - ((lsm.exp() * lsm).sum(dim=1) * g_ent.double()).sum()
    dz = torch.autograd.grad(loss, z)[0].abs()
    return 2.0 ** -7 * (dz @ w64.abs()), 2.0 ** -7 * (dz.T @ h64.abs())


@needs_bf16_gemm
@pytest.mark.parametrize("mode", ["native", "fp32 grad", "baseline"])
def test_linear_logprob_bf16_logits_come_from_the_bf16_gemm(mode, monkeypatch):
    """bf16 policy log-probs: the forward's and the backward's logits chunks run mm_bf16_f32 (no
    fp32 copy of the weight for them), and so does the backward's ∂hidden GEMM, on ∂z rounded to
    bf16 (``native``; ∂W: torch's bf16 mm): log-probs and entropy within fp32 tolerance of the fp32
    oracle on the same rounded inputs, gradients within one bf16 rounding of its gradient plus what
    rounding ∂z to bf16 can move them (``_bound_of_bf16_dz``). Under
    ACARERANK_LINEAR_LOGPROB_FP32_GRAD=1 the gradient GEMMs take fp32 ∂z and the gradients are
    within one bf16 rounding; under ACARERANK_CPU_BASELINE=1 (the upcast GEMM) no chunk runs it,
    the same rule."""
    from acarerank.ops import linear_logprob, linear_logprob_ref
    from acarerank.ops.linear_logprob import FP32_GRAD_ENV_VAR
    calls = _spy(monkeypatch, importlib.import_module("acarerank.ops.linear_logprob"))
    g = torch.Generator().manual_seed(4)
    T, H, V = 17, 64, 1031
    h0, w0 = torch.randn(T, H, generator=g).bfloat16(), (0.2 * torch.randn(V, H, generator=g)).bfloat16()
    tg = torch.randint(0, V, (T,), generator=g)
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)

    def run(fn, h, w):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        lp, ent = fn(h, w, tg, temperature=0.8, return_entropy=True)
        (lp * g_lp + ent * g_ent).sum().backward()
        return lp.detach(), ent.detach(), h.grad, w.grad

    ref = run(linear_logprob_ref, h0.float(), w0.float())
    if mode == "baseline":
        monkeypatch.setenv("ACARERANK_CPU_BASELINE", "1")
    monkeypatch.setenv(FP32_GRAD_ENV_VAR, "1" if mode == "fp32 grad" else "0")
    got = run(lambda *a, **kw: linear_logprob(*a, chunk=300, **kw), h0, w0)
    # 4 chunks (the last 131 wide: ∂h's GEMM pads its K to 132), forward + backward, + ∂h's in native
    logits = [(T, 300)] * 3 + [(T, 131)]
    want_calls = {"native": logits + logits + [(T, H)] * 4, "fp32 grad": logits * 2, "baseline": []}[mode]
    assert sorted(calls) == sorted(want_calls), (mode, calls)
    dz_h, dz_w = _bound_of_bf16_dz(h0, w0, tg, 0.8, g_lp, g_ent) if mode == "native" else (0, 0)
    for name, a, b, rel, extra in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), got, ref,
                                      (1e-5, 1e-5, 2.0 ** -8, 2.0 ** -8), (0, 0, dz_h, dz_w)):
        err = (a.double() - b.double()).abs()
        bad = err > 1e-5 + rel * b.double().abs() + extra
        assert not bad.any(), f"{mode} {name}: max err {err.max().item():.3e} at {bad.nonzero()[:3].tolist()}"


@pytest.mark.skipif(os.environ.get("ACARERANK_LOGITS_GEMM_CHILD") == "1", reason="the child's own run")
@pytest.mark.parametrize("isa", ["avx2", "baseline"])
def test_chunk_update_in_every_layer_build(isa):
    """The chunk update's row kernel is compiled per ISA with the element-wise ones (layer_kernels.h;
    the AVX-512 build's in intrinsics): the AVX2 and baseline builds (ACARERANK_CPU_LAYER_ISA, read
    once per process: a child) pass the update's tests and the fp32 native core's agreement with
    the torch core too."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACARERANK_CPU_BASELINE", "ACARERANK_CPU_LAYER_ISA")}
    env.update(ACARERANK_CPU_LAYER_ISA=isa, ACARERANK_LOGITS_GEMM_CHILD="1", OMP_NUM_THREADS="2")
    probe = "import acarerank.ops._native as n; print(n.layer_kernel_isa())"
    with _side_by_side([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                        "update or native_core_in_fp32"], env) as tests:
        done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
        out, _ = tests.communicate(timeout=600)
    assert tests.returncode == 0 and " passed" in out, out[-3000:]
    assert done.stdout.split() == [isa], done.stdout + done.stderr[-2000:]


@needs_bf16_gemm
def test_a_transposed_bf16_hidden_takes_the_gemm_with_contiguous_rows(monkeypatch):
    """A transposed hidden (strides (1, T); .float() and .to() keep them) reached mm_bf16_f32 from
    linear_logprob as it came — a RuntimeError from inside the kernel ("rows must be contiguous"),
    forward and backward. Both ops now give the kernel contiguous rows and keep their rule:
    log-probs within fp32 tolerance of the fp32 oracle, gradients within one bf16 rounding and
    that of ∂z (``_bound_of_bf16_dz``); the rule itself refuses rows the kernel cannot read."""
    from acarerank.ops import linear_logprob, linear_logprob_ref
    from acarerank.ops._logits_gemm import native_bf16_gemm_for
    LP = importlib.import_module("acarerank.ops.linear_logprob")
    g = torch.Generator().manual_seed(6)
    T, H, V = 7, 64, 300
    h_t = torch.randn(H, T, generator=g).bfloat16().T  # [T, H], strides (1, T)
    w = (0.2 * torch.randn(V, H, generator=g)).bfloat16()
    tg = torch.randint(0, V, (T,), generator=g)
    assert h_t.stride() == (1, T) and native_bf16_gemm_for(h_t, w) is None
    calls = _spy(monkeypatch, LP)
    h = h_t.detach().requires_grad_()
    lp = linear_logprob(h, w, tg, chunk=100)
    lp.sum().backward()
    assert len(calls) == 3 * 3, calls  # 3 chunks: forward, backward and ∂hidden's GEMM
    h32 = h_t.float().requires_grad_()
    ref = linear_logprob_ref(h32, w.float(), tg)
    ref.sum().backward()
    assert (lp.detach() - ref.detach()).abs().max() <= 1e-5
    dz_h, _ = _bound_of_bf16_dz(h_t, w, tg, 1.0, torch.ones(T))
    assert ((h.grad.double() - h32.grad.double()).abs() <= 1e-5 + 2.0 ** -8 * h32.grad.double().abs() + dz_h).all()
    calls = _spy(monkeypatch)
    got = topk_logprobs(h_t, w, tg, k=16, chunk=100, backend="native")
    want = topk_logprobs_ref(h_t, w, tg, k=16)
    # the first chunk here; the rest in topk_gemm_update, which refuses rows that are not contiguous too
    assert len(calls) == 1, calls
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert (got.topk_logprobs - want.topk_logprobs).abs().max() <= 1e-5
