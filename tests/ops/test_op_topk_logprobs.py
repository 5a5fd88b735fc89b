"""topk_logprobs (every backend that runs here) against ``topk_logprobs_ref``: materialised fp32
logits, an explicit stable sort by (value desc, id asc), log_softmax.

Exact ids need exact logits: the "dyadic" inputs (multiples of 1/4 in [-2, 2], H ≤ 64) make
every fp32 GEMM exact whatever its blocking, and their logits tie all the time, so the
tie rule (lower id first) is exercised on every row. Gaussian inputs check the same thing
where a different summation order may swap two logits within ~1e-6 of each other.
Triton runs under TRITON_INTERPRET=1 on CPU (conftest.py), on CUDA when present.
"""
import math
import warnings

import numpy as np
import pytest
import torch
from _hypothesis import given, settings, st  # hypothesis, or skips where absent

from acarerank.ops import MAX_K, BackendError, available_backends
from acarerank.ops.topk_logprobs import (finalize, order_keys, topk_logprobs, topk_logprobs_core_torch,
                                         topk_logprobs_ref)

QWEN3_V = 151669
PRIME_V = 4099
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.usefixtures("one_thread")] + (
    [pytest.mark.cuda] if DEVICE == "cuda" else [])  # the triton tests run on the GPU there
# The Triton kernel at Qwen3's vocabulary on a GPU; under the CPU interpreter (~9 s a row there)
# an odd vocabulary of the same tiling shape: many tiles per split and a ragged last tile.
TRITON_V = QWEN3_V if DEVICE == "cuda" else 20011
LP_TOL = 1e-5  # fp32 log-probs


def _dyadic(T, H, V, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-8, 9, (T, H), generator=g).float() / 4
    w = torch.randint(-8, 9, (V, H), generator=g).float() / 4
    return h.to(device, dtype), w.to(device, dtype)


def _gauss(T, H, V, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g).to(device), torch.randn(V, H, generator=g).to(device)


def _targets(h, w, k, temperature=1.0, seed=0):
    """Even rows target an id from the top-k (torch.topk's pick, so at a boundary tie it may
    fall just outside), odd rows a random id (outside the top-k unless k is close to V)."""
    T, V = h.shape[0], w.shape[0]
    logits = (h.float() @ w.float().T) / temperature
    g = torch.Generator().manual_seed(seed)
    top = logits.topk(k, dim=1).indices.cpu()
    inside = top.gather(1, torch.randint(0, k, (T, 1), generator=g)).squeeze(1)
    rand = torch.randint(0, V, (T,), generator=g)
    return torch.where(torch.arange(T) % 2 == 0, inside, rand).to(h.device)


def _check(out, ref, what, exact_ids=True):
    T, k = ref.topk_ids.shape
    assert out.topk_ids.shape == (T, k) and out.topk_ids.dtype == torch.int64, what
    assert out.topk_logprobs.dtype == out.target_logprob.dtype == torch.float32, what
    assert out.in_topk.dtype == torch.bool, what
    if exact_ids:
        bad = (out.topk_ids.cpu() != ref.topk_ids.cpu()).nonzero()
        assert bad.numel() == 0, f"{what}: {bad.shape[0]} ids differ, first (row, rank) {bad[:5].tolist()}"
        assert torch.equal(out.in_topk.cpu(), ref.in_topk.cpu()), f"{what}: in_topk differs"
    for name in ("topk_logprobs", "target_logprob"):
        a, b = getattr(out, name).cpu(), getattr(ref, name).cpu()
        # equal values (the same ±inf included) match; a NaN on either side never does (NaN > tol is False)
        err = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
        bad = (~(err <= LP_TOL)).nonzero()
        assert bad.numel() == 0, f"{what}: {name} mismatch at {bad[:5].tolist()}, max err {err.max().item():.3e}"


# --------------------------------------------------------------------- torch (chunked reference)
@pytest.mark.parametrize("T,V,k,temperature", [
    (1, QWEN3_V, 128, 1.0),
    (1, QWEN3_V, 1000, 0.7),
    (33, QWEN3_V, 128, 1.0),  # several rows at the full vocabulary (the fp64 oracle costs ~T·V)
    (257, PRIME_V, 1, 1.0),
    (257, PRIME_V, 1000, 0.5),
    (7, 769, 769, 2.0),  # k = V
])
def test_torch_exact_ids_and_logprobs(T, V, k, temperature):
    h, w = _dyadic(T, 32, V, seed=T + k)
    tg = _targets(h, w, k, temperature)
    out = topk_logprobs(h, w, tg, k=k, temperature=temperature, backend="torch")
    ref = topk_logprobs_ref(h, w, tg, k=k, temperature=temperature)
    _check(out, ref, f"torch T={T} V={V} k={k} τ={temperature}")
    if k < V and T > 1:
        assert out.in_topk.any() and not out.in_topk.all(), "test must cover targets inside and outside the top-k"


@pytest.mark.parametrize("chunk", [1, 7, 100, 769, 5000])
def test_torch_chunk_does_not_change_result(chunk):
    h, w = _dyadic(19, 24, 769, seed=3)
    tg = _targets(h, w, 16)
    _check(topk_logprobs(h, w, tg, k=16, chunk=chunk, backend="torch"), topk_logprobs_ref(h, w, tg, k=16),
           f"chunk={chunk}")


def test_torch_gaussian_near_ties():
    """Gaussian logits: values and the logprob of every returned id must be right; ids may only
    differ from the reference where the reference's neighbouring values are within 1e-6."""
    h, w = _gauss(64, 48, 10007)
    tg = _targets(h, w, 128)
    out = topk_logprobs(h, w, tg, k=128, chunk=1000, backend="torch")
    ref = topk_logprobs_ref(h, w, tg, k=128)
    _check(out, ref, "gaussian", exact_ids=False)
    full = (h @ w.T).log_softmax(1)
    lse_k = torch.logsumexp(full.gather(1, out.topk_ids), dim=1, keepdim=True)
    err = (full.gather(1, out.topk_ids) - lse_k - out.topk_logprobs).abs()
    assert err.max() < LP_TOL, f"returned ids do not carry the returned log-probs: max err {err.max():.3e}"
    sv = torch.sort(h @ w.T, dim=1, descending=True, stable=True).values[:, :129]
    near = torch.zeros_like(out.topk_ids, dtype=torch.bool)
    gap = (sv[:, :-1] - sv[:, 1:]) < 1e-6
    near[:, 1:] |= gap[:, :-1]
    near |= gap[:, :128]
    diff = out.topk_ids != ref.topk_ids
    assert not (diff & ~near).any(), f"ids differ away from near-ties at {(diff & ~near).nonzero()[:5].tolist()}"


# --------------------------------------------------------------------- outside modes, normalisation
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("outside", ["floor", "mask", "full"])
def test_outside_modes_follow_their_formulas(outside, renormalize):
    h, w = _dyadic(40, 16, PRIME_V, seed=7)
    k = 50
    tg = _targets(h, w, k)
    out = topk_logprobs(h, w, tg, k=k, outside=outside, floor=-17.5, renormalize=renormalize, backend="torch")
    _check(out, topk_logprobs_ref(h, w, tg, k=k, outside=outside, floor=-17.5, renormalize=renormalize),
           f"{outside} renorm={renormalize}")
    # independent of the reference: the formulas of the module docstring on materialised logits
    z = h @ w.T
    full = z.log_softmax(1)
    top = torch.sort(z, dim=1, descending=True, stable=True)
    top_z, top_i = top.values[:, :k], top.indices[:, :k]
    norm = torch.logsumexp(top_z, 1) if renormalize else torch.logsumexp(z, 1)
    assert torch.allclose(out.topk_logprobs, top_z - norm[:, None], atol=LP_TOL)
    if renormalize:
        assert torch.allclose(out.topk_logprobs.exp().sum(1), torch.ones(40), atol=1e-5), "truncated teacher must sum to 1"
    inside = (top_i == tg[:, None]).any(1)
    assert torch.equal(out.in_topk, inside)
    want_in = z.gather(1, tg[:, None]).squeeze(1) - norm
    want_out = {"floor": torch.full((40,), -17.5), "mask": torch.zeros(40), "full": full.gather(1, tg[:, None]).squeeze(1)}[outside]
    want = torch.where(inside, want_in, want_out)
    err = (out.target_logprob - want).abs()
    assert err.max() < LP_TOL, f"target_logprob off by {err.max():.3e} at rows {(err >= LP_TOL).nonzero().flatten()[:5].tolist()}"
    assert torch.isfinite(out.target_logprob).all(), "no mode may produce inf/NaN"


def test_floor_is_default_and_documented_value():
    h, w = _dyadic(6, 16, 769, seed=1)
    tg = _targets(h, w, 4)
    out = topk_logprobs(h, w, tg, k=4, backend="torch")
    assert torch.all(out.target_logprob[~out.in_topk] == -20.0)


def test_empty_rows_and_strided_inputs():
    h, w = _dyadic(10, 32, 769, seed=2)
    out = topk_logprobs(h[:0], w, torch.zeros(0, dtype=torch.long), k=5, backend="torch")
    assert out.topk_ids.shape == (0, 5) and out.target_logprob.shape == (0,)
    hv, wv = h[::2, ::2], w[:, ::2]  # non-contiguous views
    tg = _targets(hv, wv, 8)
    _check(topk_logprobs(hv, wv, tg, k=8, backend="torch"), topk_logprobs_ref(hv, wv, tg, k=8), "strided")


MEM_SHAPE = dict(T=1024, H=8, V=8192, k=128, C=2048)


def _exact_within_gaussian_peak(h, w, what):
    """The torch core on (h, w): exact against the oracle, and its peak extra memory at most
    1.25x that of Gaussian logits of the same shape (the documented [T, C] buffers + O(T·k))."""
    from acarerank.benchmark.measure import alloc_peak_extra

    k, C = MEM_SHAPE["k"], MEM_SHAPE["C"]
    tg = _targets(h, w, k)
    out, peak = alloc_peak_extra(lambda: topk_logprobs(h, w, tg, k=k, chunk=C, backend="torch"))
    _check(out, topk_logprobs_ref(h, w, tg, k=k), what)
    hg, wg = _gauss(*h.shape, w.shape[0])
    _, gauss = alloc_peak_extra(lambda: topk_logprobs(hg, wg, tg, k=k, chunk=C, backend="torch"))
    assert peak <= 1.25 * gauss, f"peak extra {peak / 2 ** 20:.1f} MB {what}, {gauss / 2 ** 20:.1f} MB Gaussian"


def test_torch_core_memory_with_tied_rows():
    """All-zero hidden rows (padding) make every logit 0, dyadic rows tie often: rows tied at
    the k-th place are repaired with int64 order keys, 64 rows at a time (repairing all rows at
    once took 2.2x the Gaussian peak here)."""
    T, H, V = MEM_SHAPE["T"], MEM_SHAPE["H"], MEM_SHAPE["V"]
    h, w = torch.zeros(T, H), _dyadic(1, H, V)[1]
    h[::2] = _dyadic(T // 2, H, 1, seed=3)[0]  # odd rows all-zero, even rows dyadic
    _exact_within_gaussian_peak(h, w, "tied rows")


def test_torch_core_memory_with_logits_rising_with_the_id():
    """Logits that grow with the vocabulary id put every entry of every chunk above the held k-th
    value: the chunk's candidates are then its top-k, not all C of them (a [T, C] topk, ids and a
    [T, k + C] merge with order keys took 4.9x the Gaussian peak here)."""
    T, H, V = MEM_SHAPE["T"], MEM_SHAPE["H"], MEM_SHAPE["V"]
    h, w = torch.zeros(T, H), torch.zeros(V, H)
    h[:, 0] = torch.arange(1, T + 1) / 256               # every row > 0: each row's logits rise with the id
    w[:, 0] = torch.arange(V) / 1024
    _exact_within_gaussian_peak(h, w, "rising logits")


def test_bf16_inputs_upcast_exactly():
    """bf16 hidden/weight are upcast to fp32 per chunk: equal to the fp32 oracle on the same values."""
    h, w = _dyadic(33, 32, PRIME_V, seed=4, dtype=torch.bfloat16)
    tg = _targets(h, w, 64)
    _check(topk_logprobs(h, w, tg, k=64, backend="torch"), topk_logprobs_ref(h, w, tg, k=64), "bf16")


# --------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kw,exc,msg", [
    (dict(k=0), ValueError, "k must be"),
    (dict(k=770), ValueError, "k must be"),
    (dict(k=2.0), TypeError, "k must be an int"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(outside="drop"), ValueError, "outside"),
    (dict(floor=float("-inf")), ValueError, "floor"),
    (dict(floor=True), ValueError, "floor"),
    (dict(temperature=True), ValueError, "temperature"),
    # 0 in fp32, the kernels' division: every logit inf/NaN, once blamed on hidden or weight
    (dict(temperature=1e-50), ValueError, "temperature must be a finite number > 0 \\(in float32 too\\)"),
    (dict(chunk=0), ValueError, "chunk"),
    (dict(backend="nope"), BackendError, "unknown backend"),
    # a flag is a bool: 1 or "false" (truthy) picked the top-k normalisation with no word
    (dict(renormalize=1), TypeError, "topk_logprobs: renormalize must be a bool, got int 1"),
    (dict(renormalize="false"), TypeError, "topk_logprobs: renormalize must be a bool, got str 'false'"),
])
def test_bad_arguments(kw, exc, msg):
    h, w = _dyadic(3, 16, 769)
    args = dict(k=4)
    args.update(kw)
    with pytest.raises(exc, match=msg):
        topk_logprobs(h, w, torch.zeros(3, dtype=torch.long), **args)


def test_numpy_scalars_are_numbers():
    """floor and temperature as numpy scalars (np.float32 is not a Python float) give what the
    same Python floats give; they were refused as "not a finite number"."""
    h, w = _dyadic(3, 16, 769)
    tg = _targets(h, w, 4)
    want = topk_logprobs(h, w, tg, k=4, floor=-5.0, temperature=0.5, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # np.float32 compared with a bound past its range warned at every call
        got = topk_logprobs(h, w, tg, k=4, floor=np.float32(-5), temperature=np.float32(0.5), backend="torch")
    _check(got, want, "numpy scalars")
    # a numpy bool is a flag (refused under NumPy 2, whose bool type is named "bool", not "bool_")
    for flag in (True, False):
        want = topk_logprobs(h, w, tg, k=4, renormalize=flag, backend="torch")
        _check(topk_logprobs(h, w, tg, k=4, renormalize=np.bool_(flag), backend="torch"), want, f"np.bool_({flag})")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy GEMM: intended
@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_overflow_from_a_tiny_temperature_names_the_temperature(backend):
    """τ = 1e-45 is > 0 in fp32 (a denormal) and passes the check, but every logit h·w / τ overflows:
    the error gives that cause too (it said only "inf/NaN in hidden or weight", which they are not)."""
    h, w = _dyadic(3, 16, 769)
    with pytest.raises(ValueError, match=r"non-finite logits .* h·w / temperature past fp32's range"):
        topk_logprobs(h, w, _targets(h, w, 4), k=4, temperature=1e-45, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "cpp", "triton"])
def test_numpy_integer_k_is_an_int(backend):
    """k as a numpy integer (``np.int64(4)``, what ``np.argmax`` or a config array gives) is 4, as
    every count argument of the API takes it (acarerank._validate); it was "k must be an int"."""
    h, w = _dyadic(3, 16, 769)
    tg = _targets(h, w, 4)
    want = topk_logprobs(h, w, tg, k=4, backend=backend)
    for k in (np.int64(4), np.int32(4)):
        _check(topk_logprobs(h, w, tg, k=k, backend=backend), want, f"k={k!r}")
    with pytest.raises(TypeError, match="k must be an int, got bool"):
        topk_logprobs(h, w, tg, k=np.bool_(True), backend=backend)


def test_bad_tensors():
    h, w = _dyadic(3, 16, 769)
    tg = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"hidden must be \[T, H\]"):
        topk_logprobs(h[0], w, tg)
    with pytest.raises(TypeError, match="hidden must be a tensor, got ndarray"):  # was AttributeError (backend lookup)
        topk_logprobs(h.numpy(), w, tg)
    with pytest.raises(ValueError, match="H=16 but weight has H=8"):
        topk_logprobs(h, w[:, :8], tg)
    with pytest.raises(TypeError, match="floating point"):
        topk_logprobs(h.long(), w.long(), tg)
    with pytest.raises(TypeError, match="cast one of them"):
        topk_logprobs(h, w.double(), tg)
    with pytest.raises(TypeError, match="targets must be int64"):
        topk_logprobs(h, w, tg.float())
    with pytest.raises(ValueError, match=r"targets must be \[T=3\]"):
        topk_logprobs(h, w, tg[:2])
    with pytest.raises(ValueError, match="target id 769 is out of range"):
        topk_logprobs(h, w, torch.tensor([0, 769, 1]))
    with pytest.raises(ValueError, match="target id -1 is out of range"):
        topk_logprobs(h, w, torch.tensor([0, -1, 1]))
    bad = h.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite logits .* rows \[1\]"):
        topk_logprobs(bad, w, tg, backend="torch")


def test_a_vocabulary_past_the_int32_ids_is_refused_up_front():
    """A weight of 2³¹ − 1 rows or more (an expanded, stride-0 one costs no memory): the cpp/cuda
    cores keep int32 ids and the native core's kernel takes ids below 2³¹ − 1, and refused the last
    chunk only after walking the whole vocabulary (T = 0 passed with no word). A ValueError naming
    V before any GEMM, every T."""
    w = torch.zeros(1, 16).expand(2 ** 31 - 1, 16)
    for T in (0, 3):
        for backend in ("native", "torch", "cpp"):
            with pytest.raises(ValueError, match=r"weight has V=2147483647 rows; .* V must be < 2147483647"):
                topk_logprobs(torch.zeros(T, 16), w, torch.zeros(T, dtype=torch.long), k=4, backend=backend)


def test_finalize_is_shared_and_core_contract():
    """The torch core alone: sorted (value desc, id asc), target logit, full-vocabulary lse."""
    h, w = _dyadic(9, 16, 769, seed=5)
    tg = _targets(h, w, 10)
    top_z, top_i, tz, lse = topk_logprobs_core_torch(h, w, tg, 10, 64, 1.0)
    z = h @ w.T
    srt = torch.sort(z, dim=1, descending=True, stable=True)
    assert torch.equal(top_i, srt.indices[:, :10]) and torch.equal(top_z, srt.values[:, :10])
    assert torch.equal(tz, z.gather(1, tg[:, None]).squeeze(1))
    assert torch.allclose(lse, torch.logsumexp(z, 1), atol=1e-5, rtol=0)
    _check(finalize(top_z, top_i, tz, lse, tg), topk_logprobs_ref(h, w, tg, k=10), "finalize")


# --------------------------------------------------------------------- triton (interpreter on CPU)
@pytest.mark.parametrize("T,V,k,temperature", [
    (1, TRITON_V, 128, 1.0),
    (3, TRITON_V, 1, 0.7),
    (257, PRIME_V, 128, 0.5),
    (5, PRIME_V, 500, 1.0),  # K 512: the backend's limit and its widest tiles
])
def test_triton_exact_ids_and_logprobs(T, V, k, temperature):
    h, w = _dyadic(T, 32, V, seed=11 + k, device=DEVICE)
    tg = _targets(h.cpu(), w.cpu(), k, temperature).to(DEVICE)
    out = topk_logprobs(h, w, tg, k=k, temperature=temperature, backend="triton")
    _check(out, topk_logprobs_ref(h, w, tg, k=k, temperature=temperature), f"triton T={T} V={V} k={k}")


@pytest.mark.parametrize("block_v,num_splits,k", [(64, 5, 128), (256, 3, 200), (16, 2, 1)])
def test_triton_many_tiles_and_splits(block_v, num_splits, k):
    """Force many tiles per program and several splits so both merge paths run (incl. KT < K)."""
    from acarerank.kernels.topk_logprobs import topk_logprobs_core_triton
    h, w = _dyadic(20, 40, 1531, seed=13, device=DEVICE)
    tg = _targets(h.cpu(), w.cpu(), k).to(DEVICE)
    core = topk_logprobs_core_triton(h, w, tg, k, None, 1.0, num_splits=num_splits, block_v_override=block_v)
    _check(finalize(*core, tg), topk_logprobs_ref(h, w, tg, k=k), f"triton bv={block_v} splits={num_splits}")


def test_triton_bf16_and_strided():
    h, w = _dyadic(17, 64, 2053, seed=17, device=DEVICE, dtype=torch.bfloat16)
    hv = h[:, ::2]
    wv = w[:, ::2]
    tg = _targets(hv.cpu(), wv.cpu(), 32).to(DEVICE)
    _check(topk_logprobs(hv, wv, tg, k=32, backend="triton"), topk_logprobs_ref(hv, wv, tg, k=32), "triton bf16 strided")


def test_triton_rejects_k_above_its_maximum():
    from acarerank.kernels.topk_logprobs import MAX_K
    h, w = _dyadic(2, 16, MAX_K + 5, device=DEVICE)
    with pytest.raises(ValueError, match=f"k must be <= {MAX_K} with the 'triton' backend"):
        topk_logprobs(h, w, torch.zeros(2, dtype=torch.long, device=DEVICE), k=MAX_K + 1, backend="triton")


# --------------------------------------------------------------------- cpp (csrc merge), if built
@pytest.mark.parametrize("T,V,k,temperature", [(33, QWEN3_V, 128, 1.0), (257, PRIME_V, 128, 1.0),
                                                (5, PRIME_V, 1000, 0.7), (7, 769, 769, 1.0)])
def test_cpp_exact_ids_and_logprobs(T, V, k, temperature):
    pytest.importorskip("acarerank._C")
    h, w = _dyadic(T, 32, V, seed=T + 1)
    tg = _targets(h, w, k, temperature)
    out = topk_logprobs(h, w, tg, k=k, temperature=temperature, backend="cpp")
    _check(out, topk_logprobs_ref(h, w, tg, k=k, temperature=temperature), f"cpp T={T} V={V} k={k}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_backends_match_torch_backend(backend):
    h, w = _dyadic(257, 64, QWEN3_V, seed=21, device="cuda")
    tg = _targets(h.cpu(), w.cpu(), 128).cuda()
    out = topk_logprobs(h, w, tg, k=128, backend=backend)
    _check(out, topk_logprobs(h.cpu(), w.cpu(), tg.cpu(), k=128, backend="torch"), f"{backend} vs torch")
    assert math.isfinite(out.target_logprob.sum().item())


# --------------------------------------------------------------------- the order key itself
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(width=32, allow_nan=False), st.integers(0, 2 ** 31 - 1)),
                min_size=1, max_size=40, unique_by=lambda t: t[1]))
def test_order_keys_sort_like_value_desc_id_asc(pairs):
    """Sorting by the int64 key equals sorting by (value desc, id asc), with −0.0 == +0.0."""
    vals = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    ids = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    by_key = ids[order_keys(vals, ids).argsort(descending=True)].tolist()
    want = [i for _, i in sorted(((float(v), int(i)) for v, i in zip(vals, ids)), key=lambda t: (-t[0], t[1]))]
    assert by_key == want


def test_core_is_a_checked_custom_op():
    """torch.ops.acarerank.topk_logprobs_core: schema, fake tensor and AOT dispatch pass opcheck."""
    import acarerank.ops  # importing the package registers torch.ops.acarerank.*
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(5, 16, generator=g), torch.randn(97, 16, generator=g)
    t = torch.randint(0, 97, (5,), generator=g)
    torch.library.opcheck(torch.ops.acarerank.topk_logprobs_core.default, (h, w, t, 4, 0, 1.0, "torch"))
    got = torch.ops.acarerank.topk_logprobs_core(h, w, t, 4, 0, 1.0, "torch")
    ref = topk_logprobs_ref(h, w, t, k=4)
    assert torch.equal(got[1], ref.topk_ids), (got[1], ref.topk_ids)


# --------------------------------------------------------------------- every backend, its k limit
BACKENDS = available_backends("topk_logprobs", DEVICE)  # declaring a backend tests it


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_exact_on_dyadic_inputs(backend):
    h, w = _dyadic(19, 32, 1543, seed=8, device=DEVICE)
    tg = _targets(h.cpu(), w.cpu(), 32).to(DEVICE)
    for outside, renorm in (("floor", True), ("full", False)):
        got = topk_logprobs(h, w, tg, k=32, outside=outside, renormalize=renorm, temperature=0.5, backend=backend)
        want = topk_logprobs_ref(h, w, tg, k=32, outside=outside, renormalize=renorm, temperature=0.5)
        _check(got, want, f"{backend} outside={outside} renormalize={renorm}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_takes_a_hidden_size_of_zero(backend, dtype):
    """H = 0: every logit 0, every log-prob log(1/V) (the oracle's answer). The native core's fused
    bf16 kernel divided by H sizing its blocks: SIGFPE, the process gone."""
    h, w = torch.zeros(3, 0, dtype=dtype, device=DEVICE), torch.zeros(64, 0, dtype=dtype, device=DEVICE)
    tg = torch.tensor([3, 40, 63], device=DEVICE)
    got = topk_logprobs(h, w, tg, k=4, outside="full", renormalize=False, chunk=16, backend=backend)
    _check(got, topk_logprobs_ref(h, w, tg, k=4, outside="full", renormalize=False), f"{backend} {dtype} H=0")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_keeps_fp32_math_under_autocast(backend, dtype):
    """A teacher scored inside ``torch.autocast`` (a training loop's forward): the result is the
    one outside it. The cpp/cuda cores' chunk GEMM once ran in bf16 there (other ids, log-probs
    off by ~0.05, no error)."""
    h, w = _dyadic(19, 32, 1543, seed=9, device=DEVICE, dtype=dtype)
    tg = _targets(h.cpu(), w.cpu(), 32).to(DEVICE)
    want = topk_logprobs_ref(h, w, tg, k=32, temperature=0.5)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got = topk_logprobs(h, w, tg, k=32, temperature=0.5, backend=backend)
    _check(got, want, f"{backend} {dtype} under autocast")


def _overflowing_head(V, n_inf, seed):
    """Dyadic inputs whose logits of ids [0, n_inf) overflow fp32 to −inf in every row (finite
    weights, products beyond fp32: docs/input-safety.md), the rest finite; targets among the rest."""
    h, w = _dyadic(9, 32, V, seed=seed)
    h[:, 0] = 2.0
    w[:n_inf, 0] = -3e38  # 2 · −3e38 < −3.4e38
    tg = torch.randint(n_inf, V, (9,), generator=torch.Generator().manual_seed(seed))
    return h.to(DEVICE), w.to(DEVICE), tg.to(DEVICE)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy GEMM: intended
@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_overflowed_logits_do_not_depend_on_chunks(backend):
    """A row whose first chunks (tiles, splits) hold only −inf logits: the log-sum-exp is that of
    the finite rest, whatever the chunking. It was −inf − (−inf) = NaN in the torch and Triton
    cores, a "non-finite logits" error at chunk=64 and the right value at chunk=2048."""
    h, w, tg = _overflowing_head(1531, 1024, seed=21)
    want = topk_logprobs_ref(h, w, tg, k=16, outside="full", renormalize=False)
    assert torch.isfinite(want.target_logprob).all()  # the test's premise
    if backend == "triton":
        from acarerank.kernels.topk_logprobs import topk_logprobs_core_triton
        # 64-wide tiles, 3 splits: the first two splits see only −inf (the merge kernel's case too)
        core = topk_logprobs_core_triton(h, w, tg, 16, None, 1.0, num_splits=3, block_v_override=64)
        got = finalize(*core, tg, outside="full", renormalize=False)
    else:
        got = topk_logprobs(h, w, tg, k=16, chunk=64, outside="full", renormalize=False, backend=backend)
    assert torch.isfinite(got.target_logprob).all() and torch.isfinite(got.topk_logprobs).all(), got  # _check: NaN ok
    _check(got, want, f"{backend}, ids [0, 1024) overflowing")


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_limit_of_every_backend_is_enforced_by_name(backend):
    limit = MAX_K[backend]
    if limit is None:  # torch: any k <= V
        h, w = _dyadic(2, 16, 37, device=DEVICE)
        assert topk_logprobs(h, w, torch.zeros(2, dtype=torch.long, device=DEVICE), k=37, backend=backend).topk_ids.shape == (2, 37)
        return
    h, w = _dyadic(2, 16, limit + 3, device=DEVICE)
    with pytest.raises(ValueError, match=f"k must be <= {limit} with the '{backend}' backend, got k={limit + 1}"):
        topk_logprobs(h, w, torch.zeros(2, dtype=torch.long, device=DEVICE), k=limit + 1, backend=backend)


def test_triton_launch_constants_do_not_depend_on_T(monkeypatch):
    """Every constexpr of the two Triton launches is the same for T = 3 and T = 70 (one compile)."""
    import acarerank.kernels.topk_logprobs as K
    seen = []

    class Recorder:
        def __init__(self, real):
            self.real = real

        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(tuple(sorted((n, v) for n, v in kw.items() if n != "NSPLIT")))
                return self.real[grid](*args, **kw)
            return launch
    monkeypatch.setattr(K, "triton_interpreted", lambda kernel=None: True)
    for name in ("_topk_tiles_kernel", "_topk_merge_kernel"):
        monkeypatch.setattr(K, name, Recorder(getattr(K, name)))
    for T in (3, 70):
        h, w = _dyadic(T, 16, 300, device=DEVICE)
        K.topk_logprobs_core_triton(h, w, torch.zeros(T, dtype=torch.long, device=DEVICE), 8, None, 1.0)
    assert seen[0] == seen[2] and seen[1] == seen[3], seen


def test_fp32_positivity_interval_is_the_rounding_rule():
    """positive_in_fp32 is two comparisons (torch.compile traces them on a SymFloat temperature);
    on the interval's edges and around them it agrees with rounding to fp32 (struct) itself."""
    import math

    from acarerank.ops._checks import FP32_POSITIVE, as_fp32, positive_in_fp32

    def by_rounding(x):
        s = as_fp32(float(x))
        return math.isfinite(s) and s > 0

    edges = [e for b in FP32_POSITIVE for e in (math.nextafter(b, 0), b, math.nextafter(b, math.inf))]
    others = [0.0, -0.0, -1.0, 1e-50, 1e-45, 1.0, 3.4028234663852886e38, 1e39, math.inf, -math.inf, math.nan]
    values = edges + others + [10.0 ** (e / 7) for e in range(-7 * 46, 7 * 39)]
    wrong = [x for x in values if positive_in_fp32(x) != by_rounding(x)]
    assert not wrong, f"positive_in_fp32 disagrees with fp32 rounding at {wrong[:5]}"


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "torch"])
def test_a_backend_first_used_in_compiled_code(backend, monkeypatch):
    """A training step compiled with fullgraph=True that is the first to ask for a lazily loaded
    backend (cpp / cuda / triton; "cuda" is the CUDA default): the choice is made while Dynamo
    traces, as a constant of the graph. It imported the backend inside the trace, which Dynamo
    cannot follow (importlib.import_module: a graph break, an error under fullgraph=True).
    A backend that cannot run is still the BackendError, from the eager fallback without
    fullgraph."""
    from acarerank.ops.topk_logprobs import OP
    monkeypatch.setattr(OP, "_loaded", {})   # as in a fresh process: nothing loaded yet
    h, w = _dyadic(5, 16, 97, device=DEVICE)
    tg = _targets(h, w, 4)
    step = torch.compile(lambda h, w, tg: topk_logprobs(h, w, tg, k=4, backend=backend), backend="aot_eager",
                         fullgraph=True)
    _check(step(h, w, tg), topk_logprobs_ref(h, w, tg, k=4), f"{backend}, compiled")
    other = "cuda" if DEVICE == "cpu" else "cpp"
    with pytest.raises(BackendError, match=f"backend '{other}' needs .* tensors"):
        torch.compile(lambda h, w, tg: topk_logprobs(h, w, tg, k=4, backend=other), backend="aot_eager")(h, w, tg)
