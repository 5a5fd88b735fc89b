"""Attention-state merge (csrc/merge_states.cuh) and the flash-attn cascade glue, on CPU.

    out = (o_a·e^{lse_a} + o_b·e^{lse_b}) / (e^{lse_a} + e^{lse_b}),  lse = log(e^{lse_a} + e^{lse_b})
"""
import importlib
import math
import sys
import types

import pytest
import torch

from acarerank.ops import BackendError, available_backends
from acarerank.ops.attention import prefix_shared_attention_ref
from acarerank.ops.merge_states import merge_attention_states, merge_attention_states_ref

BACKENDS = available_backends("merge_attention_states", "cpu")  # declaring a backend tests it
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-5, rtol=1.6e-2),
       torch.float16: dict(atol=1e-5, rtol=1e-3)}


def _states(N, H, d, dtype, gen, empty_frac=0.2):
    o_a = torch.randn(N, H, d, generator=gen).to(dtype)
    o_b = torch.randn(N, H, d, generator=gen).to(dtype)
    lse_a = torch.randn(N, H, generator=gen) * 4
    lse_b = torch.randn(N, H, generator=gen) * 4
    lse_a[torch.rand(N, H, generator=gen) < empty_frac] = float("-inf")  # parts that saw no keys
    lse_b[torch.rand(N, H, generator=gen) < empty_frac] = float("-inf")
    if N * H > 1:
        lse_a.view(-1)[0] = lse_b.view(-1)[0] = float("-inf")  # both empty
    return o_a, lse_a, o_b, lse_b


def _check(got, want, dtype):
    out, lse = got
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, want[0], **TOL[dtype], msg=lambda m: f"out: {m}")
    torch.testing.assert_close(lse, want[1], atol=1e-6, rtol=1e-6, msg=lambda m: f"lse: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,H,d", [(1, 1, 1), (7, 3, 128), (59, 4, 64)])
def test_merge_matches_fp64(backend, dtype, N, H, d):
    gen = torch.Generator().manual_seed(N * 100 + d)
    st = _states(N, H, d, dtype, gen)
    _check(merge_attention_states(*st, backend=backend), merge_attention_states_ref(*st), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_and_poisoned_empty_parts(backend):
    gen = torch.Generator().manual_seed(3)
    o_a, lse_a, o_b, lse_b = _states(13, 4, 40, torch.float32, gen, empty_frac=0.3)
    o_a = torch.cat([o_a, torch.randn(13, 4, 8, generator=gen)], dim=2)[:, :, :40]  # row strides 48
    o_a[lse_a == float("-inf")] = float("nan")  # garbage where a part has no keys must not leak
    lse_b_t = lse_b.t().contiguous().t()  # flash-attn gives [H, N]; passed as its transpose view
    got = merge_attention_states(o_a, lse_a, o_b, lse_b_t, backend=backend)
    want = merge_attention_states_ref(o_a, lse_a, o_b, lse_b)
    _check(got, want, torch.float32)
    both_empty = (lse_a == float("-inf")) & (lse_b == float("-inf"))
    assert both_empty.any() and (got[0][both_empty] == 0).all() and (got[1][both_empty] == float("-inf")).all()
    assert not torch.isnan(got[0]).any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_nan_lse_makes_its_row_nan(backend):
    """A NaN lse (a part computed from NaN scores) made the torch backend's row 0 — the other
    part's finite output dropped, no error — while cpp (and CUDA, the same code) gave NaN. Every
    backend and the oracle now give NaN there, and the other rows are untouched."""
    gen = torch.Generator().manual_seed(4)
    o_a, lse_a, o_b, lse_b = _states(6, 2, 8, torch.float32, gen, empty_frac=0.0)
    lse_a[1, 0] = float("nan")                              # beside a finite lse_b
    lse_b[2, 1], lse_a[2, 1] = float("nan"), float("-inf")  # beside an empty part
    out, lse = merge_attention_states(o_a, lse_a, o_b, lse_b, backend=backend)
    want = merge_attention_states_ref(o_a, lse_a, o_b, lse_b)
    for got in ((out, lse), want):
        for n, h in ((1, 0), (2, 1)):
            assert torch.isnan(got[0][n, h]).all() and torch.isnan(got[1][n, h]), (n, h, got[0][n, h], got[1][n, h])
    finite = ~torch.isnan(lse)
    assert int(finite.sum()) == 6 * 2 - 2
    torch.testing.assert_close(out[finite], want[0][finite], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_of_split_keys_equals_full_attention(backend):
    """The formula's meaning: attention over K1 ∪ K2 from the two partial attentions."""
    gen = torch.Generator().manual_seed(4)
    N, H, d, n1, n2 = 6, 2, 16, 9, 5
    q, k, v = (torch.randn(N, H, d, generator=gen), torch.randn(n1 + n2, H, d, generator=gen),
               torch.randn(n1 + n2, H, d, generator=gen))
    s = torch.einsum("nhd,khd->nhk", q, k) / math.sqrt(d)
    full = torch.einsum("nhk,khd->nhd", s.softmax(-1), v)
    parts = []
    for sl in (slice(0, n1), slice(n1, n1 + n2)):
        parts += [torch.einsum("nhk,khd->nhd", s[..., sl].softmax(-1), v[sl]), torch.logsumexp(s[..., sl], -1)]
    out, lse = merge_attention_states(*parts, backend=backend)
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


def test_bad_input():
    o = torch.zeros(4, 2, 8)
    lse = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"o_b shape \(4, 2, 7\) differs"):
        merge_attention_states(o, lse, torch.zeros(4, 2, 7), lse)
    with pytest.raises(ValueError, match=r"lse_b must be \[4, 2\]"):
        merge_attention_states(o, lse, o, torch.zeros(2, 4))
    with pytest.raises(TypeError, match="o_b dtype torch.float16 differs"):
        merge_attention_states(o, lse, o.half(), lse)
    with pytest.raises(ValueError, match=r"\[tokens, heads, head_dim\]"):
        merge_attention_states(o[0], lse, o[0], lse)
    for backend in BACKENDS:  # head_dim 0: one error on every backend (torch returned values, cpp a C++ message)
        with pytest.raises(ValueError, match="o_a has head_dim 0; need head_dim >= 1"):
            merge_attention_states(o[..., :0], lse, o[..., :0], lse, backend=backend)
    with pytest.raises(BackendError, match="needs CUDA tensors"):
        merge_attention_states(o, lse, o, lse, backend="cuda")
    for backend in BACKENDS:  # +inf (flash-attn's "no keys") is refused by name, on every backend
        bad = lse.clone()
        bad[2, 1] = float("inf")
        with pytest.raises(ValueError, match=r"lse_b\[2, 1\] is \+inf"):
            merge_attention_states(o, lse, o, bad, backend=backend)
        with pytest.raises(ValueError, match=r"lse_a\[2, 1\] is \+inf"):
            merge_attention_states(o, bad.t().contiguous().t(), o, lse, backend=backend)
    with pytest.raises(BackendError, match="has no 'triton' backend"):
        merge_attention_states(o, lse, o, lse, backend="triton")


# ---------------------------------------------------------------- cascade glue with a stand-in flash-attn
def _fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 softmax_scale=None, causal=False, return_attn_probs=False):
    """flash-attn 2's varlen contract in plain torch: GQA, bottom-right causal mask, lse [H, total_q]
    in fp32, and for query rows with no keys out = 0, lse = +inf (what flash-attn 2 writes)."""
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert len(cq) == len(ck) and cq[-1] == q.shape[0] and ck[-1] == k.shape[0], (cq, ck, q.shape, k.shape)
    assert max_seqlen_q >= max(b - a for a, b in zip(cq, cq[1:]))
    assert max_seqlen_k >= max(b - a for a, b in zip(ck, ck[1:]))
    r = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"))
    for (qa, qb), (ka, kb) in zip(zip(cq, cq[1:]), zip(ck, ck[1:])):
        if qb == qa or kb == ka:
            continue
        s = torch.einsum("qhd,khd->hqk", q[qa:qb].float(),
                         k[ka:kb].float().repeat_interleave(r, 1)) * softmax_scale
        if causal:
            Lq, Lk = qb - qa, kb - ka
            s = s.masked_fill(torch.ones(Lq, Lk, dtype=torch.bool).triu(Lk - Lq + 1), float("-inf"))
        out[qa:qb] = torch.einsum("hqk,khd->qhd", s.softmax(-1),
                                  v[ka:kb].float().repeat_interleave(r, 1)).to(q.dtype)
        lse[:, qa:qb] = torch.logsumexp(s, -1)
    return (out, lse, None) if return_attn_probs else out


@pytest.fixture
def cascade(monkeypatch):
    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = _fake_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.delitem(sys.modules, "acarerank.ops.cascade", raising=False)
    mod = importlib.import_module("acarerank.ops.cascade")
    yield mod.prefix_shared_attention_flash_cascade
    sys.modules.pop("acarerank.ops.cascade", None)  # never leave the stand-in bound to the real module name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["sorted", "interleaved", "empty_prefix_and_segments"])
def test_cascade_glue_matches_reference(cascade, dtype, layout):
    gen = torch.Generator().manual_seed(7)
    Hq, Hkv, d = 4, 2, 32
    if layout == "sorted":
        prefix_lens, seg_lens, groups = [5, 11], [3, 4, 1, 6], [0, 0, 1, 1]
    elif layout == "interleaved":
        prefix_lens, seg_lens, groups = [7, 2, 9], [2, 5, 3, 1, 4], [2, 0, 1, 2, 0]
    else:  # group 1 has no prefix, group 2 no segments, one segment is empty
        prefix_lens, seg_lens, groups = [6, 0, 4, 3], [3, 0, 5, 2], [0, 0, 1, 3]
    T, P = sum(seg_lens), sum(prefix_lens)
    q = torch.randn(T, Hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(T, Hkv, d, generator=gen).to(dtype) for _ in range(2))
    pk, pv = (torch.randn(P, Hkv, d, generator=gen).to(dtype) for _ in range(2))
    cu_s = torch.tensor([0] + torch.tensor(seg_lens).cumsum(0).tolist(), dtype=torch.int32)
    cu_p = torch.tensor([0] + torch.tensor(prefix_lens).cumsum(0).tolist(), dtype=torch.int32)
    sg = torch.tensor(groups, dtype=torch.int32)
    got = cascade(q, k, v, cu_s, pk, pv, cu_p, sg, 1 / math.sqrt(d))
    want = prefix_shared_attention_ref(*(t.float() for t in (q, k, v)), cu_s, pk.float(), pv.float(), cu_p, sg)
    assert got.dtype == dtype and got.shape == q.shape
    # flash-attn's rule (error <= 2x plain PyTorch's in the same precision) with room for the two
    # partials that flash-attn rounds to fp16/bf16 before the merge: <= 4x. A glue bug (wrong
    # group, mask or lse) is off by O(1).
    ref_err = (prefix_shared_attention_ref(q, k, v, cu_s, pk, pv, cu_p, sg).float() - want).abs().max()
    err = (got.float() - want).abs().max()
    assert err <= 4 * ref_err + 1e-6, f"cascade error {err:.3g} > 4 x reference error {ref_err:.3g}"


def test_cascade_refuses_fp32(cascade):
    z = torch.zeros(1, 1, 8)
    i = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(BackendError, match="float16/bfloat16"):
        cascade(z, z, z, i, z, z, i, torch.zeros(1, dtype=torch.int32), 1.0)
