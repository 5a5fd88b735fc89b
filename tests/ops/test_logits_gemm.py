"""The bf16 logits GEMM of acarerank._cpu (csrc/cpu/logits_gemm.cpp) and the "native" top-k core
that runs it (acarerank/ops/topk_logprobs.py).

    acarerank::mm_bf16_f32(a [M, K] bf16, b [N, K] bf16, out [M, N] fp32):  out = a · bᵀ

Reference: the product in fp64. Bound: an fp32 GEMM's, K · 2⁻²⁴ · (|a| · |b|ᵀ) per entry — the
bf16 products are exact in fp32, so only the fp32 sums round (in another order than MKL's).
"""
import importlib
import os
import subprocess
import sys

import pytest
import torch

from _ext import needs_native
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
    them through cpublas::brgemm (AMX's code, oneDNN's AVX-512 ukernel on this CPU) and this
    module's GEMM and native-core tests pass there too; fp32-convert turns the GEMM off (the upcast
    fp32 GEMM). The path is read once per process: a child process runs them."""
    env = {k: v for k, v in os.environ.items() if k not in ("ACARERANK_CPU_BASELINE", "ACARERANK_CPU_BF16_PATH")}
    env.update(ACARERANK_CPU_BF16_PATH=path, ACARERANK_LOGITS_GEMM_CHILD="1", OMP_NUM_THREADS="2")
    probe = ("import acarerank.ops._native as n; print(n.bf16_attention_path(), n.bf16_logits_gemm())")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == [path, str(uses_gemm)], done.stdout + done.stderr[-2000:]
    if not uses_gemm:
        return
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "gemm_is or strided_rows or empty_and_zero or native_core_runs or gaussian or linear_logprob_bf16"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=os.path.dirname(__file__))
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-3000:]


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
    (64, 100, 4096), (12, 63, 512), (1, 2049, 64),
])
def test_gemm_is_an_fp32_gemm_of_the_bf16_inputs(M, N, K):
    """Row blocks of 6 and their tails, panels of 64 columns and their masked tails, K in blocks
    of 256 and a last partial one."""
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
    ACARERANK_CPU_BASELINE=1 (and a CPU without AVX512_BF16): the upcast fp32 GEMM, bitwise the
    torch core's result."""
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
    assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.topk_logprobs, want.topk_logprobs)
    assert torch.equal(got.target_logprob, want.target_logprob)


# --------------------------------------------------------------------- topk_candidates
PAD_ID = 2 ** 31 - 1


def _candidates():
    from acarerank.ops._native_backend import native_kernel

    return native_kernel("topk_candidates", TOPK._topk_candidates_fake)


def _candidates_ref(x, theta, id0, cap):
    """Per row: the entries above theta in id order, padded with (−inf, 2³¹ − 1); and the count."""
    T = x.shape[0]
    vals = torch.full((T, cap), float("-inf"))
    ids = torch.full((T, cap), PAD_ID, dtype=torch.int64)
    counts = torch.zeros(T, dtype=torch.int64)
    for t in range(T):
        j = (x[t] > theta[t]).nonzero().flatten()
        counts[t] = j.numel()
        j = j[:cap]
        vals[t, :j.numel()], ids[t, :j.numel()] = x[t, j], j + id0
    return vals, ids, counts


@pytest.mark.parametrize("T,n,cap", [(1, 1, 1), (7, 2048, 16), (33, 100, 128), (5, 64, 4)])
def test_candidates_are_the_entries_above_theta_in_id_order(T, n, cap):
    """Rows with none, some, and more than cap entries above θ (then the first cap by id and the
    full count); θ of −inf (everything finite is above it) and +inf (nothing); NaN never above."""
    g = torch.Generator().manual_seed(T * n + cap)
    x = torch.randn(T, n, generator=g)
    x[0, : min(3, n)] = float("nan")
    theta = torch.randn(T, generator=g) + 1.5
    theta[-1] = float("-inf")
    if T > 2:
        theta[1] = float("inf")
    vals = torch.full((T, cap), 123.0)
    ids = torch.full((T, cap), -5, dtype=torch.int64)
    counts = torch.full((T,), -1, dtype=torch.int64)
    _candidates()(x, theta, 4096, vals, ids, counts)
    want = _candidates_ref(x, theta, 4096, cap)
    assert torch.equal(counts, want[2]), (counts, want[2])
    assert torch.equal(ids, want[1]), (ids != want[1]).nonzero()[:5]
    assert torch.equal(vals, want[0]), (vals != want[0]).nonzero()[:5]


def test_candidates_read_strided_rows_and_empty_shapes():
    wide = torch.randn(6, 300)
    x, theta = wide[:, 7:207], torch.zeros(6)
    vals, ids, counts = torch.empty(6, 8), torch.empty(6, 8, dtype=torch.int64), torch.empty(6, dtype=torch.int64)
    _candidates()(x, theta, 0, vals, ids, counts)
    for got, want in zip((vals, ids, counts), _candidates_ref(x, theta, 0, 8)):
        assert torch.equal(got, want)
    _candidates()(torch.empty(0, 5), torch.empty(0), 0, torch.empty(0, 3), torch.empty(0, 3, dtype=torch.int64),
                  torch.empty(0, dtype=torch.int64))
    counts = torch.full((2,), 9, dtype=torch.int64)
    vals, ids = torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64)
    _candidates()(torch.empty(2, 0), torch.zeros(2), 0, vals, ids, counts)
    assert counts.tolist() == [0, 0] and (ids == PAD_ID).all() and torch.isneginf(vals).all()


@pytest.mark.parametrize("change,match", [
    (dict(x=torch.ones(2, 4, dtype=torch.float64)), "x must be Float"),
    (dict(theta=torch.ones(3)), r"theta and counts must be \[2\]"),
    (dict(ids=torch.zeros(2, 3, dtype=torch.int32)), "ids must be Long"),
    (dict(vals=torch.zeros(2, 5)), "vals and ids must be"),
    (dict(x=torch.ones(4, 2).T), "rows must be contiguous"),
    (dict(id0=2 ** 31 - 3), "below 2\\*\\*31 - 1"),
])
def test_candidates_name_bad_input(change, match):
    args = dict(x=torch.ones(2, 4), theta=torch.zeros(2), id0=0, vals=torch.zeros(2, 3),
                ids=torch.zeros(2, 3, dtype=torch.int64), counts=torch.zeros(2, dtype=torch.int64))
    args.update(change)
    with pytest.raises(RuntimeError, match=match):
        _candidates()(**args)


def test_opcheck_topk_candidates():
    x = torch.randn(5, 70)
    args = (x, torch.zeros(5), 100, torch.empty(5, 8), torch.empty(5, 8, dtype=torch.int64),
            torch.empty(5, dtype=torch.int64))
    _candidates()
    torch.library.opcheck(torch.ops.acarerank.topk_candidates.default, args)


@pytest.mark.parametrize("order", ["random", "rising", "ties"])
def test_native_core_in_fp32_is_the_torch_core_bitwise(order):
    """fp32: the native core differs from the torch core only in how a chunk's candidates are
    found, so every output is bitwise the same — random logits, logits rising with the id (more
    than k candidates per chunk: the exact chunk top-k) and integer logits (ties everywhere)."""
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
        for name in ("topk_ids", "topk_logprobs", "target_logprob", "in_topk"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (order, chunk, name)


# --------------------------------------------------------------------- linear_logprob on bf16
@needs_bf16_gemm
def test_linear_logprob_bf16_logits_come_from_the_bf16_gemm(monkeypatch):
    """bf16 policy log-probs: the forward's and the backward's logits chunks run mm_bf16_f32 (no
    fp32 copy of the weight for them), and the op keeps its rule — log-probs and entropy within
    fp32 tolerance of the fp32 oracle on the same rounded inputs, gradients within one bf16
    rounding of its gradient; under ACARERANK_CPU_BASELINE=1 (the upcast GEMM) the same."""
    from acarerank.ops import linear_logprob, linear_logprob_ref
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
    for mode in ("native", "baseline"):
        calls.clear()
        if mode == "baseline":
            monkeypatch.setenv("ACARERANK_CPU_BASELINE", "1")
        got = run(lambda *a, **kw: linear_logprob(*a, chunk=300, **kw), h0, w0)
        assert (len(calls) == 2 * 4) if mode == "native" else not calls, (mode, calls)  # 4 chunks, forward + backward
        for name, a, b, rel in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), got, ref,
                                   (1e-5, 1e-5, 2.0 ** -8, 2.0 ** -8)):
            err = (a.double() - b.double()).abs()
            bad = err > 1e-5 + rel * b.double().abs()
            assert not bad.any(), f"{mode} {name}: max err {err.max().item():.3e} at {bad.nonzero()[:3].tolist()}"
