"""The native CPU attention kernel (csrc/cpu/prefix_attention.cpp, ``cpu_attention.py``) against
the plain fp32 oracle, through both ops and through ``torch.ops.acarerank.prefix_shared_attention_cpu``.

fp32: ≤ 1e-5 against ``prefix_shared_attention_ref``. bf16/fp16: flash-attn's rule — kernel error
≤ 2× the error of plain PyTorch attention in the same dtype (+ twice fp32's rounding step near the
outputs), both against the fp32 oracle on the same low-precision values. Shapes: prime lengths,
prefixes and segments longer than one key tile (``TILE_KEYS``) and one row block, empty prefixes and
segments, one-token segments, GQA 1/2/4/8, head_dim 64/128 (and an odd one), pages of 16..256
tokens at scattered ids, non-contiguous q.
"""
import math
import os

import pytest
import torch

from _ext import cpu_flags, needs_native
from acarerank.ops import (prefix_shared_attention, prefix_shared_attention_paged, prefix_shared_attention_ref)
from acarerank.ops.cpu_attention import TILE_KEYS as KT

pytestmark = needs_native
_AVX512_BF16 = {"avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"}  # the direct path's CPU


def _kernel():
    from acarerank.ops import cpu_attention

    return cpu_attention.kernel()


def make(seg_lens, prefix_lens, groups, Hq, Hkv, d, block_size=16, dtype=torch.float32, seed=0, *, spare=3,
         share=(), unused=None):
    """(paged args, packed args): pages at shuffled ids with garbage spare pages between groups.

    spare: pages no group is given (beside the pool's used ones); share: (g, h, n) triples — group
    g's first n blocks are group h's (a shared prefix, as the prefix cache hands out; n at most
    h's full blocks and g's blocks); unused: a value (e.g. NaN) written into every page slot no
    group reads (spare pages, pages freed by sharing, the tail of a group's last block), so any
    read of one shows in the output.
    """
    g = torch.Generator().manual_seed(seed)
    G = len(prefix_lens)
    nblk = [-(-p // block_size) for p in prefix_lens]
    num_blocks = sum(nblk) + spare
    perm = torch.randperm(num_blocks, generator=g).tolist()
    bt = torch.full((G, max(nblk + [1]) + 1), -1, dtype=torch.int32)
    i = 0
    for gi, n in enumerate(nblk):
        bt[gi, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    for gi, h, n in share:
        assert n <= min(prefix_lens[h] // block_size, nblk[gi]), f"group {gi} cannot share {n} blocks of group {h}"
        bt[gi, :n] = bt[h, :n]
    kc = torch.randn(num_blocks, block_size, Hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, Hkv, d, generator=g).to(dtype)
    rows = [(int(bt[gi, c // block_size]), c % block_size) for gi in range(G) for c in range(prefix_lens[gi])]
    if unused is not None:
        read = torch.zeros(num_blocks, block_size, dtype=torch.bool)
        for b, s in rows:
            read[b, s] = True
        kc[~read] = unused
        vc[~read] = unused
    pk = torch.stack([kc[b, s] for b, s in rows]) if rows else kc.new_empty(0, Hkv, d)
    pv = torch.stack([vc[b, s] for b, s in rows]) if rows else vc.new_empty(0, Hkv, d)
    T = sum(seg_lens)
    q = torch.randn(T, Hq, d, generator=g).to(dtype)
    k = torch.randn(T, Hkv, d, generator=g).to(dtype)
    v = torch.randn(T, Hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(seg_lens).cumsum(0).tolist(), dtype=torch.int32)
    sg = torch.tensor(groups, dtype=torch.int32)
    pl = torch.tensor(prefix_lens, dtype=torch.int32)
    cp = torch.tensor([0] + torch.tensor(prefix_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q, k, v, cu, kc, vc, bt, pl, sg), (q, k, v, cu, pk, pv, cp, sg)


def ref32(packed, scale=None):
    f = [t.float() if t.is_floating_point() else t for t in packed]
    return prefix_shared_attention_ref(*f, softmax_scale=scale)


def nan_rows_differ(fn) -> bool:
    """Whether ``fn`` (torch.ops.acarerank.prefix_shared_attention_cpu of some build) puts NaN where
    the fp32 oracle does not, or not where it does, for one NaN in q (bf16, scattered pages): the
    check the child builds of the kernel (vnni, emulated AMX) share."""
    paged, packed = make([5, 1, 9], [37, 70], [0, 1, 1], 8, 2, 64, 16, dtype=torch.bfloat16)
    paged[0][3, 5, 7] = float("nan")
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    out = fn(q, k, v, cu, kc, vc, bt, packed[6], sg, 0.125).float()
    return not torch.equal(torch.isnan(out), torch.isnan(ref32(packed)))


def plain(packed, scale):
    """Plain PyTorch attention entirely in q's dtype: the low-precision baseline of the 2x rule."""
    q, k, v, cu, pk, pv, cp, sg = packed
    out = torch.zeros_like(q)
    r = q.shape[1] // k.shape[1]
    for s, g in enumerate(sg.tolist()):
        a, b = int(cu[s]), int(cu[s + 1])
        if a == b:
            continue
        P = int(cp[g + 1] - cp[g])
        keys = torch.cat([pk[cp[g]:cp[g + 1]], k[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        vals = torch.cat([pv[cp[g]:cp[g + 1]], v[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        mask = torch.ones(b - a, P + b - a, dtype=torch.bool).tril(diagonal=P)
        probs = ((q[a:b].transpose(0, 1) @ keys.transpose(1, 2)) * scale).masked_fill(~mask, float("-inf")).softmax(-1)
        out[a:b] = (probs @ vals).transpose(0, 1)
    return out


def report(a, b):
    diff = (a.float() - b.float()).abs().nan_to_num(float("inf"))
    i = int(diff.flatten().argmax())
    T, H, d = a.shape
    return f"max |diff| {diff.max().item():.3g} at (token {i // (H * d)}, head {i // d % H}, dim {i % d})"


# seg_lens, prefix_lens, groups, Hq, Hkv, d, block_size
CASES = [
    pytest.param([1, 7, 59, 97], [1, 63, KT + 44], [0, 1, 2, 1], 1, 1, 64, 16, id="gqa1-d64-bs16"),
    pytest.param([97, 1, 7], [63, 1], [0, 1, 1], 8, 4, 128, 32, id="gqa2-d128-bs32"),
    pytest.param([59, 0, 13, 1], [3 * KT + 1, 0], [0, 1, 1, 0], 8, 2, 64, 64, id="gqa4-long-prefix-empty"),
    pytest.param([KT + 44, 5, 2], [KT + 1, 17], [1, 0, 1], 16, 2, 128, 256, id="gqa8-own-over-a-tile"),
    pytest.param([1, 1, 1], [40, 0, 41], [0, 1, 2], 4, 1, 64, 16, id="decode-gqa4"),
    pytest.param([0, 0, 4], [0, 0], [0, 1, 1], 2, 2, 64, 16, id="no-prefix"),
    pytest.param([33, 9], [70, 5], [1, 0], 6, 3, 80, 128, id="gqa2-d80"),
    # groups of one row block (their prefix packed by the task) beside one of three (shared pack)
    pytest.param([1, 2, KT + 44, 1, 3], [5, 1, KT + 34, 0, KT + 1], [0, 1, 2, 3, 4], 4, 2, 64, 16,
                 id="one-and-many-block-groups"),
]
# groups of several row blocks whose prefix or segment is shorter than KT / 2 keys (packed by each task,
# not into a shared buffer of whole tiles) beside ones just long enough to share (KT / 2 + 1: 2x padding)
PAD_CASES = [
    pytest.param([129, 7, KT // 2 + 1, 129], [8, KT // 2 + 1, KT + 1], [0, 0, 1, 2], 8, 4, 128, 16,
                 id="gqa2-segments-of-a-row-block-plus-1"),
    pytest.param([33, 100, 1], [3, 200], [0, 1, 1], 16, 2, 128, 32, id="gqa8-short-prefix-many-blocks"),
]
CASES += PAD_CASES


@pytest.mark.parametrize("seg_lens,prefix_lens,groups,Hq,Hkv,d,bs", CASES)
def test_fp32_paged_and_packed_equal_the_oracle(seg_lens, prefix_lens, groups, Hq, Hkv, d, bs):
    paged, packed = make(seg_lens, prefix_lens, groups, Hq, Hkv, d, bs)
    ref = ref32(packed)
    out = prefix_shared_attention_paged(*paged, backend="native")
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert (out - ref).abs().max().item() <= 1e-5, "paged: " + report(out, ref)
    out = prefix_shared_attention(*packed, backend="native")
    assert (out - ref).abs().max().item() <= 1e-5, "packed: " + report(out, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seg_lens,prefix_lens,groups,Hq,Hkv,d,bs", CASES[:4] + PAD_CASES)
def test_half_precision_flash_attn_rule(seg_lens, prefix_lens, groups, Hq, Hkv, d, bs, dtype):
    paged, packed = make(seg_lens, prefix_lens, groups, Hq, Hkv, d, bs, dtype=dtype)
    ref = ref32(packed)
    base = plain(packed, 1.0 / math.sqrt(d))
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    err_plain = (base.float() - ref).abs().max().item()
    for name, out in (("paged", prefix_shared_attention_paged(*paged, backend="native")),
                      ("packed", prefix_shared_attention(*packed, backend="native"))):
        assert out.dtype == dtype
        err = (out.float() - ref).abs().max().item()
        assert err <= 2 * err_plain + atol, f"{name} {dtype}: kernel err {err:.3e} > 2 x plain {err_plain:.3e} + {atol:.1e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_q_makes_exactly_its_row_nan(dtype):
    paged, packed = make([5, 1, 9], [37, 70], [0, 1, 1], 8, 2, 64, 16, dtype=dtype)
    paged[0][3, 5, 7] = float("nan")
    paged[0][5, 0, 0] = float("nan")   # the one-token segment of group 1
    ref = ref32(packed)
    out = prefix_shared_attention_paged(*paged, backend="native").float()
    nan = torch.isnan(ref)
    assert nan[3, 5].all() and nan[5, 0].all() and nan.sum() == 2 * 64
    assert torch.equal(torch.isnan(out), nan), f"NaN rows differ: {torch.nonzero(torch.isnan(out) != nan)[:5]}"
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(out[~nan], ref[~nan], atol=tol, rtol=tol), report(out.nan_to_num(), ref.nan_to_num())


def test_nan_value_reaches_only_the_rows_that_see_it():
    """A NaN in an own value row j makes NaN exactly the rows that see it (tokens j.. of its segment,
    the query heads of its kv head); rows causally before j equal the oracle on NaN-free data (as
    the oracle's own do since 2026-12-07: it multiplied the masked NaN by a zero weight, spreading
    it to every row of the segment)."""
    paged, packed = make([20, 6], [37, 10], [0, 1], 4, 2, 64, 16)
    ref = ref32(packed)
    paged[2][8, 1, 3] = float("nan")   # v of token 8 (segment 0), kv head 1 = query heads 2, 3
    out = prefix_shared_attention_paged(*paged, backend="native")
    sees = torch.zeros(out.shape[:2], dtype=torch.bool)
    sees[8:20, 2:4] = True
    assert torch.equal(torch.isnan(out).any(-1), sees), f"NaN rows: {torch.nonzero(torch.isnan(out).any(-1))[:6]}"
    assert torch.isnan(out[sees][:, 3]).all() and not torch.isnan(out[sees][:, :3]).any()  # only that dim
    assert (out[~sees] - ref[~sees]).abs().max().item() <= 1e-5
    v = packed[2].clone()
    v[8, 1, 3] = float("nan")
    nan_ref = ref32((*packed[:2], v, *packed[3:]))
    assert torch.equal(torch.isnan(nan_ref).any(-1), sees), "the oracle's NaN rows differ from the kernel's"
    out_torch = prefix_shared_attention_paged(*paged, backend="torch")   # the paged op's fallback
    assert torch.equal(torch.isnan(out_torch).any(-1), sees), "the torch backend's NaN rows differ from the kernel's"


def _finite_and_within_the_rule(paged, packed, dtype, d=64):
    """Native paged and packed outputs of a case whose oracle is finite: no NaN row, and within the
    suite's rule (fp32: 1e-5 of the oracle; bf16: flash-attn's, 2x plain bf16 PyTorch's error)."""
    ref = ref32(packed)
    assert torch.isfinite(ref).all()
    base = plain(packed, 1.0 / math.sqrt(d))
    bound = 1e-5 if dtype == torch.float32 else \
        2 * (base.float() - ref).abs().max().item() + 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    for name, out in (("paged", prefix_shared_attention_paged(*paged, backend="native")),
                      ("packed", prefix_shared_attention(*packed, backend="native"))):
        assert not torch.isnan(out).any(), f"{name}: NaN rows {torch.nonzero(torch.isnan(out).any(-1))[:6].tolist()}"
        assert (out.float() - ref).abs().max().item() <= bound, f"{name}: " + report(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_scoring_minus_inf_first_gets_weight_zero_not_nan(dtype):
    """A key whose score is −inf (a −inf in K against a positive q) gets softmax weight 0: the
    oracle and plain PyTorch stay finite. When such keys were all a row had seen so far (here the
    whole one-key prefix, so the first softmax step), the online softmax computed −inf − (−inf):
    the row came out NaN. Group 0 (one token) runs the direct path, group 1 (40 tokens × 4 query
    heads) the tiles; the rule of the suite holds on both, and no row is NaN."""
    paged, packed = make([1, 40], [1, 1], [0, 1], 4, 2, 64, 16, dtype=dtype)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    q.abs_()
    for g in (0, 1):
        kc[int(bt[g, 0]), 0, :, 5] = float("-inf")  # prefix key 0 of each group, both kv heads
    pk = packed[4].clone()
    pk[:, :, 5] = float("-inf")
    packed = (q, k, v, cu, pk, *packed[5:])
    _finite_and_within_the_rule(paged, packed, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_finite_scores_give_the_finite_softmax(dtype):
    """Scores of ~1e15 (a q dimension of 1e15: finite inputs) have a finite softmax, the oracle's and
    plain PyTorch's. The kernels formed the exponent as s·c − m·c with m·c rounded first, off by up
    to half its ulp (~4e6 at these sizes): 2^t overflowed and every row came out NaN. Group 0 (one
    token) runs the direct path, group 1 (40 tokens × 4 query heads) the tiles."""
    paged, packed = make([1, 40], [23, 70], [0, 1], 4, 2, 64, 16, dtype=dtype)
    q = paged[0]
    q[..., 0] = 1e15
    _finite_and_within_the_rule(paged, packed, dtype)


def test_large_scores_either_side_of_the_one_fma_exponent():
    """The bf16 tiles form a weight's exponent as one FMA, s·c − (m·c − 1/2), while |m·c| < 128
    (c = scale·log2 e, m the row's running max), and the difference first above that (attn_tiles.h,
    RowMax). q rows scaled from 1x to ~300x put the rows' largest scaled scores on both sides of that
    line (~4 to ~1,500): no row NaN, every row within the rule, prefix and own tiles alike."""
    paged, packed = make([40, 97], [70, KT + 44], [0, 1], 4, 2, 64, 16, dtype=torch.bfloat16)
    q = paged[0]
    q.mul_(torch.logspace(0, 2.5, q.shape[0])[:, None, None].to(q.dtype))
    _finite_and_within_the_rule(paged, packed, torch.bfloat16)


def test_non_contiguous_q_and_strided_pool():
    paged, packed = make([7, 59], [63, KT + 44], [0, 1], 4, 2, 64, 32)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    qs = torch.randn(q.shape[0], q.shape[1] * 2, q.shape[2])[:, ::2]      # head stride 2·d
    qs.copy_(q)
    big_k = torch.stack([kc, kc.neg()], dim=1)[:, 0]                       # block stride ≠ block_size rows
    big_v = torch.stack([vc, vc.neg()], dim=1)[:, 0]
    assert not qs.is_contiguous() and not big_k.is_contiguous()
    ref = ref32(packed)
    out = prefix_shared_attention_paged(qs, k, v, cu, big_k, big_v, bt, pl, sg, backend="native")
    assert (out - ref).abs().max().item() <= 1e-5, report(out, ref)
    qd = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[:, :, ::2]   # head_dim stride 2: copied once
    qd.copy_(q)
    out = prefix_shared_attention(qd, *packed[1:], backend="native")
    assert (out - ref).abs().max().item() <= 1e-5, report(out, ref)


def _unit_head_dim_odd_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` [..., 1] as a tensor torch calls contiguous whose last (size-1) dim has a stride ≠ 1."""
    c = t.contiguous()
    odd = c.as_strided(c.shape, (*c.stride()[:-1], 7))   # the one element of each row: stride unread
    assert odd.is_contiguous() and odd.stride(-1) == 7
    return odd


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_dim_one_with_any_stride_of_its_single_element(dtype):
    """head_dim 1: torch calls a tensor contiguous whatever its last dim's stride, so the wrappers'
    copy left it as it was and the kernel refused it ("must have stride 1"), the CPU default too;
    an empty batch made by arithmetic the same. That stride is read nowhere there."""
    paged, packed = make([7, 1, 13], [20, 3], [0, 1, 1], 4, 2, 1, 16, dtype=dtype)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    pk, pv = packed[4], packed[5]
    odd = [_unit_head_dim_odd_strides(t) for t in (q, k, v, kc, vc, pk, pv)]
    ref = ref32(packed)
    for name, out in (("paged", prefix_shared_attention_paged(*odd[:3], cu, odd[3], odd[4], bt, pl, sg, backend="native")),
                      ("packed", prefix_shared_attention(*odd[:3], cu, odd[5], odd[6], packed[6], sg)),
                      ("packed, contiguous", prefix_shared_attention(*packed, backend="native"))):
        assert (out.float() - ref).abs().max().item() <= (1e-5 if dtype == torch.float32 else 2e-2), \
            f"{name}: " + report(out, ref)
    empty = torch.randn(0, 4, 1, dtype=dtype) * 1.0   # strides of an empty product: not 1 in its last dim
    out = prefix_shared_attention(empty, empty[:, :2], empty[:, :2], torch.zeros(1, dtype=torch.int32),
                                  pk[:0], pv[:0], torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                  backend="native")
    assert out.shape == (0, 4, 1)


@pytest.mark.parametrize("dtype,d", [(torch.float32, 64), (torch.bfloat16, 128)])
def test_thread_count_does_not_change_a_bit(dtype, d):
    """Tasks are independent (each owns its rows), on the fp32 and the bf16 tiles alike: 1 and 2
    threads give bitwise equal outputs."""
    paged, _ = make([97, 1, 7, 200], [KT + 44, 63], [0, 1, 1, 0], 8, 2, d, 16, dtype=dtype)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = prefix_shared_attention_paged(*paged, backend="native")
        torch.set_num_threads(2)
        two = prefix_shared_attention_paged(*paged, backend="native")
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calls_from_many_threads_at_once_equal_the_calls_alone(dtype):
    """Four Python threads calling the kernel at once, each on its own shapes (so each its own
    GEMM shapes, packing buffers and per-thread brgemm state), 10 calls each: every output is
    bitwise the one the same call gives alone. What an embedding server with several workers does."""
    import threading

    cases = [make(*c.values[:6], block_size=c.values[6], dtype=dtype, seed=i)[0] for i, c in enumerate(CASES[:4])]
    alone = [prefix_shared_attention_paged(*a, backend="native") for a in cases]
    wrong, errors = [], []

    def worker(i):
        try:
            for _ in range(10):
                out = prefix_shared_attention_paged(*cases[i], backend="native")
                if not torch.equal(out, alone[i]):
                    wrong.append((i, (out.float() - alone[i].float()).abs().max().item()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append((i, repr(e)))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a caller thread did not finish in 120 s"
    assert not errors, errors
    assert not wrong, f"(case, max |diff|) of calls that differ from the call alone: {wrong[:8]}"


def test_native_is_the_cpu_default_of_both_ops():
    from acarerank.ops import available_backends

    assert available_backends("prefix_shared_attention", "cpu")[0] == "native"
    assert available_backends("prefix_shared_attention_paged", "cpu")[0] == "native"


def test_opcheck_raw_kernel():
    """Schema, fake (meta) kernel and dispatch of the registered C++ op, both prefix forms."""
    fn = _kernel()
    paged, packed = make([5, 1, 9], [37, 70], [0, 1, 1], 4, 2, 32, 16)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    cp = packed[6]
    for tiles_only in (False, True):   # the batch-invariant mode's tile path too
        torch.library.opcheck(fn, (q, k, v, cu, kc, vc, bt, cp, sg, 0.25, tiles_only))
        torch.library.opcheck(fn, (q, k, v, cu, packed[4], packed[5], None, cp, sg, 0.25, tiles_only))


def _raw_args():
    paged, packed = make([5, 1, 9], [37, 70], [0, 1, 1], 4, 2, 32, 16)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    return [q, k, v, cu, kc, vc, bt, packed[6], sg, 0.25]


def _set(i, f):
    return lambda a: a.__setitem__(i, f(a[i]))


@pytest.mark.parametrize("mutate,match", [
    (_set(0, lambda t: t.double()), "q dtype"),
    (_set(1, lambda t: t.half()), "k dtype"),
    (_set(0, lambda t: t[:, :3]), "not a multiple of kv heads"),
    (_set(1, lambda t: t[:-1]), "must be \\[T, Hkv, d\\]"),
    (_set(6, lambda t: t.clone().index_fill_(1, torch.tensor([1]), 999)), "block id 999"),
    (_set(6, lambda t: t.clone().index_fill_(1, torch.tensor([0]), -3)), "block id -3"),
    (_set(6, lambda t: t[:, :1]), "more than its 1 blocks"),
    (_set(6, lambda t: t.long()), "block_table must be Int"),
    (_set(3, lambda t: t.long()), "cu_seqlens must be Int"),
    (_set(8, lambda t: torch.tensor([0, 2, 1], dtype=torch.int32)), "segment_group\\[1\\] = 2"),
    (_set(3, lambda t: torch.tensor([0, 5, 4, 15], dtype=torch.int32)), "decreases"),
    (lambda a: (a.__setitem__(4, a[4][:, :, :1]), a.__setitem__(5, a[5][:, :, :1])), "k_cache must be"),
    (_set(5, lambda t: t[:-1]), "prefix_k .* and prefix_v .* differ"),
    (_set(9, lambda s: float("nan")), "scale must be finite"),
    (_set(9, lambda s: 1e39), "scale must be finite and > 0 in fp32"),    # finite in double, inf in fp32
    (_set(9, lambda s: 1e-50), "scale must be finite and > 0 in fp32"),   # > 0 in double, 0 in fp32
])
def test_raw_kernel_bad_input_is_a_clear_error(mutate, match):
    fn = _kernel()
    a = _raw_args()
    mutate(a)
    with pytest.raises((RuntimeError, NotImplementedError), match=match):
        fn(*a)


_MANY_GROUPS = r"""
import json, re, sys
import torch
from acarerank.ops import cpu_attention

def hwm_mb():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024

dtype = getattr(torch, sys.argv[1])
G, Hq, Hkv, d, bs = 2000, 16, 8, 128, 16
kc = torch.randn(G, bs, Hkv, d).to(dtype)
vc = torch.randn(G, bs, Hkv, d).to(dtype)
bt = torch.arange(G, dtype=torch.int32)[:, None]
q, k, v = torch.randn(G, Hq, d).to(dtype), torch.randn(G, Hkv, d).to(dtype), torch.randn(G, Hkv, d).to(dtype)
cu = torch.arange(G + 1, dtype=torch.int32)
cp = torch.arange(G + 1, dtype=torch.int32)  # one prefix token per group
sg = torch.arange(G, dtype=torch.int32)
kern = cpu_attention.kernel()
kern(q[:4], k[:4], v[:4], cu[:5], kc, vc, bt[:4], cp[:5], sg[:4], 0.1)  # first-call set-up out of the count
before = hwm_mb()
out = kern(q, k, v, cu, kc, vc, bt, cp, sg, 0.1)
print(json.dumps({"before": before, "after": hwm_mb(), "out_mb": out.numel() * out.element_size() / 2**20}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_thousands_of_one_token_prefixes_need_no_buffer_per_group(dtype):
    """A decode-like call — 2,000 groups of a one-token prefix and a one-token segment, 0.6B heads —
    must not allocate a packed prefix buffer of whole key tiles per group (2 GB here at 256 keys; the peak
    RSS grew 1.2-2.3 GB before the kernel packed one-block groups in their task). Peak RSS (VmHWM)
    of a fresh process may grow by the output plus 48 MB of per-thread scratch and noise."""
    import json
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _MANY_GROUPS, dtype], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    grew = got["after"] - got["before"]
    assert grew <= got["out_mb"] + 48, f"{dtype}: peak RSS grew {grew:.0f} MB in one call (output {got['out_mb']:.0f} MB)"


_SHORT_PREFIXES = r"""
import json, re, sys
import torch
from acarerank.ops import cpu_attention

def hwm_mb():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024

dtype = getattr(torch, sys.argv[1])
G, P, L, Hq, Hkv, d = 128, 8, 129, 16, 8, 128   # 129 tokens: two row blocks at r = 2
# drawn in the dtype: no fp32 temporary raising the peak before the call
q = torch.randn(G * L, Hq, d, dtype=dtype)
k, v = torch.randn(G * L, Hkv, d, dtype=dtype), torch.randn(G * L, Hkv, d, dtype=dtype)
pk, pv = torch.randn(G * P, Hkv, d, dtype=dtype), torch.randn(G * P, Hkv, d, dtype=dtype)
cu = torch.arange(0, G * L + 1, L, dtype=torch.int32)
cp = torch.arange(0, G * P + 1, P, dtype=torch.int32)
sg = torch.arange(G, dtype=torch.int32)
kern = cpu_attention.kernel()
kern(q[:L], k[:L], v[:L], cu[:2], pk[:P], pv[:P], None, cp[:2], sg[:1], 0.1)  # first-call set-up out of the count
before = hwm_mb()
out = kern(q, k, v, cu, pk, pv, None, cp, sg, 0.1)
mb = lambda *ts: sum(t.numel() * t.element_size() for t in ts) / 2**20
print(json.dumps({"before": before, "after": hwm_mb(), "out_mb": mb(out), "kv_mb": mb(k, v, pk, pv)}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_prefixes_and_segments_are_not_padded_to_whole_tiles(dtype):
    """128 groups of an 8-token prefix and one 129-token segment (two row blocks each at r = 2), 0.6B
    heads: a key buffer shared by a group's row blocks holds whole KT-key tiles, so it is made only where
    those tiles are at most twice its keys; packing this prefix and segment into shared tiles took 64x
    and 4x their keys (512 groups in bf16: peak RSS +1,248 MB at 129 tokens, +0 at 128). Peak RSS
    (VmHWM) of a fresh process may grow by the output, twice the K/V, and 48 MB of scratch and noise."""
    import json
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SHORT_PREFIXES, dtype], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    grew, bound = got["after"] - got["before"], got["out_mb"] + 2 * got["kv_mb"] + 48
    assert grew <= bound, (f"{dtype}: peak RSS grew {grew:.0f} MB in one call (bound {bound:.0f}: output "
                           f"{got['out_mb']:.0f} MB + 2 x K/V {got['kv_mb']:.0f} MB + 48)")


_NO_HEADS = r"""
import sys
import torch
from acarerank.ops import cpu_attention

q, k, v = torch.randn(4, 0, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
pk = pv = torch.randn(3, 2, 16)
cu, cp, sg = (torch.tensor(x, dtype=torch.int32) for x in ([0, 4], [0, 3], [0]))
try:
    cpu_attention.kernel()(q, k, v, cu, pk, pv, None, cp, sg, 0.25)
except RuntimeError as e:
    print(e)
"""


def test_no_query_heads_is_a_clear_error_not_a_crash():
    """q [T, 0, d] passed the 'Hq a multiple of Hkv' check (0 is one) and the kernel divided by the
    GQA ratio r = 0 (SIGFPE: the process died). Both ops refuse it in Python, and the raw kernel
    with an error (run in a child process: without the check it kills its process)."""
    import subprocess
    import sys

    paged, packed = make([5, 7], [20, 3], [0, 1], 4, 2, 16)
    with pytest.raises(ValueError, match="at least one head"):
        prefix_shared_attention_paged(paged[0][:, :0], *paged[1:], backend="native")
    with pytest.raises(ValueError, match="at least one head"):
        prefix_shared_attention(packed[0][:, :0], *packed[1:], backend="native")
    run = subprocess.run([sys.executable, "-c", _NO_HEADS], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"the raw kernel died (rc {run.returncode}): {run.stderr[-2000:]}"
    assert "need at least one head each" in run.stdout, run.stdout + run.stderr[-2000:]


def test_output_is_contiguous_as_the_fake_says_for_a_head_major_q():
    """A dense q stored head-major ([Hq, T, d] transposed): the native kernel returns a contiguous
    output, and the ops' fakes said q's strides — opcheck failed and torch.compile stopped with
    'expected ... stride' (an incorrect fake) on such a q."""
    from acarerank.ops.attention import prefix_shared_attention_op
    from acarerank.ops.paged_attention import plan_prefix_shared_attention_paged, prefix_shared_attention_paged_op

    paged, packed = make([5, 7], [20, 3], [0, 1], 4, 2, 16)
    q = packed[0].transpose(0, 1).contiguous().transpose(0, 1)
    assert not q.is_contiguous() and torch.equal(q, packed[0])
    ref = ref32(packed)
    for backend in ("native", "torch"):
        args = (q, *packed[1:], 0.25, backend)
        assert prefix_shared_attention_op(*args).is_contiguous()
        torch.library.opcheck(prefix_shared_attention_op, args)
        _, k, v, cu, kc, vc, bt, pl, sg = paged
        plan = plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=4, num_kv_heads=2, head_dim=16,
                                                  block_size=16, num_blocks=kc.shape[0], dtype=q.dtype,
                                                  backend=backend)
        pargs = (q, k, v, cu, kc, vc, plan.block_table, plan.cu_prefix_lens, sg, list(plan.aux), 0.25, backend)
        assert prefix_shared_attention_paged_op(*pargs).is_contiguous()
        torch.library.opcheck(prefix_shared_attention_paged_op, pargs)

    def f(q, k, v, pk, pv):
        return prefix_shared_attention(q, k, v, packed[3], pk, pv, packed[6], packed[7], backend="native",
                                       validate=False) * 2

    # inductor checks the custom op's output strides against the fake's (aot_eager does not)
    out = torch.compile(f, fullgraph=True)(q, *packed[1:3], *packed[4:6])
    assert (out - 2 * ref).abs().max().item() <= 2e-5, report(out, 2 * ref)


@pytest.mark.parametrize("d", [576, 640])
def test_head_dim_past_the_kernels_limit_runs_torch_by_default(d, monkeypatch):
    """head_dim > 512 (the kernel's per-row buffers): the CPU default walks on to "torch" and equals
    the oracle, both ops, with and without a plan; "native" asked for by name (argument or
    ACARERANK_BACKEND) is a BackendError naming the limit. The default was "native" whatever the
    shape: a d-576 model raised the kernel's RuntimeError from inside the call."""
    from acarerank.ops import (BackendError, plan_prefix_shared_attention, plan_prefix_shared_attention_paged)

    paged, packed = make([3, 1, 2], [5, 17], [0, 1, 1], 4, 2, d, 16)
    ref = ref32(packed)
    q, k = packed[0], packed[1]
    plan = plan_prefix_shared_attention(*packed[3:4], packed[6], packed[7], num_tokens=q.shape[0],
                                        num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim=d, dtype=q.dtype)
    pplan = plan_prefix_shared_attention_paged(paged[3], paged[6], paged[7], paged[8], num_heads=q.shape[1],
                                               num_kv_heads=k.shape[1], head_dim=d, block_size=16,
                                               num_blocks=paged[4].shape[0], dtype=q.dtype)
    assert plan.backend == pplan.backend == "torch"
    for name, out in (("packed", prefix_shared_attention(*packed)),
                      ("packed, plan", prefix_shared_attention(*packed[:3], None, *packed[4:6], None, None, plan=plan)),
                      ("paged", prefix_shared_attention_paged(*paged)),
                      ("paged, plan", prefix_shared_attention_paged(*paged, plan=pplan))):
        assert (out - ref).abs().max().item() <= 1e-5, f"{name}: " + report(out, ref)
    limit = f"native backend takes head_dim up to 512, got {d}"
    with pytest.raises(BackendError, match=limit):
        prefix_shared_attention(*packed, backend="native")
    with pytest.raises(BackendError, match=limit):
        prefix_shared_attention_paged(*paged, backend="native")
    monkeypatch.setenv("ACARERANK_BACKEND", "native")
    with pytest.raises(BackendError, match=limit):
        prefix_shared_attention(*packed)
    with pytest.raises(BackendError, match=limit):
        plan_prefix_shared_attention_paged(paged[3], paged[6], paged[7], paged[8], num_heads=q.shape[1],
                                           num_kv_heads=k.shape[1], head_dim=d, block_size=16,
                                           num_blocks=paged[4].shape[0], dtype=q.dtype)


def test_native_max_head_dim_is_the_kernels():
    """``NATIVE_MAX_HEAD_DIM`` (what the ops' choice reads) is the kernel's own limit: 512 runs
    natively by default and equals the oracle, the raw kernel refuses 514."""
    from acarerank.ops._native_backend import NATIVE_MAX_HEAD_DIM
    from acarerank.ops.attention import plan_prefix_shared_attention

    d = NATIVE_MAX_HEAD_DIM
    paged, packed = make([2, 1], [3, 0], [0, 1], 2, 1, d, 16)
    q = packed[0]
    plan = plan_prefix_shared_attention(packed[3], packed[6], packed[7], num_tokens=q.shape[0], num_q_heads=2,
                                        num_kv_heads=1, head_dim=d, dtype=q.dtype)
    assert plan.backend == "native"
    out = prefix_shared_attention(*packed)
    assert (out - ref32(packed)).abs().max().item() <= 1e-5, report(out, ref32(packed))
    paged, packed = make([2, 1], [3, 0], [0, 1], 2, 1, d + 2, 16)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    with pytest.raises(RuntimeError, match=f"head_dim {d + 2} is outside"):
        _kernel()(q, k, v, cu, kc, vc, bt, packed[6], sg, 0.1)


def test_tile_keys_are_the_kernels():
    """The Python side's tile (the batch-invariant alignment, the tests' "over one tile" shapes) is
    the one the built kernel runs: a stale constant would cut cache hits at the wrong multiple and
    the bitwise tests below would pass on shapes that cross no tile."""
    from acarerank import _cpu

    assert _cpu.tile_keys() == KT, f"acarerank._cpu runs {_cpu.tile_keys()}-key tiles, cpu_attention.TILE_KEYS is {KT}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,d", [(4, 2, 32), (3, 1, 64), (16, 4, 128)])
def test_native_token_output_same_wherever_an_aligned_prefix_ends(dtype, Hq, Hkv, d):
    """Bitwise: a token's output is the same whether the keys before it are its own segment's rows
    (one prefill) or a prefix ending at a multiple of ``aligned_prefix_tokens`` (a cache hit, an
    earlier chunk) — for a pass of more than ``direct_path_tokens`` tokens, or of any length with
    ``tiles_only=True`` (the runner's batch-invariant mode: the paged op too); where the CPU runs the
    direct path a pass that short gets other bits by default (decode keeps its faster path), and a
    prefix ending elsewhere moves the key tiles. The two constants are the kernel's (KT,
    kDirectRows), which this pins."""
    from acarerank.ops._native import bf16_attention_path
    from acarerank.ops.cpu_attention import DIRECT_ROWS, aligned_prefix_tokens, direct_path_tokens

    Q, short = aligned_prefix_tokens(), direct_path_tokens(Hq // Hkv)
    N = 2 * Q + 40
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(N, h, d, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))

    def pass_of(P, n, tiles_only=False):  # tokens [P, P + n) over a prefix of the first P
        cu, cp = torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, P], dtype=torch.int32)
        return prefix_shared_attention(q[P:P + n], k[P:P + n], v[P:P + n], cu, k[:P], v[:P], cp,
                                       torch.zeros(1, dtype=torch.int32), backend="native", tiles_only=tiles_only)

    def paged_of(P, n):  # the same pass through the paged op, tiles only, the prefix in 16-token pages
        bs = 16
        pages = [t[:P].reshape(P // bs, bs, Hkv, d) for t in (k, v)]
        return prefix_shared_attention_paged(q[P:P + n], k[P:P + n], v[P:P + n], torch.tensor([0, n], dtype=torch.int32),
                                             *pages, torch.arange(P // bs, dtype=torch.int32)[None],
                                             torch.tensor([P], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                                             backend="native", tiles_only=True)

    whole = pass_of(0, N)
    cases = [(Q, N - Q, False), (2 * Q, N - 2 * Q, False), (Q, short + 1, False), (2 * Q, short + 1, False)]
    cases += [(P, n, True) for P in (Q, 2 * Q) for n in (1, short)]  # decode-like passes, tiles only
    for P, n, tiles_only in cases:
        for name, out in (("packed", pass_of(P, n, tiles_only)),) + ((("paged", paged_of(P, n)),) if tiles_only else ()):
            diff = out != whole[P:P + n]
            tokens = sorted(set(diff.nonzero()[:, 0].tolist()))[:8]
            assert not diff.any(), (f"{name} pass [{P}, {P + n}) after an aligned prefix (tiles_only={tiles_only}): "
                                    f"tokens {[P + t for t in tokens]} differ")
    # where bf16 tiles are converted to fp32, the bf16 output's rounding hides most fp32 moves, and
    # the direct path does not run (it takes blocks whose compute type is the input's)
    own_type = dtype == torch.float32 or bf16_attention_path() != "fp32-convert"
    if own_type:
        assert (pass_of(Q // 2 + 3, 60) != whole[Q // 2 + 3:Q // 2 + 63]).any(), "an unaligned prefix moved no bits"
    direct = os.environ.get("ACARERANK_CPU_DIRECT_ROWS", "") in ("", str(DIRECT_ROWS)) and \
        os.environ.get("ACARERANK_CPU_BASELINE") != "1" and _AVX512_BF16 <= cpu_flags()
    if own_type and direct and short:  # the direct path's steps and exp: the tail's rows move
        assert (pass_of(Q, short) != whole[Q:Q + short]).any(), f"a pass of {short} tokens took the tile path"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hkv,d", [(4, 2, 128), (8, 2, 64)])
def test_native_causal_rows_same_bits_when_the_segment_is_cut_after_them(dtype, Hq, Hkv, d):
    """Bitwise: the outputs of a long causal segment's first c tokens are the same whether the
    segment goes on after them or is cut at c, for c at the end of an own-part sub-block (every
    64 tokens here: the kernel's row blocks are 256 / r tokens, its causal sub-blocks 64 / r).
    A row's arithmetic is then its sub-block's alone — the same GEMM and softmax calls on the same
    key tiles in the same order, whichever order the kernel walks (tile, sub-block) pairs in and
    whatever rows follow. Segments span several key tiles and row blocks; two groups, one
    with a prefix and an earlier segment, so the tasks hold several pieces."""
    g = torch.Generator().manual_seed(11)
    lens = [128, 1100, 900]  # segments: group 0's two (the first whole row blocks at r 2 and 4), group 1's
    N = sum(lens)
    Q, K, V = (torch.randn(N, h, d, generator=g).to(dtype) for h in (Hq, Hkv, Hkv))
    KP, VP = (torch.randn(300, Hkv, d, generator=g).to(dtype) for _ in range(2))
    cp, sg = torch.tensor([0, 300, 300], dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32)
    first = [0, 128, 1228]  # each segment's first token in the uncut call

    def call(ns):  # each segment cut to its first ns[i] tokens
        rows = torch.cat([torch.arange(f, f + n) for f, n in zip(first, ns)])
        cu = torch.tensor([0] + torch.tensor(ns).cumsum(0).tolist(), dtype=torch.int32)
        return prefix_shared_attention(Q[rows], K[rows], V[rows], cu, KP, VP, cp, sg, backend="native"), rows

    whole, _ = call(lens)
    # the uncut call against the oracle, so that the cut calls are held to the right output too
    ref = prefix_shared_attention_ref(Q, K, V, torch.tensor([0, 128, 1228, 2128], dtype=torch.int32), KP, VP, cp, sg)
    assert (whole.float() - ref.float()).abs().max() < (1e-4 if dtype == torch.float32 else 5e-2)
    for c1, c2 in ((64, 900), (1100, 64), (576, 512), (1024, 320)):  # cuts of group 0's last segment, group 1's
        cut, rows = call([128, c1, c2])
        diff = (cut != whole[rows]).flatten(1).any(1)
        tokens = rows[diff].tolist()[:8]
        assert not diff.any(), f"cut at ({c1}, {c2}): tokens {tokens} differ from the uncut call's"


def test_fp32_masked_keys_of_a_partial_tile_get_weight_exactly_zero():
    """fp32 tiles whose rows see n keys, n not a multiple of 16 (the softmax's vector tail: 8 lanes
    on AVX2, 16 masked on AVX-512): a key a row does not see, in the same tile, gets weight exactly
    0. Each segment's last key has a value of 1.7e38, so a weight as small as fp32's least normal
    (1.2e-38) adds ~2 to a row before it; those rows must stay within 1e-5 of the oracle. NaN q
    rows (one per segment, early) stay NaN alone: their NaN P, left in the P scratch a later row
    reuses, must not reach its padding columns. Last tiles of 37, 44 and 21 keys."""
    paged, packed = make([37, KT + 44, KT + 21], [5, 0, 19], [0, 1, 2], 4, 2, 64, 16)
    q, k, v, cu = packed[:4]
    big = torch.finfo(torch.float32).max / 2
    last = (cu[1:] - 1).tolist()
    for t in last:
        v[t] = big
    nan_rows = [(3, 1), (37 + 257, 2), (37 + KT + 44 + 2, 0)]
    ref = ref32(packed)
    for t, h in nan_rows:
        q[t, h] = float("nan")
    out = prefix_shared_attention(*packed, backend="native")  # tiles: every segment has > 16 rows
    nan = torch.zeros(out.shape[:2], dtype=torch.bool)
    for t, h in nan_rows:
        nan[t, h] = True
    assert torch.equal(torch.isnan(out).any(-1), nan), f"NaN rows: {torch.nonzero(torch.isnan(out).any(-1))[:6].tolist()}"
    keep = ~nan
    keep[last] = False  # the rows that see the huge value
    err = (out[keep] - ref[keep]).abs().max().item()
    assert err <= 1e-5, f"a masked key's weight is not 0: max |diff| {err:.3g} off the oracle"


def test_fp32_a_key_far_below_the_row_max_gets_weight_exactly_zero():
    """The fp32 tiles' exp was clamped at its range's floor (x ≥ −87.3): a key scoring 200 below
    the row's max got weight ~1.2e-38, not 0, so a value of 3e38 there added 3.5 to every row (the
    oracle: 0) and an infinite one made them inf (the oracle: NaN, 0·inf). Tile path: 20 rows."""
    d, T, P = 4, 20, 2
    cs, sg, cp = (torch.tensor(x, dtype=torch.int32) for x in ([0, T], [0], [0, P]))
    q, k, v = torch.ones(T, 1, d), torch.full((T, 1, d), -1e4), torch.zeros(T, 1, d)
    pk, pv = torch.zeros(P, 1, d), torch.zeros(P, 1, d)
    pk[0, 0, 0] = 400.0   # prefix key 0 scores 200 (scale 1/2); key 1 scores 0: weight e^-200, 0 in fp32
    for value in (3e38, float("inf")):
        pv[1] = value
        want = prefix_shared_attention_ref(q, k, v, cs, pk, pv, cp, sg)
        got = prefix_shared_attention(q, k, v, cs, pk, pv, cp, sg, backend="native")
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (value, got[:2, 0], want[:2, 0])
        finite = ~torch.isnan(want)
        assert torch.equal(got[finite], want[finite]), (value, got[:2, 0], want[:2, 0])


def test_fp32_tests_pass_on_the_avx2_softmax_too():
    """The fp32 tiles' softmax is AVX-512 where the CPU has it and AVX2 under
    ACARERANK_CPU_BASELINE=1 (read once per process): this file's fp32 oracle, masking and NaN tests
    in a fresh process with it set, so that both run on an AVX-512 CPU."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("ACARERANK_CPU_BASELINE", "ACARERANK_CPU_BF16_PATH")}
    env["ACARERANK_CPU_BASELINE"] = "1"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "fp32_paged_and_packed or partial_tile or nan_in_q or nan_value or minus_inf or huge_finite "
                           "or far_below"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:] + done.stderr[-2000:]
