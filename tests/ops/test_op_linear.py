"""The linear op (acarerank/ops/linear.py): F.linear and oneDNN on a weight reordered once.

Tolerance: both backends accumulate in fp32, so each output is within
    K · 2⁻²⁴ · (|x|·|W|ᵀ + |b|)   (fp32; the standard γ_K bound of a length-K dot product)
of the exact (fp64) value; bf16 / fp16 outputs add one rounding of the output (2⁻⁸ / 2⁻¹¹ · |y|).
The bound is per element, so a kernel that drops or doubles a term fails it.
"""
import pytest
import torch
import torch.nn.functional as F

from acarerank.ops import BackendError, PackedLinearWeight, linear, linear_ref, prepare_linear_weight
from acarerank.ops.linear import OP, linear_onednn_op, onednn_why_unavailable, resolve_linear_backend

ONEDNN_DTYPES = [d for d in (torch.float32, torch.bfloat16, torch.float16) if not onednn_why_unavailable(d)]
REFUSED_DTYPES = [d for d in (torch.bfloat16, torch.float16) if onednn_why_unavailable(d)]
OUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def _bound(x, w, b, dtype):
    """The per-element error bound of the module docstring, vs the fp64 oracle."""
    K = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T + (0 if b is None else b.double().abs())
    y = x.double() @ w.double().T + (0 if b is None else b.double())
    return 2 * K * 2.0 ** -24 * mag + OUT_ROUNDING[dtype] * y.abs()


def _check_close(got, x, w, b, what):
    # against the exact value, as the bound is stated: linear_ref's output is itself rounded to
    # x's dtype, and a bf16 result one fp32 step past a rounding tie is then a whole ulp from it
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    assert torch.equal(linear_ref(x, w, b), want.to(x.dtype)), "linear_ref is not the exact value rounded once"
    err = (got.double() - want).abs()
    bound = _bound(x, w, b, x.dtype)
    bad = (err > bound).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} elements over the bound; first at {bad[0].tolist()}: "
                              f"|diff| {err[tuple(bad[0])]:.3e} > {bound[tuple(bad[0])]:.3e}")


def _data(M, K, N, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("M,K,N", [(0, 29, 37), (1, 29, 37), (3, 61, 13), (513, 97, 131), (7, 256, 96),
                                   (17, 29, 37), (300, 61, 13), (1100, 97, 131)])
def test_onednn_matches_the_reference_and_f_linear(M, K, N, bias, dtype):
    """K and N not multiples of 8 or 16, M from 0 to past a 512-row block and 1,100; one packing per
    weight."""
    x, w, b = _data(M, K, N, dtype, bias)
    pw = prepare_linear_weight(w, "onednn")
    assert isinstance(pw, PackedLinearWeight) and pw.shape == (N, K) and pw.dtype == dtype
    got = linear(x, pw, b)
    assert got.shape == (M, N) and got.dtype == dtype
    _check_close(got, x, w, b, f"onednn M={M} K={K} N={N}")
    _check_close(F.linear(x, w, b), x, w, b, f"F.linear M={M} K={K} N={N}")  # the bound holds for it too


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
def test_onednn_takes_strided_and_batched_input(dtype):
    x, w, b = _data(40, 61, 37, dtype, True)
    pw = prepare_linear_weight(w, "onednn")
    xt = torch.randn(61, 40).to(dtype).t()            # column-major view
    xs = x[::2]                                         # every other row
    x3 = x.view(4, 10, 61)                              # leading dims
    x3t = torch.randn(3, 100, 61).to(dtype)            # leading dims, 300 rows
    for what, xi in (("transposed", xt), ("row-strided", xs), ("3-D", x3), ("3-D, 300 rows", x3t)):
        assert not xi.is_contiguous() or xi.dim() == 3
        got = linear(xi, pw, b)
        _check_close(got.reshape(-1, 37), xi.reshape(-1, 61), w, b, what)


@pytest.mark.parametrize("dtype", ONEDNN_DTYPES)
def test_onednn_takes_a_strided_or_expanded_bias(dtype):
    """oneDNN reads a bias as dense whatever its strides: b[::2] added another bias, no error, and an
    expanded one (stride 0) read past its one element (a segfault at 4M outputs)."""
    x, w, _ = _data(5, 64, 48, dtype, False)
    pw = prepare_linear_weight(w, "onednn")
    g = torch.Generator().manual_seed(1)
    for what, b in (("every other element", torch.randn(96, generator=g).to(dtype)[::2]),
                    ("expanded", torch.randn(1, generator=g).to(dtype).expand(48)),
                    ("a column", torch.randn(48, 3, generator=g).to(dtype)[:, 1])):
        assert not b.is_contiguous()
        _check_close(linear(x, pw, b), x, w, b, f"bias {what}")


def test_packing_is_once_and_lossless():
    """The packed weight is bitwise the dense one unpacked; preparing it again returns it as is."""
    _, w, _ = _data(1, 97, 131, torch.float32, False)
    pw = prepare_linear_weight(w, "onednn")
    assert torch.equal(pw.unpack(), w)
    assert prepare_linear_weight(pw, "onednn") is pw
    assert prepare_linear_weight(w, "torch") is w
    assert torch.equal(prepare_linear_weight(pw, "torch"), w)
    assert pw.nbytes == w.numel() * 4


def test_the_fp32_cpu_default_is_onednn():
    assert onednn_why_unavailable(torch.float32) == "", onednn_why_unavailable(torch.float32)
    assert resolve_linear_backend(None, "cpu", torch.float32) == ("onednn", "")
    assert OP.available("cpu")[0] == "onednn"


@pytest.mark.parametrize("dtype", REFUSED_DTYPES)
def test_a_dtype_onednn_refuses_falls_back_to_f_linear_with_the_reason(dtype):
    """Where oneDNN cannot reorder this dtype (bf16 without AVX512BW/VL/DQ or AVX_NE_CONVERT), the
    default is F.linear and the one-line reason says why; asking for onednn by name is an error."""
    why = onednn_why_unavailable(dtype)
    assert why and "\n" not in why and str(dtype) in why, why
    assert resolve_linear_backend(None, "cpu", dtype) == ("torch", why)
    with pytest.raises(BackendError, match="cannot run"):
        resolve_linear_backend("onednn", "cpu", dtype)
    with pytest.raises(BackendError, match="cannot run"):
        resolve_linear_backend({"linear": "onednn"}, "cpu", dtype)
    _, w, _ = _data(1, 29, 37, dtype, False)
    with pytest.raises(BackendError, match="cannot run"):
        prepare_linear_weight(w, "onednn")


@pytest.mark.parametrize("dtype", REFUSED_DTYPES)
def test_onednn_asked_for_by_the_environment_is_an_error_too(dtype, monkeypatch):
    monkeypatch.setenv("ACARERANK_BACKEND", "linear=onednn")
    with pytest.raises(BackendError, match="cannot run"):
        resolve_linear_backend(None, "cpu", dtype)
    # a preference given is the whole choice: one that does not name linear leaves it on its default
    # (F.linear for this dtype), the environment unread
    assert resolve_linear_backend({"attention": "torch"}, "cpu", dtype)[0] == "torch"


def test_bf16_is_refused_exactly_where_the_cpu_lacks_its_instructions():
    """oneDNN's bf16 reorder needs AVX512BW+VL+DQ or AVX_NE_CONVERT (its own error names them)."""
    from acarerank.hardware import _cpuinfo_flags

    flags = _cpuinfo_flags()
    if not flags or "avx2" not in flags:
        pytest.skip("an x86 /proc/cpuinfo is needed to tell which instructions the CPU has")
    has_bf16_path = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
    why = onednn_why_unavailable(torch.bfloat16)
    assert (why == "") == has_bf16_path, why


def test_a_preference_naming_the_op_picks_f_linear(monkeypatch):
    monkeypatch.delenv("ACARERANK_BACKEND", raising=False)
    for pref in ("torch", {"linear": "torch"}, {"gemm": "torch"}):
        assert resolve_linear_backend(pref, "cpu", torch.float32) == ("torch", ""), pref
    # a name the op lacks leaves it on its default; "onednn" by name selects it
    assert resolve_linear_backend("native", "cpu", torch.float32)[0] == "onednn"
    assert resolve_linear_backend("onednn", "cpu", torch.float32)[0] == "onednn"
    monkeypatch.setenv("ACARERANK_BACKEND", "linear=torch")
    assert resolve_linear_backend(None, "cpu", torch.float32) == ("torch", "")


def test_bad_input_is_a_clear_error():
    x, w, b = _data(3, 29, 37, torch.float32, True)
    pw = prepare_linear_weight(w, "onednn")
    for weight in (w, pw):
        with pytest.raises(ValueError, match="K = 29"):
            linear(torch.randn(3, 30), weight)
        with pytest.raises(TypeError, match="dtype torch.float64 differs"):
            linear(x.double(), weight)
        with pytest.raises(ValueError, match=r"bias must be a \[37\]"):
            linear(x, weight, torch.randn(36))
        with pytest.raises(TypeError, match="bias is torch.float64"):
            linear(x, weight, b.double())
    with pytest.raises(ValueError, match="oneDNN-packed weight on cpu"):
        linear(torch.empty(3, 29, device="meta"), pw)
    with pytest.raises(TypeError, match="PackedLinearWeight"):
        linear(x, w.tolist())
    with pytest.raises(ValueError, match="packs CPU weights"):
        PackedLinearWeight(torch.empty(37, 29, device="meta"))
    with pytest.raises(BackendError, match="no 'triton' backend"):
        prepare_linear_weight(w, "triton")


def test_the_onednn_op_is_opaque_to_torch_compile():
    """compile_layers=True: the packed weight goes through the registered op under torch.compile
    (inductor cannot lower mkldnn._linear_pointwise on an mkldnn graph input)."""
    x, w, b = _data(5, 29, 37, torch.float32, True)
    pw = prepare_linear_weight(w, "onednn")

    def f(x):
        return linear(x, pw, b) * 2

    got = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)(x)
    _check_close(got / 2, x, w, b, "compiled (aot_eager)")


def test_opcheck():
    """opcheck's AOT-dispatch checks (static and dynamic shapes: the fake kernel's shapes against the
    real op's under AOT autograd, what torch.compile uses). Its schema, autograd-registration and
    fake-tensor checks are left out: each reads every argument's storage, and the packed weight is
    an opaque mkldnn tensor with none ("Cannot access data pointer of Tensor that doesn't have
    storage"). What the schema check would catch is checked here by hand: no argument is modified
    and the output is a new tensor; the fake kernel's shape is checked under torch.compile above."""
    x, w, b = _data(5, 29, 37, torch.float32, True)
    pw = prepare_linear_weight(w, "onednn")
    for bias in (b, None):
        torch.library.opcheck(linear_onednn_op, (x, pw.packed, bias, 37),
                              test_utils=("test_aot_dispatch_static", "test_aot_dispatch_dynamic"))
    x0 = x.clone()
    out = linear_onednn_op(x, pw.packed, b, 37)
    assert torch.equal(x, x0) and torch.equal(pw.unpack(), w), "the op modified its input"
    assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
