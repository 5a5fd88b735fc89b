"""Yes/no head of acarerank._C (csrc/yes_no.cuh) on CPU against fp64 math.

    logit_diff = rsqrt(mean(h²) + eps) · Σ h · norm_w · (w_yes − w_no);  score = sigmoid(logit_diff)
"""
import pytest
import torch

from _ext import EXT_MISSING, needs_ext

from acarerank.ops import BackendError, yes_no_score

if not EXT_MISSING:  # tests/ops/test_gpu_ext.py imports the helpers below on any machine
    from acarerank.ops import _cpp

pytestmark = needs_ext

EPS = 1e-6


def _ref64(hidden, norm_weight, w_yes, w_no, eps=EPS):
    """The formula in fp64 on the (exactly upcast) inputs."""
    h = hidden.double()
    hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    diff = hn @ w_yes.double() - hn @ w_no.double()
    return torch.sigmoid(diff).float(), diff.float()


def _inputs(S, H, dtype, gen):
    hidden = (torch.randn(S, H, generator=gen) * 5).to(dtype)
    norm_weight = 1 + 0.1 * torch.randn(H, generator=gen)
    w_yes, w_no = 0.05 * torch.randn(H, generator=gen), 0.05 * torch.randn(H, generator=gen)
    return hidden, norm_weight, w_yes, w_no


def _check(got, want):
    for name, g, w in zip(("score", "logit_diff"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape, f"{name}: {g.dtype} {tuple(g.shape)}"
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("S,H", [(1, 1), (7, 97), (13, 1024), (3, 2560)])
def test_cpp_matches_fp64(dtype, S, H):
    gen = torch.Generator().manual_seed(S * 1000 + H)
    args = _inputs(S, H, dtype, gen)
    _check(yes_no_score(*args, eps=EPS, backend="cpp"), _ref64(*args))


def test_eps_matters_for_small_states():
    """mean(h²) ~ eps: the epsilon must sit inside the rsqrt exactly as in RMSNorm."""
    gen = torch.Generator().manual_seed(9)
    hidden, nw, wy, wn = _inputs(4, 64, torch.float32, gen)
    hidden = hidden * 2e-4  # mean(h²) ~ 1e-6
    for eps in (1e-6, 1e-5):
        _check(yes_no_score(hidden, nw, wy, wn, eps=eps, backend="cpp"), _ref64(hidden, nw, wy, wn, eps))


def test_non_contiguous_and_strided_rows():
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(9, 300, generator=gen)
    hidden = wide[::2, 10:110]  # row stride 600, unit column stride
    _, nw, wy, wn = _inputs(5, 100, torch.float32, gen)
    _check(yes_no_score(hidden, nw, wy, wn, eps=EPS, backend="cpp"), _ref64(hidden, nw, wy, wn))
    ht = torch.randn(100, 5, generator=gen).t()  # column stride != 1: glue copies
    _check(yes_no_score(ht, nw, wy, wn, eps=EPS, backend="cpp"), _ref64(ht, nw, wy, wn))
    wy2 = torch.randn(200, generator=gen)[::2]  # strided weight
    _check(yes_no_score(hidden, nw, wy2, wn, eps=EPS, backend="cpp"), _ref64(hidden, nw, wy2, wn))


def test_saturation_and_empty_batch():
    H = 64
    hidden = torch.ones(2, H)
    nw = torch.ones(H)
    w_yes, w_no = torch.full((H,), 30.0), torch.zeros(H)
    w_yes[H // 2:] = -30.0
    hidden[1, : H // 2] = -1  # row 0 → diff 0; row 1 → diff −30·H
    score, diff = yes_no_score(hidden, nw, w_yes, w_no, eps=EPS, backend="cpp")
    s_ref, d_ref = _ref64(hidden, nw, w_yes, w_no)
    _check((score, diff), (s_ref, d_ref))
    assert torch.isfinite(score).all() and score[1] == 0.0
    s0, d0 = yes_no_score(torch.zeros(0, H), nw, w_yes, w_no, backend="cpp")
    assert s0.shape == d0.shape == (0,)


def test_matches_torch_backend():
    gen = torch.Generator().manual_seed(1)
    args = _inputs(11, 512, torch.float32, gen)
    got = yes_no_score(*args, eps=EPS, backend="cpp")
    want = yes_no_score(*args, eps=EPS, backend="torch")
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)  # torch backend accumulates in fp32


def test_cuda_backend_errors_on_cpu(monkeypatch):
    args = _inputs(2, 8, torch.float32, torch.Generator().manual_seed(2))
    with pytest.raises(BackendError, match="needs CUDA tensors"):
        yes_no_score(*args, backend="cuda")
    # a build without CUDA says so, whatever the tensors
    monkeypatch.setattr(_cpp._C, "has_cuda", False)
    with pytest.raises(BackendError, match="built without CUDA"):
        _cpp.yes_no_score_cuda(*args, EPS)


def test_cpp_rejects_device_tensors():
    meta = torch.zeros(2, 8, device="meta")
    with pytest.raises(BackendError, match="needs CPU tensors"):
        _cpp.yes_no_score_cpp(meta, torch.zeros(8, device="meta"), torch.zeros(8, device="meta"),
                              torch.zeros(8, device="meta"), EPS)


def test_extension_checks_raise_value_error():
    """The C++ side re-checks what could corrupt memory even when called directly."""
    with pytest.raises(ValueError, match="row_stride is smaller"):
        _cpp._C.yes_no_cpu(hidden=1, dtype=0, rows=2, H=8, row_stride=4, norm_w=1, w_yes=1, w_no=1, eps=1e-6,
                           score=1, logit_diff=1, num_threads=1)
    with pytest.raises(ValueError, match="null data pointer"):
        _cpp._C.yes_no_cpu(hidden=0, dtype=0, rows=2, H=8, row_stride=8, norm_w=1, w_yes=1, w_no=1, eps=1e-6,
                           score=1, logit_diff=1, num_threads=1)
