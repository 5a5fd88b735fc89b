"""qk_norm_rope's page write: the new k, v rows also stored at ``slots`` of a paged KV cache
([num_blocks, block_size, Hkv, d]) in the same pass, on every CPU backend.

The reference is the op without pages followed by ``index_copy_`` of its k, v into a copy of the
caches: the returned q, k, v must be bitwise those of the call without pages, the written rows
bitwise the returned k, v, every other row untouched. The returned values are held to
``qk_norm_rope_ref`` too: fp32 within 2e-6 of the scale; bf16 within one bf16 ulp of the value plus
one of its head's largest value (RoPE mixes two elements of a head, and the torch backend rounds the
normed head before it; the op's own test file holds each backend to the tighter per-backend
rules). Bad page arguments raise an error naming the problem with the caches untouched.
"""
import pytest
import torch

from _ext import needs_native
from acarerank.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_op, qk_norm_rope_ref

BACKENDS = ["torch", pytest.param("native", marks=needs_native)]
DTYPES = [torch.float32, torch.bfloat16]
pytestmark = pytest.mark.usefixtures("one_thread")


def _tables(T, d, start=0, theta=1e6):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(start, start + T).float()[:, None] * inv[None]
    emb = torch.cat([freqs, freqs], -1)
    return emb.cos(), emb.sin()


def _case(T, Hq, Hkv, d, dtype, num_blocks=None, block_size=16):
    """qkv, weights, tables, caches full of random values (so a stray write shows), scattered slots."""
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * d) * 2).to(dtype)
    qw, kw = (torch.rand(d) + 0.5).to(dtype), (torch.rand(d) + 0.5).to(dtype)
    cos, sin = _tables(T, d, start=333)
    num_blocks = num_blocks or (T // block_size + 3)
    kc = torch.randn(num_blocks, block_size, Hkv, d).to(dtype)
    vc = torch.randn(num_blocks, block_size, Hkv, d).to(dtype)
    slots = torch.randperm(num_blocks * block_size)[:T]
    return (qkv, qw, kw, cos, sin, Hq, Hkv), kc, vc, slots


def _close_to_ref(name, got, want, dtype):
    if got.numel() == 0:
        return
    g, w = got.float(), want.float()
    if dtype == torch.float32:
        tol = 2e-6 * max(1.0, w.abs().max().item())
    else:
        tol = 2 ** -7 * (w.abs() + w.abs().amax(-1, keepdim=True))
    bad = ((g - w).abs() > tol).nonzero()[:5].tolist()
    assert not bad, f"{name}: differs from qk_norm_rope_ref at {bad}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,Hq,Hkv,d", [(0, 2, 2, 64), (1, 4, 4, 64), (7, 4, 2, 128), (59, 8, 2, 64),
                                        (97, 16, 4, 128), (13, 4, 1, 64)],
                         ids=["T0", "T1-gqa1", "T7-gqa2", "T59-gqa4", "T97-gqa4-d128", "T13-mqa"])
def test_page_write_matches_index_copy_of_the_returned_rows(backend, dtype, T, Hq, Hkv, d):
    args, kc, vc, slots = _case(T, Hq, Hkv, d, dtype)
    want_k, want_v = kc.clone(), vc.clone()
    q0, k0, v0 = qk_norm_rope(*args, 1e-6, backend=backend)
    want_k.view(-1, Hkv, d).index_copy_(0, slots, k0)
    want_v.view(-1, Hkv, d).index_copy_(0, slots, v0)

    q, k, v = qk_norm_rope(*args, 1e-6, backend=backend, k_cache=kc, v_cache=vc, slots=slots)
    for name, got, want in (("q", q, q0), ("k", k, k0), ("v", v, v0)):
        assert torch.equal(got, want), f"{name} changed by the page write (max diff {(got - want).abs().max()})"
    for name, got, want in (("k_cache", kc, want_k), ("v_cache", vc, want_v)):
        wrong = (got != want).flatten(2).any(-1).nonzero()[:5].tolist()
        assert not wrong, f"{name}: (block, offset) rows differing from index_copy_ of the returned rows: {wrong}"
    for name, got, want in zip("qkv", (q, k, v), qk_norm_rope_ref(*args, 1e-6)):
        _close_to_ref(name, got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_page_write_with_tables_in_the_dtype_and_a_strided_qkv(backend):
    Hq, Hkv, d, T = 4, 2, 64, 11
    args, kc, vc, slots = _case(T, Hq, Hkv, d, torch.bfloat16)
    qkv, qw, kw, cos, sin = args[:5]
    qkv = torch.cat([qkv, qkv], 1)[:, ::2]  # the same width, strided columns
    cos, sin = cos.bfloat16(), sin.bfloat16()
    want_k, want_v = kc.clone(), vc.clone()
    _, k0, v0 = qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, backend=backend)
    want_k.view(-1, Hkv, d)[slots] = k0
    want_v.view(-1, Hkv, d)[slots] = v0
    qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, backend=backend, k_cache=kc, v_cache=vc, slots=slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


@needs_native
def test_native_page_write_is_the_same_on_two_threads():
    """Rows are split over threads; each writes its own slots: the thread count changes no bit."""
    args, kc, vc, slots = _case(301, 8, 2, 128, torch.bfloat16)
    one_k, one_v = kc.clone(), vc.clone()
    one = qk_norm_rope(*args, backend="native", k_cache=one_k, v_cache=one_v, slots=slots)
    torch.set_num_threads(2)
    two = qk_norm_rope(*args, backend="native", k_cache=kc, v_cache=vc, slots=slots)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(one_k, kc) and torch.equal(one_v, vc)


def _bad_cases(T=5, Hq=4, Hkv=2, d=16):
    """(id, page kwargs, exception type, message pattern) for a pool of 2 blocks of 4 slots."""
    kc = torch.randn(2, 4, Hkv, d)
    vc = torch.randn(2, 4, Hkv, d)
    ok = torch.tensor([6, 0, 3, 7, 1])
    yield "negative", dict(k_cache=kc, v_cache=vc, slots=torch.tensor([6, 0, -1, 7, 1])), ValueError, \
        r"slots\[2\] = -1 is outside the caches' \[0, 8\)"
    yield "too_big", dict(k_cache=kc, v_cache=vc, slots=torch.tensor([6, 0, 3, 8, 1])), ValueError, \
        r"slots\[3\] = 8 is outside the caches' \[0, 8\)"
    yield "int32", dict(k_cache=kc, v_cache=vc, slots=ok.int()), TypeError, "slots must be int64"
    yield "short", dict(k_cache=kc, v_cache=vc, slots=ok[:4]), ValueError, r"slots must be \[T\] = \[5\]"
    yield "2d", dict(k_cache=kc, v_cache=vc, slots=ok[None]), ValueError, r"slots must be \[T\] = \[5\]"
    yield "duplicate", dict(k_cache=kc, v_cache=vc, slots=torch.tensor([6, 0, 3, 0, 1])), ValueError, \
        "slot 0 appears more than once"
    yield "no_v_cache", dict(k_cache=kc, slots=ok), ValueError, "k_cache, v_cache and slots go together"
    yield "cache_dtype", dict(k_cache=kc.bfloat16(), v_cache=vc.bfloat16(), slots=ok), TypeError, \
        "k_cache/v_cache must be in qkv's dtype"
    yield "cache_heads", dict(k_cache=kc[:, :, :1], v_cache=vc[:, :, :1], slots=ok), ValueError, \
        r"k_cache must be \[num_blocks, block_size, 2, 16\]"
    yield "v_shape", dict(k_cache=kc, v_cache=vc[:1], slots=ok), ValueError, "v_cache must have k_cache's shape"
    yield "strided", dict(k_cache=kc.transpose(0, 1), v_cache=vc.transpose(0, 1), slots=ok), ValueError, \
        "must be contiguous"
    yield "same_cache", dict(k_cache=kc, v_cache=kc, slots=ok), ValueError, "must not share memory"


BAD = list(_bad_cases())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_page_arguments_name_the_problem_and_leave_the_caches_untouched(backend, case):
    _, pages, exc, pattern = case
    args = _case(5, 4, 2, 16, torch.float32)[0]
    before = {n: t.clone() for n, t in pages.items()}
    with pytest.raises(exc, match=pattern):
        qk_norm_rope(*args, backend=backend, **pages)
    for n, t in pages.items():
        assert torch.equal(t, before[n]), f"{n} was changed by a call that failed"


@needs_native
@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_native_kernel_itself_refuses_bad_pages_before_writing(case):
    """The C++ op checks again (the runner calls it directly): never an out-of-bounds write."""
    from acarerank.ops.qk_norm_rope import OP

    _, pages, _, pattern = case
    kernel = OP.impl("native")
    args = _case(5, 4, 2, 16, torch.float32)[0]
    before = {n: t.clone() for n, t in pages.items()}
    with pytest.raises(RuntimeError, match=pattern):
        kernel(*args, 1e-6, **pages)
    for n, t in pages.items():
        assert torch.equal(t, before[n]), f"{n} was changed by a call that failed"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_with_pages(backend, dtype):
    """The registered op declares the caches as mutated, and its fake traces (opcheck's checks)."""
    args, kc, vc, slots = _case(6, 2, 1, 16, dtype, num_blocks=2, block_size=8)
    torch.library.opcheck(qk_norm_rope_op, (*args, 1e-6, backend), dict(k_cache=kc, v_cache=vc, slots=slots))


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_native_kernel_with_pages(dtype):
    from acarerank.ops._native_backend import native_kernel
    from acarerank.ops.qk_norm_rope import OP

    OP.impl("native")  # loads the module and registers the fake
    args, kc, vc, slots = _case(6, 2, 1, 16, dtype, num_blocks=2, block_size=8)
    torch.library.opcheck(native_kernel("qk_norm_rope_cpu").default, (*args, 1e-6),
                          dict(k_cache=kc, v_cache=vc, slots=slots))
