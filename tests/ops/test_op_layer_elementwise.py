"""The decoder layer's element-wise ops (rms_norm, fused_add_rms_norm, qk_norm_rope,
silu_and_mul) on every CPU backend, against their fp32 ``*_ref`` and transformers' Qwen3 math.

Tolerances: fp32 within 2e-6 relative to the output's scale (fp32 reordering only). bf16 by
flash-attn's rule: error against the fp32 result of the same (bf16-valued) inputs at most 2x the
error of plain PyTorch bf16 (transformers' order, our "torch" backend) plus a floor of
2^-10 · max|y| (a quarter bf16 ulp at the largest output; some ops are exact in plain bf16).
The native kernels must also match the fp32-then-round-once reference to one bf16 ulp (plus
2^-16 · max|y| where a result cancels to near zero).
"""
import pytest
import torch

from _ext import NATIVE_MISSING, cpu_flags, needs_native
from acarerank.ops import BackendError
from acarerank.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_op, qk_norm_rope_ref
from acarerank.ops.rms_norm import (fused_add_rms_norm, fused_add_rms_norm_op, fused_add_rms_norm_ref, rms_norm,
                                    rms_norm_op, rms_norm_ref)
from acarerank.ops.silu_and_mul import silu_and_mul, silu_and_mul_op, silu_and_mul_ref

BACKENDS = ["torch", pytest.param("native", marks=needs_native)]
CPU_BACKENDS = ["torch"] + ([] if NATIVE_MISSING else ["native"])  # for loops inside one test
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.usefixtures("one_thread")


def _err(a, b):
    return (a.float() - b.float()).abs().max().item()


def _check(name, got, want, dtype, plain=None, truth=None):
    """fp32: got ≈ want tightly. bf16: got vs truth (fp32) within 2x plain's error + floor."""
    if got.numel() == 0:
        assert want is None or got.shape == want.shape
        return
    if dtype == torch.float32:
        scale = max(1.0, want.float().abs().max().item())
        err = _err(got, want)
        bad = ((got.float() - want.float()).abs() > 2e-6 * scale).nonzero()[:5].tolist()
        assert err <= 2e-6 * scale, f"{name}: fp32 max error {err:.3e} (scale {scale:.3e}) at {bad}"
        return
    floor = 2 ** -10 * truth.float().abs().max().item()
    e_got, e_plain = _err(got, truth), _err(plain, truth)
    assert e_got <= 2 * e_plain + floor, f"{name}: bf16 error {e_got:.3e} > 2 x plain bf16 {e_plain:.3e} + {floor:.3e}"


def _one_ulp(name, got, ref):
    """native vs the round-once reference: at most one bf16 ulp of each value (fp32 sum order and FMA
    contraction only), plus 2^-16 of the largest value for results that cancel to near zero (RoPE)."""
    if ref.numel() == 0:
        return
    tol = 2 ** -7 * ref.float().abs() + 2 ** -16 * ref.float().abs().max()
    bad = ((got.float() - ref.float()).abs() > tol).nonzero()[:5].tolist()
    assert not bad, f"{name}: more than one bf16 ulp from the reference at {bad}"


def _rand(*shape, dtype, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


def _weight(n, dtype):
    return (torch.rand(n) + 0.5).to(dtype)


# -- rms_norm / fused_add_rms_norm ----------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 97), (291, 1031), (3, 4096), (0, 128)])
def test_rms_norm_matches_reference(backend, dtype, rows, hidden):
    x, w = _rand(rows, hidden, dtype=dtype, scale=3.0), _weight(hidden, dtype)
    got = rms_norm(x, w, 1e-6, backend=backend)
    assert got.dtype == dtype and got.shape == x.shape
    truth = rms_norm_ref(x.float(), w.float(), 1e-6)
    _check("rms_norm", got, rms_norm_ref(x, w, 1e-6), dtype, rms_norm(x, w, 1e-6, backend="torch"), truth)
    if backend == "native" and dtype == torch.bfloat16:
        _one_ulp("rms_norm", got, rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (97, 769), (5, 4096)])
def test_fused_add_rms_norm_updates_residual_and_normalises_the_sum(backend, dtype, rows, hidden):
    x, res, w = _rand(rows, hidden, dtype=dtype), _rand(rows, hidden, dtype=dtype, scale=4.0), _weight(hidden, dtype)
    want_y, want_sum = fused_add_rms_norm_ref(x, res, w, 1e-6)
    plain_res = res.clone()
    plain = fused_add_rms_norm(x, plain_res, w, 1e-6, backend="torch")
    got = fused_add_rms_norm(x, res, w, 1e-6, backend=backend)
    # the sum is one correctly rounded add in either dtype: exact
    assert torch.equal(res, want_sum), f"residual sum differs by {_err(res, want_sum):.3e}"
    truth = rms_norm_ref(want_sum.float(), w.float(), 1e-6)
    _check("fused_add_rms_norm", got, want_y, dtype, plain, truth)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_of_no_rows(backend, dtype):
    """Zero rows is a legal pass (the runner's, when every segment is empty): two empty tensors
    both have a null data pointer, and the op, on either backend, and the C++ kernel took that for
    shared memory ("residual and input must not share memory")."""
    x, res, w = _rand(0, 64, dtype=dtype), _rand(0, 64, dtype=dtype), _weight(64, dtype)
    got = fused_add_rms_norm(x, res, w, 1e-6, backend=backend)
    assert got.shape == (0, 64) and got.dtype == dtype and res.shape == (0, 64)
    if backend == "native":
        from acarerank.ops.rms_norm import OP_FUSED_ADD

        assert OP_FUSED_ADD.impl("native")(x, res, w, 1e-6).shape == (0, 64)  # the kernel itself (OpsLayers' call)
    with pytest.raises(ValueError, match="must not share memory"):  # still refused where there is memory
        y = _rand(3, 64, dtype=dtype)
        fused_add_rms_norm(y, y, w, 1e-6, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps", [1e-6, 1e-2])
@pytest.mark.parametrize("scale", [0.0, 1e-3, 1e4, 1e15])
def test_rms_norm_eps_and_magnitudes(backend, eps, scale):
    """Zero rows give zeros (not NaN), eps matters for small rows, huge rows still normalise (fp32 sumsq)."""
    x, w = _rand(13, 257, dtype=torch.float32, scale=scale), _weight(257, torch.float32)
    got = rms_norm(x, w, eps, backend=backend)
    assert torch.isfinite(got).all()
    _check("rms_norm", got, rms_norm_ref(x, w, eps), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_non_contiguous_input(backend):
    x, w = _rand(200, 96, dtype=torch.bfloat16).t(), _weight(200, torch.bfloat16)  # [96, 200], strided
    got = rms_norm(x, w, 1e-6, backend=backend)
    _check("rms_norm", got, rms_norm_ref(x, w, 1e-6), torch.bfloat16, rms_norm(x, w, 1e-6, backend="torch"),
           rms_norm_ref(x.float(), w.float(), 1e-6))


def test_norms_match_transformers_qwen3_rmsnorm():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    hidden = 1031
    w32 = torch.rand(hidden) + 0.5
    hf32, hf16 = Qwen3RMSNorm(hidden, eps=1e-6), Qwen3RMSNorm(hidden, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf32.weight.copy_(w32)
        hf16.weight.copy_(w32.to(torch.bfloat16))
    x = _rand(37, hidden, dtype=torch.bfloat16, scale=2.0)
    with torch.no_grad():
        truth = Qwen3RMSNorm(hidden, eps=1e-6).requires_grad_(False)
        truth.weight.copy_(hf16.weight.float())
        truth, plain, want32 = truth(x.float()), hf16(x), hf32(x.float())
    for backend in CPU_BACKENDS:
        _check(f"{backend} vs transformers fp32", rms_norm(x.float(), w32, 1e-6, backend=backend), want32,
               torch.float32)
        got = rms_norm(x, hf16.weight.detach(), 1e-6, backend=backend)
        _check(f"{backend} vs transformers bf16", got, None, torch.bfloat16, plain, truth)
    assert torch.equal(rms_norm(x, hf16.weight.detach(), 1e-6, backend="torch"), plain), \
        "the torch backend is transformers' order, bitwise"


def test_norm_bad_inputs_name_the_problem():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"weight must be \[8\]"):
        rms_norm(x, torch.ones(7))
    with pytest.raises(TypeError, match="weight dtype"):
        rms_norm(x, torch.ones(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="residual must match"):
        fused_add_rms_norm(x, torch.zeros(4, 9), torch.ones(8))
    with pytest.raises(ValueError, match="share memory"):
        fused_add_rms_norm(x, x, torch.ones(8))
    res = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="residual and weight must not share memory"):
        fused_add_rms_norm(x, res, res[1])  # on either backend: the add would change the weight
    with pytest.raises(ValueError, match="must be contiguous"):
        fused_add_rms_norm(x, torch.zeros(8, 4).t(), torch.ones(8))
    with pytest.raises(BackendError, match="no 'cuda' backend"):
        rms_norm(x, torch.ones(8), backend="cuda")
    # a NaN or negative epsilon gives NaN rows with no error on every backend: refused first
    for eps in (float("nan"), -1e-6, float("-inf"), "1e-6"):
        with pytest.raises(ValueError, match=r"rms_norm: eps must be a finite number >= 0"):
            rms_norm(x, torch.ones(8), eps)
        with pytest.raises(ValueError, match=r"fused_add_rms_norm: eps must be a finite number >= 0"):
            fused_add_rms_norm(x, torch.zeros(4, 8), torch.ones(8), eps)


# -- qk_norm_rope -----------------------------------------------------------------------------
def _rope_tables(T, d, theta=1e6, start=0):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(start, start + T).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def _qkv_case(T, Hq, Hkv, d, dtype, scale=2.0):
    qkv = _rand(T, (Hq + 2 * Hkv) * d, dtype=dtype, scale=scale)
    return qkv, _weight(d, dtype), _weight(d, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,d", [(1, 1, 1, 2), (7, 4, 2, 64), (59, 16, 8, 128), (13, 6, 1, 96), (0, 2, 2, 8)])
def test_qk_norm_rope_matches_reference(backend, dtype, T, Hq, Hkv, d):
    qkv, qw, kw = _qkv_case(T, Hq, Hkv, d, dtype)
    cos, sin = _rope_tables(T, d, start=1000)
    got = qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, 1e-6, backend=backend)
    want = qk_norm_rope_ref(qkv, qw, kw, cos, sin, Hq, Hkv, 1e-6)
    # plain PyTorch bf16 takes the tables in the dtype (transformers casts them)
    plain = qk_norm_rope(qkv, qw, kw, cos.to(dtype), sin.to(dtype), Hq, Hkv, 1e-6, backend="torch")
    truth = qk_norm_rope_ref(qkv.float(), qw.float(), kw.float(), cos, sin, Hq, Hkv, 1e-6)
    for name, g, w_, p, t in zip("qkv", got, want, plain, truth):
        assert g.shape == w_.shape and g.dtype == dtype and g.is_contiguous()
        _check(f"qk_norm_rope {name}", g, w_, dtype, p, t)
    assert torch.equal(got[2], qkv[:, (Hq + Hkv) * d:].reshape(T, Hkv, d)), "v must be copied unchanged"
    if backend == "native" and dtype == torch.bfloat16:
        for name, g, w_ in zip("qk", got, want):
            _one_ulp(f"qk_norm_rope {name}", g, w_)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qk_norm_rope_tables_in_the_activation_dtype(backend):
    qkv, qw, kw = _qkv_case(11, 4, 2, 64, torch.bfloat16)
    cos, sin = (t.to(torch.bfloat16) for t in _rope_tables(11, 64, start=77))
    got = qk_norm_rope(qkv, qw, kw, cos, sin, 4, 2, 1e-6, backend=backend)
    truth = qk_norm_rope_ref(qkv.float(), qw.float(), kw.float(), cos.float(), sin.float(), 4, 2, 1e-6)
    plain = qk_norm_rope(qkv, qw, kw, cos, sin, 4, 2, 1e-6, backend="torch")
    for name, g, p, t in zip("qkv", got, plain, truth):
        _check(f"qk_norm_rope {name}", g, None, torch.bfloat16, p, t)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("eps,scale", [(1e-6, 1e4), (1e-2, 1e-3), (1e-6, 0.0)])
def test_qk_norm_rope_eps_and_magnitudes(backend, eps, scale):
    qkv, qw, kw = _qkv_case(9, 4, 2, 32, torch.float32, scale=scale)
    cos, sin = _rope_tables(9, 32)
    got = qk_norm_rope(qkv, qw, kw, cos, sin, 4, 2, eps, backend=backend)
    for name, g, w_ in zip("qkv", got, qk_norm_rope_ref(qkv, qw, kw, cos, sin, 4, 2, eps)):
        assert torch.isfinite(g).all()
        _check(f"qk_norm_rope {name}", g, w_, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_qk_norm_rope_non_contiguous_qkv(backend):
    Hq, Hkv, d, T = 4, 2, 16, 10
    big = _rand(T, 2 * (Hq + 2 * Hkv) * d, dtype=torch.float32)
    qkv = big[:, ::2]  # strided columns
    qw, kw = _weight(d, torch.float32), _weight(d, torch.float32)
    cos, sin = _rope_tables(T, d)
    got = qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, 1e-6, backend=backend)
    for name, g, w_ in zip("qkv", got, qk_norm_rope_ref(qkv, qw, kw, cos, sin, Hq, Hkv, 1e-6)):
        _check(f"qk_norm_rope {name}", g, w_, torch.float32)


def test_qk_norm_rope_matches_transformers_qwen3_attention_math():
    """transformers' Qwen3 order: q_norm/k_norm per head, then apply_rotary_pos_emb with its tables."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    T, Hq, Hkv, d = 23, 8, 2, 128
    qkv32, qw32, kw32 = _qkv_case(T, Hq, Hkv, d, torch.float32)
    cos32, sin32 = _rope_tables(T, d, start=4000)

    def hf(qkv, qw, kw, cos, sin):
        qn, kn = Qwen3RMSNorm(d, 1e-6).to(qkv.dtype), Qwen3RMSNorm(d, 1e-6).to(qkv.dtype)
        with torch.no_grad():
            qn.weight.copy_(qw)
            kn.weight.copy_(kw)
            q, k, v = qkv.split([Hq * d, Hkv * d, Hkv * d], -1)
            q = qn(q.view(1, T, Hq, d)).transpose(1, 2)
            k = kn(k.view(1, T, Hkv, d)).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos[None].to(qkv.dtype), sin[None].to(qkv.dtype))
            return q[0].transpose(0, 1), k[0].transpose(0, 1)

    want32 = hf(qkv32, qw32, kw32, cos32, sin32)
    qkv, qw, kw = qkv32.to(torch.bfloat16), qw32.to(torch.bfloat16), kw32.to(torch.bfloat16)
    truth = hf(qkv.float(), qw.float(), kw.float(), cos32, sin32)
    plain = hf(qkv, qw, kw, cos32, sin32)
    for backend in CPU_BACKENDS:
        got32 = qk_norm_rope(qkv32, qw32, kw32, cos32, sin32, Hq, Hkv, 1e-6, backend=backend)
        got = qk_norm_rope(qkv, qw, kw, cos32, sin32, Hq, Hkv, 1e-6, backend=backend)
        for i, name in enumerate("qk"):
            _check(f"{backend} {name} vs transformers fp32", got32[i], want32[i], torch.float32)
            _check(f"{backend} {name} vs transformers bf16", got[i], None, torch.bfloat16, plain[i], truth[i])
    bitwise = qk_norm_rope(qkv, qw, kw, cos32.to(torch.bfloat16), sin32.to(torch.bfloat16), Hq, Hkv, 1e-6,
                           backend="torch")
    assert torch.equal(bitwise[0], plain[0]) and torch.equal(bitwise[1], plain[1])


def test_qk_norm_rope_bad_inputs_name_the_problem():
    qkv, qw, kw = _qkv_case(3, 4, 2, 16, torch.float32)
    cos, sin = _rope_tables(3, 16)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 128\]"):
        qk_norm_rope(qkv[:, :-16], qw, kw, cos, sin, 4, 2)
    with pytest.raises(ValueError, match="head_dim even"):
        qk_norm_rope(qkv, qw[:15], kw[:15], cos, sin, 4, 2)
    with pytest.raises(ValueError, match=r"cos and sin must both be \[3, 16\]"):
        qk_norm_rope(qkv, qw, kw, cos[:2], sin[:2], 4, 2)
    with pytest.raises(TypeError, match="float32 or qkv's dtype"):
        qk_norm_rope(qkv.bfloat16(), qw.bfloat16(), kw.bfloat16(), cos.half(), sin.half(), 4, 2)
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        qk_norm_rope(qkv, qw, kw, cos, sin, 4, 0)
    for eps in (float("nan"), -1.0):
        with pytest.raises(ValueError, match=r"qk_norm_rope: eps must be a finite number >= 0"):
            qk_norm_rope(qkv, qw, kw, cos, sin, 4, 2, eps)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_head_dim_past_the_kernels_limit_runs_torch_by_default(dtype, monkeypatch):
    """head_dim 576 > the native kernel's 512: the CPU default is "torch" (equal to the reference);
    "native" asked for by name is a BackendError naming the limit. The default was "native", whose
    kernel raised its own RuntimeError (a d-576 model did not run)."""
    from acarerank.ops._native_backend import NATIVE_MAX_HEAD_DIM

    for d in (NATIVE_MAX_HEAD_DIM, 576):
        qkv, qw, kw = _qkv_case(5, 2, 1, d, dtype)
        cos, sin = _rope_tables(5, d, start=100)
        got = qk_norm_rope(qkv, qw, kw, cos, sin, 2, 1)
        want = qk_norm_rope_ref(qkv, qw, kw, cos, sin, 2, 1, 1e-6)
        truth = qk_norm_rope_ref(qkv.float(), qw.float(), kw.float(), cos, sin, 2, 1, 1e-6)
        for name, g, w_, t in zip("qk", got, want, truth):
            _check(f"qk_norm_rope {name}, d {d}", g, w_, dtype, w_, t)
    with pytest.raises(BackendError, match="native backend takes head_dim up to 512, got 576"):
        qk_norm_rope(qkv, qw, kw, cos, sin, 2, 1, backend="native")
    monkeypatch.setenv("ACARERANK_BACKEND", "qk_norm_rope=native")
    with pytest.raises(BackendError, match="native backend takes head_dim up to 512, got 576"):
        qk_norm_rope(qkv, qw, kw, cos, sin, 2, 1)


# -- silu_and_mul ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1), (7, 97), (97, 3072), (0, 8)])
def test_silu_and_mul_matches_reference(backend, dtype, rows, inter):
    x = _rand(rows, 2 * inter, dtype=dtype, scale=3.0)
    got = silu_and_mul(x, backend=backend)
    assert got.shape == (rows, inter) and got.dtype == dtype
    _check("silu_and_mul", got, silu_and_mul_ref(x), dtype, silu_and_mul(x, backend="torch"),
           silu_and_mul_ref(x.float()))
    if backend == "native" and dtype == torch.bfloat16:
        _one_ulp("silu_and_mul", got, silu_and_mul_ref(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_and_mul_large_magnitudes_and_strided(backend):
    g = torch.tensor([-1e30, -200.0, -88.0, -20.0, -1e-8, 0.0, 1e-8, 20.0, 88.0, 200.0, 1e30])
    x = torch.stack([torch.cat([g, torch.full_like(g, 1.5)]), torch.cat([g, -torch.ones_like(g)])])
    got = silu_and_mul(x, backend=backend)
    assert torch.isfinite(got).all(), got
    _check("silu_and_mul", got, silu_and_mul_ref(x), torch.float32)
    xs = _rand(64, 34, dtype=torch.float32).t()  # [34, 64] strided
    _check("silu_and_mul", silu_and_mul(xs, backend=backend), silu_and_mul_ref(xs), torch.float32)


def test_silu_and_mul_matches_transformers_mlp_activation():
    from transformers.activations import ACT2FN

    x = _rand(31, 2 * 300, dtype=torch.bfloat16, scale=3.0)
    act = ACT2FN["silu"]
    g, u = x.chunk(2, -1)
    truth = act(g.float()) * u.float()
    for backend in CPU_BACKENDS:
        _check("silu_and_mul vs transformers fp32", silu_and_mul(x.float(), backend=backend), truth, torch.float32)
        _check("silu_and_mul vs transformers bf16", silu_and_mul(x, backend=backend), None, torch.bfloat16,
               act(g) * u, truth)
    assert torch.equal(silu_and_mul(x, backend="torch"), act(g) * u)


def test_silu_and_mul_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.zeros(3, 5))
    with pytest.raises(TypeError, match="floating point"):
        silu_and_mul(torch.zeros(3, 4, dtype=torch.int32))


# -- native kernels directly: clear errors, threads, opcheck -------------------------------------
@needs_native
def test_native_kernels_refuse_non_contiguous_with_a_clear_error():
    from acarerank.ops import _native

    _native.load()
    ops = torch.ops.acarerank
    x = torch.randn(16, 8).t()
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.rms_norm_cpu(x, torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.silu_and_mul_cpu(x)
    with pytest.raises(RuntimeError, match="weight dtype"):
        ops.rms_norm_cpu(torch.randn(3, 4), torch.ones(4, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_and_mul_cpu(torch.zeros(2, 4, dtype=torch.float64))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_fused_add_refuses_residual_overlapping_input_or_weight(dtype):
    """The raw kernel updates residual rows in place while other rows of x are still read. It
    refused only an x starting at residual's first element: x one row behind residual (a view of
    the same buffer) was accepted and summed rows it had already overwritten (wrong y and residual,
    no error). Any overlap with x, or with the weight, is now an error; disjoint views of one
    buffer still run."""
    from acarerank.ops import _native

    _native.load()
    kern = torch.ops.acarerank.fused_add_rms_norm_cpu
    buf, w = _rand(9, 64, dtype=dtype), _weight(64, dtype)
    for x, res in ((buf[:-1], buf[1:]), (buf[1:], buf[:-1]), (buf[2:6], buf[4:8])):
        before = buf.clone()
        with pytest.raises(RuntimeError, match="residual and input must not share memory"):
            kern(x, res, w, 1e-6)
        assert torch.equal(buf, before)
    with pytest.raises(RuntimeError, match="residual and weight must not share memory"):
        kern(_rand(9, 64, dtype=dtype), buf, buf[3], 1e-6)
    x, res = buf[:4], buf[4:8]  # one buffer, no overlap: legal
    want_y, want_sum = fused_add_rms_norm_ref(x.clone(), res.clone(), w, 1e-6)
    got = kern(x, res, w, 1e-6)
    assert torch.equal(res, want_sum)
    _one_ulp("fused_add_rms_norm", got, want_y) if dtype == torch.bfloat16 else \
        _check("fused_add_rms_norm", got, want_y, dtype)


@needs_native
def test_native_rows_split_over_threads_give_the_same_bits():
    """Each row is computed by one thread with the same code: the thread count changes nothing."""
    x, res, w = _rand(997, 1024, dtype=torch.bfloat16), _rand(997, 1024, dtype=torch.bfloat16), _weight(1024, torch.bfloat16)
    qkv, qw, kw = _qkv_case(301, 8, 2, 128, torch.bfloat16)
    cos, sin = _rope_tables(301, 128)

    def run():
        r = res.clone()
        y = fused_add_rms_norm(x, r, w, backend="native")
        return [y, r, rms_norm(x, w, backend="native"), silu_and_mul(x, backend="native"),
                *qk_norm_rope(qkv, qw, kw, cos, sin, 8, 2, backend="native")]

    one = run()
    torch.set_num_threads(2)
    for a, b in zip(one, run()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_norms_compile_in_one_graph(backend):
    """docs/api.md: the layer ops behave the same under torch.compile(fullgraph=True): the public
    rms_norm and fused_add_rms_norm compiled give eager's y and updated residual, bit for bit.
    fused_add_rms_norm's overlap check read untyped_storage().data_ptr(), which dynamo cannot trace
    (fullgraph=True raised Unsupported)."""
    x, res, w = _rand(5, 32, dtype=torch.float32), _rand(5, 32, dtype=torch.float32), _weight(32, torch.float32)

    def f(x, residual, w):
        return rms_norm(x, w, backend=backend), fused_add_rms_norm(x, residual, w, backend=backend)

    want_res, got_res = res.clone(), res.clone()
    with torch.no_grad():
        want = f(x, want_res, w)
        torch._dynamo.reset()
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(x, got_res, w)
    for name, g, e in (("rms_norm", got[0], want[0]), ("fused_add_rms_norm", got[1], want[1]),
                       ("residual", got_res, want_res)):
        assert torch.equal(g, e), f"{name}: compiled differs from eager by {(g - e).abs().max():.3e}"


OPCHECK_CASES = {
    "rms_norm": lambda dt: (rms_norm_op, (_rand(5, 24, dtype=dt), _weight(24, dt), 1e-6)),
    "fused_add_rms_norm": lambda dt: (fused_add_rms_norm_op, (_rand(5, 24, dtype=dt), _rand(5, 24, dtype=dt),
                                                              _weight(24, dt), 1e-6)),
    "qk_norm_rope": lambda dt: (qk_norm_rope_op, (*_qkv_case(5, 2, 1, 16, dt), *_rope_tables(5, 16), 2, 1, 1e-6)),
    "silu_and_mul": lambda dt: (silu_and_mul_op, (_rand(5, 24, dtype=dt),)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(OPCHECK_CASES))
def test_opcheck(op, dtype, backend):
    fn, args = OPCHECK_CASES[op](dtype)
    torch.library.opcheck(fn, (*args, backend))


def _permuted(t):
    """The same values stored column-major: dense, not contiguous."""
    return t.t().contiguous().t()


#: inputs stored column-major (dense, not contiguous): the fakes say contiguous outputs, and the
#: torch backends returned outputs with the input's strides (opcheck failed; torch.compile stopped
#: on the op's output strides)
OPCHECK_PERMUTED = {
    "rms_norm": lambda dt: (rms_norm_op, (_permuted(_rand(24, 5, dtype=dt)), _weight(5, dt), 1e-6)),
    "qk_norm_rope": lambda dt: (qk_norm_rope_op, (_permuted(_qkv_case(5, 2, 1, 16, dt)[0]),
                                                  *_qkv_case(5, 2, 1, 16, dt)[1:], *_rope_tables(5, 16), 2, 1, 1e-6)),
    "silu_and_mul": lambda dt: (silu_and_mul_op, (_permuted(_rand(24, 6, dtype=dt)),)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(OPCHECK_PERMUTED))
def test_opcheck_torch_backend_with_column_major_inputs(op, dtype):
    fn, args = OPCHECK_PERMUTED[op](dtype)
    assert not args[0].is_contiguous()
    torch.library.opcheck(fn, (*args, "torch"))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", sorted(OPCHECK_CASES))
def test_opcheck_native_kernels(op, dtype):
    """The C++ ops themselves (schema, mutation of residual, the fake registered by the loader)."""
    from acarerank.ops._native_backend import native_kernel
    from acarerank.ops.qk_norm_rope import OP as ROPE
    from acarerank.ops.rms_norm import OP_FUSED_ADD, OP_RMS_NORM
    from acarerank.ops.silu_and_mul import OP as SILU

    decl = {"rms_norm": OP_RMS_NORM, "fused_add_rms_norm": OP_FUSED_ADD, "qk_norm_rope": ROPE, "silu_and_mul": SILU}[op]
    decl.impl("native")  # loads the module and registers the fake
    _, args = OPCHECK_CASES[op](dtype)
    torch.library.opcheck(native_kernel(f"{op}_cpu").default, args)




# the row kernels' builds (csrc/cpu/layer_kernels.h) and the CPU flags each needs
BUILD_FLAGS = {"avx512": {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "avx2": {"avx2", "fma"},
               "baseline": set()}


def _run_child(env_updates: dict, args: list):
    """python ``args`` in a fresh process, with the build variables only as given."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    for k in ("ACARERANK_CPU_LAYER_ISA", "ACARERANK_CPU_BASELINE"):
        env.pop(k, None)
    env.update(env_updates)
    return subprocess.run([sys.executable] + args, cwd=os.path.dirname(here), env=env, capture_output=True, text=True,
                          timeout=600)


@needs_native
@pytest.mark.parametrize("build,env", [("avx512", {"ACARERANK_CPU_LAYER_ISA": "avx512"}),
                                       ("avx2", {"ACARERANK_CPU_LAYER_ISA": "avx2"}),
                                       ("baseline", {"ACARERANK_CPU_LAYER_ISA": "baseline"}),
                                       ("baseline", {"ACARERANK_CPU_BASELINE": "1"})])
def test_every_build_of_the_kernels_matches_too(build, env):
    """Each build of the row kernels (what a CPU with AVX-512, with AVX2+FMA only, or with neither
    runs), forced in a fresh process: the child reports that build, and the reference tests of this
    file and the page-writing qk_norm_rope tests pass on it. Every build this CPU can execute runs."""
    import os

    if not BUILD_FLAGS[build] <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {build} build (needs {sorted(BUILD_FLAGS[build])})")
    here = os.path.dirname(os.path.abspath(__file__))
    # one child: it reports its build (chosen once per process) on its first line, then runs the
    # tests on that build — one interpreter start per build, not one to ask and one to test
    code = ("import sys, pytest\nfrom acarerank.ops import _native\nprint('layer build:', _native.layer_kernel_isa())\n"
            "sys.exit(pytest.main(sys.argv[1:]))")
    run = _run_child(env, ["-c", code, "-q", "-p", "no:cacheprovider", "-x", "-k",
                           "native and (matches_reference or magnitudes or non_contiguous or page_write) and not build",
                           os.path.abspath(__file__), os.path.join(here, "test_op_qk_norm_rope_pages.py")])
    assert run.stdout.splitlines()[:1] == [f"layer build: {build}"], run.stdout[:2000] + run.stderr[-2000:]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]


@needs_native
@pytest.mark.parametrize("value", ["true", "yes", " 1"])
def test_a_baseline_switch_that_is_not_0_or_1_is_an_error_naming_it(value):
    """ACARERANK_CPU_BASELINE takes 0 or 1 (or nothing): "true", "yes" or " 1" were read as off,
    silently, by the layer kernels and the attention alike (ACARERANK_CPU_AMX_TILES refused them)."""
    code = ("import torch\nfrom acarerank.ops.silu_and_mul import silu_and_mul\nfrom acarerank.ops import _native\n"
            "for run in (lambda: silu_and_mul(torch.randn(2, 8), backend='native'), _native.bf16_attention_path):\n"
            "    try:\n        run()\n    except RuntimeError as e:\n        print('ERR', e)")
    run = _run_child({"ACARERANK_CPU_BASELINE": value}, ["-c", code])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("ACARERANK_CPU_BASELINE must be 0 or 1") == 2, run.stdout


@needs_native
@pytest.mark.parametrize("value", ["avx-512", "AVX2", "none"])
def test_unknown_layer_build_is_an_error_naming_the_variable(value):
    """A value of ACARERANK_CPU_LAYER_ISA that names no build fails the first element-wise call with
    an error naming the variable and the value — never a silent fallback to some build."""
    code = ("import torch\nfrom acarerank.ops.silu_and_mul import silu_and_mul\n"
            "try:\n    silu_and_mul(torch.randn(2, 8), backend='native')\nexcept RuntimeError as e:\n    print('ERR', e)")
    run = _run_child({"ACARERANK_CPU_LAYER_ISA": value}, ["-c", code])
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ERR ACARERANK_CPU_LAYER_ISA must be auto, avx512, avx2 or baseline" in run.stdout \
        and f"'{value}'" in run.stdout, run.stdout


@needs_native
def test_a_build_this_cpu_lacks_is_an_error_naming_the_variable():
    """Asking for a build the CPU cannot run is an error naming the variable (checked with the
    widest build this CPU lacks; every x86-64 CPU runs the baseline)."""
    lacking = [b for b in ("avx512", "avx2") if not BUILD_FLAGS[b] <= cpu_flags()]
    if not lacking:
        pytest.skip("this CPU runs every build of the row kernels")
    run = _run_child({"ACARERANK_CPU_LAYER_ISA": lacking[0]},
                     ["-c", "from acarerank.ops import _native\ntry:\n    _native.layer_kernel_isa()\n"
                            "except RuntimeError as e:\n    print('ERR', e)"])
    assert f"ERR ACARERANK_CPU_LAYER_ISA={lacking[0]}, but this CPU lacks" in run.stdout, \
        run.stdout + run.stderr[-2000:]


# -- float16: the native kernels run float32 / bfloat16 only -----------------------------------
def test_float16_by_default_runs_torch_and_native_by_name_is_a_clear_error(monkeypatch):
    """A float16 model is accepted (FLOAT_DTYPES); the element-wise ops' CPU default walked to the
    native kernel anyway, which raised "activations must be float32 or bfloat16, got Half" from
    inside the first prefill. The default now walks on to "torch" for float16 (equal to what
    "torch" gives); "native" asked for by name, or by ACARERANK_BACKEND, is a BackendError
    naming the dtype."""
    monkeypatch.delenv("ACARERANK_BACKEND", raising=False)
    dt = torch.float16
    x, res, w = _rand(5, 64, dtype=dt), _rand(5, 64, dtype=dt), _weight(64, dt)
    qkv, qw, kw = _qkv_case(3, 4, 2, 16, dt)
    cos, sin = _rope_tables(3, 16, start=7)
    calls = {
        "rms_norm": lambda b: rms_norm(x, w, backend=b),
        "fused_add_rms_norm": lambda b: (fused_add_rms_norm(x, r := res.clone(), w, backend=b), r),
        "qk_norm_rope": lambda b: qk_norm_rope(qkv, qw, kw, cos.to(dt), sin.to(dt), 4, 2, 1e-6, backend=b),
        "silu_and_mul": lambda b: silu_and_mul(x, backend=b),
    }
    for name, call in calls.items():
        got, want = call(None), call("torch")
        for g, w_ in zip(got if isinstance(got, tuple) else [got], want if isinstance(want, tuple) else [want]):
            assert g.dtype == dt and torch.equal(g, w_), name
        if not NATIVE_MISSING:
            with pytest.raises(BackendError, match="float16"):
                call("native")
            monkeypatch.setenv("ACARERANK_BACKEND", "native")
            with pytest.raises(BackendError, match="float16"):
                call(None)
            monkeypatch.delenv("ACARERANK_BACKEND")


def test_float16_reranker_scores_within_the_half_precision_rule():
    """PointwiseReranker on a float16 model: error vs the fp32 model's card scores within 2x
    transformers' own float16 error + 2e-3 (the bf16 rule of tests/test_pointwise.py)."""
    from _tiny import random_qwen3
    from acarerank import PointwiseReranker
    from acarerank.prompts import joint_input_ids, official_scores
    from acarerank.tokenizer import load_qwen3_tokenizer

    tok = load_qwen3_tokenizer()
    shape = dict(spread_yes_no=20, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=32, tie=True)
    m32, m16 = random_qwen3(**shape), random_qwen3(dtype=torch.float16, **shape)
    docs = ["hello world " * 20, "", "数字 12345", "x"]
    ids = [joint_input_ids(tok, "q", d) for d in docs]
    ref32 = torch.tensor(official_scores(m32, tok, ids, batch_size=1))
    ref16 = torch.tensor(official_scores(m16, tok, ids, batch_size=1))
    ours = torch.tensor(PointwiseReranker(model=m16, tokenizer=tok).score("q", docs))
    e_ours, e_hf = (ours - ref32).abs().max().item(), (ref16 - ref32).abs().max().item()
    assert e_ours <= 2 * e_hf + 2e-3, f"float16 error {e_ours:.2e} vs transformers-float16 {e_hf:.2e}"
