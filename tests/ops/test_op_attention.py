"""prefix_shared_attention: every backend that runs here against the plain references.

Triton runs on CPU under TRITON_INTERPRET=1 (set in conftest.py), on CUDA when present; with a
GPU every test of this module is marked ``cuda`` and runs there, so ``pytest -m cuda`` (the GPU
check) covers every correctness case: empty segments, 1-token segments, d 16/80/256, GQA 1-8,
fp16/bf16, decode steps.
Oracles: ``prefix_shared_attention_ref`` (fp32, per segment over cat(prefix, own)) and, for
fp16/bf16, flash-attn's rule: kernel error <= 2x the error of plain PyTorch attention in the
same dtype (+ twice fp32's rounding step near the outputs, as flash-attn's tests), both against the fp32 oracle.
"""
import math

import pytest
import torch

from acarerank.ops import BackendError, available_backends, prefix_shared_attention, prefix_shared_attention_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
# every backend declared for the op that runs here; flash_attn_cascade takes fp16/bf16 only
BACKENDS = [b for b in available_backends("prefix_shared_attention", DEVICE) if b != "flash_attn_cascade"]
HALF_BACKENDS = available_backends("prefix_shared_attention", DEVICE)


def _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d, dtype=torch.float32, device=DEVICE):
    """Random packed inputs: ([q, k, v], cu_seqlens, [prefix_k, prefix_v], cu_prefix_lens, segment_group)."""
    T, P = sum(seg_lens), sum(prefix_lens)
    q, k, v = torch.randn(T, Hq, d), torch.randn(T, Hkv, d), torch.randn(T, Hkv, d)
    pk, pv = torch.randn(P, Hkv, d), torch.randn(P, Hkv, d)
    cu = torch.tensor([0] + torch.tensor(seg_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    cp = torch.tensor([0] + torch.tensor(prefix_lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
    sg = torch.tensor(groups, dtype=torch.int32)
    dev = lambda t: t.to(device=device)  # noqa: E731
    return ([dev(t.to(dtype)) for t in (q, k, v)], dev(cu), [dev(t.to(dtype)) for t in (pk, pv)], dev(cp), dev(sg))


def _assert_close_fp32(out, ref, what):
    err = (out.float() - ref.float()).abs()
    if err.numel() and err.max() > 1e-5:
        t, rest = divmod(int(err.argmax()), out.shape[1] * out.shape[2])
        raise AssertionError(f"{what}: max err {err.max():.3e} at token {t}, head {rest // out.shape[2]}, "
                             f"dim {rest % out.shape[2]}; {int((err > 1e-5).sum())} elements over 1e-5")


def _plain_attention(q, k, v, cu, pk, pv, cp, sg, scale):
    """Plain PyTorch attention entirely in q's dtype (scores, softmax, PV): the low-precision baseline."""
    out = torch.zeros_like(q)
    r = q.shape[1] // k.shape[1]
    for s, g in enumerate(sg.tolist()):
        a, b = cu[s].item(), cu[s + 1].item()
        if a == b:
            continue
        P = cp[g + 1].item() - cp[g].item()
        keys = torch.cat([pk[cp[g]:cp[g + 1]], k[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        vals = torch.cat([pv[cp[g]:cp[g + 1]], v[a:b]]).repeat_interleave(r, 1).transpose(0, 1)
        L = b - a
        mask = torch.ones(L, P + L, dtype=torch.bool, device=q.device).tril(diagonal=P)
        scores = (q[a:b].transpose(0, 1) @ keys.transpose(1, 2)) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[a:b] = (probs @ vals).transpose(0, 1)
    return out


# (segment lengths, prefix lengths, group of each segment, Hq, Hkv, d): awkward
# shapes — segment lengths 1/7/59/97, prefix lengths 1/63/300, groups with different
# prefixes, GQA 1/2/4/8, head_dim 64/128. Few heads where the head count is not the point.
CASES = [
    pytest.param([1, 7, 59, 97], [1, 63, 300], [0, 1, 2, 1], 1, 1, 64, id="gqa1-d64-groups"),
    pytest.param([1, 7, 59, 97], [300, 63, 1], [2, 0, 1, 0], 2, 1, 64, id="gqa2-d64-groups"),
    pytest.param([97, 1, 7], [63, 1], [0, 1, 1], 8, 2, 64, id="gqa4-d64"),
    pytest.param([59, 7, 1], [300], [0, 0, 0], 8, 1, 128, id="gqa8-d128"),
    pytest.param([7, 59, 1], [63, 300], [1, 0, 1], 2, 2, 128, id="gqa1-d128"),
    pytest.param([5, 0, 3, 0, 11], [40, 0], [1, 0, 0, 1, 1], 4, 2, 64, id="empty-segments-empty-prefix"),
    pytest.param([17, 33], [0], [0, 0], 4, 2, 32, id="prefill-no-prefix"),
    pytest.param([1, 1, 1, 1], [37, 1, 70, 0], [0, 1, 2, 3], 8, 2, 64, id="decode-step"),
    pytest.param([1, 23], [8], [0, 0], 2, 1, 256, id="d256"),
    pytest.param([9, 4], [19], [0, 0], 4, 1, 16, id="d16"),
    pytest.param([9, 4], [19], [0, 0], 6, 3, 80, id="d80-padded-gqa3"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seg_lens,prefix_lens,groups,Hq,Hkv,d", CASES)
def test_fp32_matches_reference(seg_lens, prefix_lens, groups, Hq, Hkv, d, backend):
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg)
    _assert_close_fp32(out, ref, f"{backend} vs reference (fp32)")


def test_triton_custom_scale_and_noncontiguous_views():
    """Strided views (a head slice of q, K/V stored [Hkv, T, d] and transposed) and a non-default scale."""
    seg_lens, prefix_lens, groups, Hkv, d = [7, 59], [63, 1], [0, 1], 2, 64
    T, P = sum(seg_lens), sum(prefix_lens)
    q_big = torch.randn(T, 6, d, device=DEVICE)
    q = q_big[:, 1:5]  # 4 query heads, stride 6·d per token
    k = torch.randn(Hkv, T, d, device=DEVICE).transpose(0, 1)
    v = torch.randn(Hkv, T, d, device=DEVICE).transpose(0, 1)
    pk = torch.randn(P, Hkv, 2 * d, device=DEVICE)[:, :, ::2]  # head_dim stride 2
    pv = torch.randn(Hkv, P, d, device=DEVICE).transpose(0, 1)
    _, cu, _, cp, sg = _pack(seg_lens, prefix_lens, groups, 4, Hkv, d)
    assert not (q.is_contiguous() or k.is_contiguous() or pk.is_contiguous())
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, softmax_scale=0.3, backend="triton")
    ref = prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg, softmax_scale=0.3)
    _assert_close_fp32(out, ref, "triton vs reference (strided views, scale 0.3)")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "triton"])
@pytest.mark.parametrize("strided", ["q", "k", "v", "prefix_k", "prefix_v"])
def test_head_dim_strided_views(backend, strided):
    """Any strides, head_dim included: one input at a time with head_dim at stride 2 or stored
    transposed ([d, ...]). torch's private CPU flash kernel, which the torch backend calls, reads
    head_dim at unit stride whatever the tensor says; fed such a view it returned wrong values."""
    seg_lens, prefix_lens, groups, Hq, Hkv, d = [7, 1, 30], [40, 17], [0, 1, 0], 4, 2, 16
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d)
    args = dict(q=q, k=k, v=v, prefix_k=pk, prefix_v=pv)
    t = args[strided]
    args[strided] = (torch.stack([t, -t], dim=-1)[..., 0] if strided in ("k", "prefix_v")
                     else t.permute(2, 0, 1).contiguous().permute(1, 2, 0))
    assert torch.equal(args[strided], t) and args[strided].stride(-1) != 1
    out = prefix_shared_attention(args["q"], args["k"], args["v"], cu, args["prefix_k"], args["prefix_v"], cp, sg,
                                  backend=backend)
    ref = prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg)
    _assert_close_fp32(out, ref, f"{backend} vs reference ({strided} with head_dim stride {args[strided].stride(-1)})")


def test_triton_all_segments_empty():
    (q, k, v), cu, (pk, pv), cp, sg = _pack([0, 0], [5], [0, 0], 2, 1, 64)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="triton")
    assert out.shape == (0, 2, 64)


@pytest.mark.parametrize("backend", HALF_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_flash_attn_rule(dtype, backend):
    # bf16 under the interpreter: tl.dot operands are upcast to fp32 inside the kernel (triton 3.9's
    # interpreter multiplies raw bf16 bit patterns); P is still rounded to bf16 before P·V.
    seg_lens, prefix_lens, groups, Hq, Hkv, d = [1, 7, 59, 97], [1, 63, 300], [0, 1, 2, 1], 4, 2, 64
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d, dtype)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend=backend)
    assert out.dtype == dtype
    ref = prefix_shared_attention_ref(*(t.float() for t in (q, k, v)), cu, *(t.float() for t in (pk, pv)), cp, sg)
    plain = _plain_attention(q, k, v, cu, pk, pv, cp, sg, 1.0 / math.sqrt(d))
    err_kernel = (out.float() - ref).abs().max().item()
    err_plain = (plain.float() - ref).abs().max().item()
    # flash-attn's slack (tests/test_flash_attn.py): twice fp32's rounding step near the outputs
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    assert err_kernel <= 2 * err_plain + atol, (
        f"{dtype}: kernel err {err_kernel:.3e} > 2 x plain PyTorch err {err_plain:.3e} + {atol:.1e}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,d", [(16, 8, 128), (32, 4, 128), (8, 8, 256), (16, 2, 256)],
                         ids=["0.6b-gqa2", "gqa8", "d256-gqa1", "d256-gqa8"])
def test_triton_gpu_half_precision_shapes(Hq, Hkv, d, dtype):
    """The GPU kernel's other compiled variants in bf16/fp16: GQA 1, 2 and 8 (not only Qwen3-4B's
    4) and head_dim 256 (its own config), each against flash-attn's 2x rule on long prefixes."""
    seg_lens, prefix_lens, groups = [1, 7, 59, 97, 300], [1000, 1, 63], [0, 1, 2, 0, 2]
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d, dtype)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="triton")
    ref = prefix_shared_attention_ref(*(t.float() for t in (q, k, v)), cu, *(t.float() for t in (pk, pv)), cp, sg)
    plain = _plain_attention(q, k, v, cu, pk, pv, cp, sg, 1.0 / math.sqrt(d))
    err_kernel = (out.float() - ref).abs().max().item()
    err_plain = (plain.float() - ref).abs().max().item()
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    assert err_kernel <= 2 * err_plain + atol, (
        f"{dtype} Hq {Hq} Hkv {Hkv} d {d}: kernel err {err_kernel:.3e} > 2 x plain PyTorch err {err_plain:.3e}")


@pytest.mark.skipif(DEVICE == "cuda", reason="with a GPU the test above runs these configs compiled")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hq,Hkv,d", [(16, 8, 128), (32, 4, 128), (8, 8, 256), (16, 2, 256), (32, 8, 128)],
                         ids=["0.6b-gqa2", "gqa8", "d256-gqa1", "d256-gqa8", "4b-gqa4"])
def test_triton_gpu_configs_under_the_interpreter(Hq, Hkv, d, dtype):
    """The shapes of the two GPU tests around this one at the tiles a GPU runs them with (sm90's
    table entry, else its rule config: BLOCK_M 128 / BLOCK_N 64 at d 128, 64 / 32 at d 256), in
    bf16/fp16 under the interpreter, which otherwise runs its own 32 x 32 tiles: a 70-token segment
    (70-560 rows) and a 70-token prefix cross row and key blocks; flash-attn's 2x rule against the
    fp32 oracle, and that segment alone with its prefix gives the same bits as in the batch."""
    import acarerank.kernels.prefix_shared_attention as A

    cfg = A._TABLE.get(A.config_key(d, Hq // Hkv, dtype, "sm90")) or A._rule_config(d, dtype, "sm90")
    seg_lens, prefix_lens, groups = [1, 7, 70], [70, 1, 9], [0, 1, 2]
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d, dtype)
    out = A.prefix_shared_attention_triton(q, k, v, cu, pk, pv, cp, sg, 1.0 / math.sqrt(d), config=cfg)
    ref = prefix_shared_attention_ref(*(t.float() for t in (q, k, v)), cu, *(t.float() for t in (pk, pv)), cp, sg)
    plain = _plain_attention(q, k, v, cu, pk, pv, cp, sg, 1.0 / math.sqrt(d))
    err_kernel = (out.float() - ref).abs().max().item()
    err_plain = (plain.float() - ref).abs().max().item()
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    assert out.dtype == dtype and err_kernel <= 2 * err_plain + atol, (
        f"{dtype} Hq {Hq} Hkv {Hkv} d {d} config {cfg}: kernel err {err_kernel:.3e} > 2 x plain PyTorch err "
        f"{err_plain:.3e}")
    a, b = cu[2].item(), cu[3].item()
    i32 = dict(dtype=torch.int32, device=DEVICE)
    alone = A.prefix_shared_attention_triton(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a], **i32), pk[71:], pv[71:],
                                             torch.tensor([0, 9], **i32), torch.zeros(1, **i32), 1.0 / math.sqrt(d),
                                             config=cfg)
    assert torch.equal(alone, out[a:b]), f"{int((alone != out[a:b]).sum())} elements differ alone vs in batch"


def test_triton_segment_output_independent_of_batch_composition():
    """Bitwise: the same segment (with its prefix) gives the same rows in any batch, any order."""
    Hq, Hkv, d = 4, 2, 64
    tgt_q, tgt_k, tgt_v = torch.randn(59, Hq, d), torch.randn(59, Hkv, d), torch.randn(59, Hkv, d)
    tgt_pk, tgt_pv = torch.randn(63, Hkv, d), torch.randn(63, Hkv, d)

    def run(others, tgt_pos, tgt_group, other_groups_prefix):
        """others: (len, index into other_groups_prefix, or None = the target's group); the target
        is inserted at tgt_pos and its prefix at group index tgt_group."""
        prefixes = [(torch.randn(n, Hkv, d), torch.randn(n, Hkv, d)) for n in other_groups_prefix]
        prefixes.insert(tgt_group, (tgt_pk, tgt_pv))
        segs = [(torch.randn(n, Hq, d), torch.randn(n, Hkv, d), torch.randn(n, Hkv, d),
                 tgt_group if g is None else g + (g >= tgt_group)) for n, g in others]
        segs.insert(tgt_pos, (tgt_q, tgt_k, tgt_v, tgt_group))
        q = torch.cat([s[0] for s in segs]).to(DEVICE)
        k = torch.cat([s[1] for s in segs]).to(DEVICE)
        v = torch.cat([s[2] for s in segs]).to(DEVICE)
        lens = [s[0].shape[0] for s in segs]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        pk = torch.cat([p[0] for p in prefixes]).to(DEVICE)
        pv = torch.cat([p[1] for p in prefixes]).to(DEVICE)
        cp = torch.tensor([0] + torch.tensor([p[0].shape[0] for p in prefixes]).cumsum(0).tolist(),
                          dtype=torch.int32, device=DEVICE)
        sg = torch.tensor([s[3] for s in segs], dtype=torch.int32, device=DEVICE)
        out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="triton")
        a = cu[tgt_pos].item()
        return out[a:a + 59].cpu()

    alone = run([], 0, 0, [])
    batches = [
        run([(7, 0), (1, None)], 2, 0, [300]),             # last, sharing its group with a decode step
        run([(97, 0), (13, None)], 0, 1, [5]),             # first, its group second
        run([(13, 0), (1, 1), (97, None)], 1, 2, [5, 1]),  # in the middle, its group third
    ]
    for i, got in enumerate(batches):
        diff = (got != alone)
        assert not diff.any(), f"batch {i}: {int(diff.sum())} elements differ, first at {diff.nonzero()[0].tolist()}"


@pytest.mark.parametrize("Hq,Hkv,d", [(4, 2, 32), (6, 2, 64), (2, 2, 16)], ids=["gqa2", "gqa3", "gqa1-d16"])
def test_triton_token_output_same_wherever_an_aligned_prefix_ends(Hq, Hkv, d):
    """Bitwise: a token's output is the same whether the keys before it are its own segment's rows
    (one prefill) or a prefix ending at any multiple of aligned_prefix_tokens (a cache hit, an
    earlier chunk: the runner's batch-invariant mode starts its passes there); a prefix ending
    elsewhere moves the key tiles and the row blocks (the runner never makes one in that mode)."""
    from acarerank.kernels.prefix_shared_attention import aligned_prefix_tokens

    Q = aligned_prefix_tokens(d, Hq // Hkv, torch.float32, torch.device(DEVICE))
    N = 3 * Q + 11
    q, k, v = (torch.randn(N, h, d, device=DEVICE) for h in (Hq, Hkv, Hkv))

    def split_at(P):
        cu = torch.tensor([0, N - P], dtype=torch.int32, device=DEVICE)
        cp = torch.tensor([0, P], dtype=torch.int32, device=DEVICE)
        sg = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        return prefix_shared_attention(q[P:], k[P:], v[P:], cu, k[:P], v[:P], cp, sg, backend="triton")

    whole = split_at(0)
    for P in (Q, 2 * Q, 3 * Q):
        diff = split_at(P) != whole[P:]
        tokens = sorted(set(diff.nonzero()[:, 0].tolist()))[:8]
        assert not diff.any(), f"prefix of {P} (aligned to {Q}): tokens {tokens} after it differ from one pass"
    assert any((split_at(P) != whole[P:]).any() for P in (1, Q // 2 + 3)), "an unaligned prefix moved no bits"


def test_work_list_covers_every_row_once_heaviest_first():
    from acarerank.kernels.prefix_shared_attention import _work_list

    seg_lens, prefix_lens, groups, gqa, bm = [1, 0, 7, 59, 97], [1, 63, 300], [0, 0, 1, 2, 1], 4, 32
    _, cu, _, cp, sg = _pack(seg_lens, prefix_lens, groups, gqa, 1, 16)
    work = _work_list(cu, cp, sg, sum(seg_lens), gqa, bm).tolist()
    live = [(s, r0) for s, r0 in work if s >= 0]
    assert all(w == [-1, 0] for w in work[len(live):]), f"spare slots must come last as (-1, 0): {work}"
    covered = sorted((s, r) for s, r0 in live for r in range(r0, min(r0 + bm, seg_lens[s] * gqa)))
    expected = [(s, r) for s, n in enumerate(seg_lens) for r in range(n * gqa)]
    assert covered == expected, "work list does not tile every (segment, row) exactly once"
    cost = [prefix_lens[groups[s]] + min(r0 + bm - 1, seg_lens[s] * gqa - 1) // gqa + 1 for s, r0 in live]
    assert cost == sorted(cost, reverse=True), f"work list not heaviest first: {cost}"


def test_flops_counts_visible_query_key_pairs():
    from acarerank.kernels.prefix_shared_attention import flops

    seg_lens, prefix_lens, groups, Hq, d = [1, 7, 0, 59], [63, 300], [0, 1, 1, 0], 8, 128
    _, cu, _, cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, 1, 16)
    pairs = sum(int(torch.ones(L, prefix_lens[g] + L).tril(diagonal=prefix_lens[g]).sum())
                for L, g in zip(seg_lens, groups))
    assert flops(cu, cp, sg, Hq, d) == 4 * Hq * d * pairs


def test_triton_rejects_head_dim_over_256():
    (q, k, v), cu, (pk, pv), cp, sg = _pack([2], [1], [0], 1, 1, 512)
    with pytest.raises(ValueError, match="the triton backend takes head_dim up to 256, got 512"):
        prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="triton")


def _paged(cu, pk, pv, cp, sg, bs=16):
    """The packed prefixes of ``_pack`` in pages of ``bs`` tokens (group g's pages after g-1's):
    (k_cache, v_cache, block_table, prefix_lens) for ``prefix_shared_attention_paged``."""
    lens = (cp[1:] - cp[:-1]).tolist()
    nblk = [-(-n // bs) for n in lens]
    Hkv, d = pk.shape[1], pk.shape[2]
    kc, vc = pk.new_zeros(sum(nblk) + 1, bs, Hkv, d), pv.new_zeros(sum(nblk) + 1, bs, Hkv, d)
    bt = torch.zeros(len(lens), max(nblk + [1]), dtype=torch.int32)
    first = 0
    for g, (n, nb) in enumerate(zip(lens, nblk)):
        bt[g, :nb] = torch.arange(first, first + nb, dtype=torch.int32)
        rows = torch.arange(n)
        kc[first + rows // bs, rows % bs] = pk[int(cp[g]):int(cp[g]) + n]
        vc[first + rows // bs, rows % bs] = pv[int(cp[g]):int(cp[g]) + n]
        first += nb
    return kc, vc, bt.to(pk.device), torch.tensor(lens, dtype=torch.int32, device=pk.device)


@pytest.mark.parametrize("d", [256, 264])
def test_triton_default_takes_torch_past_its_head_dim_limit(d, monkeypatch):
    """CUDA's default attention backend is triton, whose kernel takes head_dim <= 256: a Qwen3 of
    head_dim 264 raised the kernel's ValueError from inside the call. Past the limit the default
    walks on to "torch" (packed and paged ops, with and without a plan) and equals the oracle; at
    256 triton runs. "triton" asked for by name (argument or ACARERANK_BACKEND) is a
    BackendLimitError (a ValueError) naming the limit, before any work. Off a GPU, the CPU default
    list is made CUDA's (triton, torch) and triton runs under the interpreter."""
    from acarerank.ops import (BackendLimitError, paged_attention, plan_prefix_shared_attention,
                               plan_prefix_shared_attention_paged, prefix_shared_attention_paged)
    from acarerank.ops import attention, cpu_attention

    monkeypatch.delenv("ACARERANK_BACKEND", raising=False)
    for decl in (attention.OP, paged_attention.OP):  # the selection on a CUDA device, no tensor needed
        assert decl.defaults["cuda"][0] == "triton"
        assert cpu_attention.resolve(decl, None, torch.device("cuda"), d) == ("triton" if d <= 256 else "torch")
        monkeypatch.setitem(decl.defaults, DEVICE, ("triton", "torch"))
    want = "triton" if d <= 256 else "torch"
    ran = []
    real = attention.OP.impl.__func__

    def impl(self, name):  # records the backends that run (why_not loads them too, without running)
        fn = real(self, name)

        def recorded(*args, **kw):
            ran.append((self.name, name))
            return fn(*args, **kw)
        return recorded

    monkeypatch.setattr(type(attention.OP), "impl", impl)
    torch.manual_seed(0)
    (q, k, v), cu, (pk, pv), cp, sg = _pack([3, 1, 2], [5, 17], [0, 1, 1], 4, 2, d)
    kc, vc, bt, pl = _paged(cu, pk, pv, cp, sg)
    ref = prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg)
    plan = plan_prefix_shared_attention(cu, cp, sg, num_tokens=q.shape[0], num_q_heads=4, num_kv_heads=2,
                                        head_dim=d, dtype=q.dtype)
    pplan = plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=4, num_kv_heads=2, head_dim=d,
                                               block_size=16, num_blocks=kc.shape[0], dtype=q.dtype)
    assert plan.backend == pplan.backend == want
    for name, out in (("packed", prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg)),
                      ("packed, plan", prefix_shared_attention(q, k, v, None, pk, pv, None, None, plan=plan)),
                      ("paged", prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg)),
                      ("paged, plan", prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg, plan=pplan))):
        _assert_close_fp32(out, ref, name)
    assert {b for _, b in ran} == {want}, ran
    if d <= 256:
        return
    limit = f"the triton backend takes head_dim up to 256, got {d}; use the 'torch' backend"
    ran.clear()
    for call in (lambda: prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="triton"),
                 lambda: prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg, backend="triton"),
                 lambda: plan_prefix_shared_attention(cu, cp, sg, num_tokens=q.shape[0], num_q_heads=4,
                                                      num_kv_heads=2, head_dim=d, dtype=q.dtype,
                                                      backend={"attention": "triton"})):
        with pytest.raises(BackendLimitError, match=limit) as e:
            call()
        assert isinstance(e.value, ValueError) and isinstance(e.value, BackendError)
    monkeypatch.setenv("ACARERANK_BACKEND", "triton")
    with pytest.raises(BackendLimitError, match=limit):
        prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg)
    assert ran == [], ran


def test_triton_max_head_dim_is_the_kernels():
    """``TRITON_MAX_HEAD_DIM`` (what the ops' choice reads) is the Triton kernel's own limit."""
    from acarerank.kernels.prefix_shared_attention import _MAX_HEAD_DIM
    from acarerank.ops.cpu_attention import TRITON_MAX_HEAD_DIM

    assert TRITON_MAX_HEAD_DIM == _MAX_HEAD_DIM


_SM90_COMPILE = r"""
import os, sys
os.environ.pop("TRITON_INTERPRET", None)  # compile real GPU kernels: needs triton.jit, not the interpreter
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from acarerank.kernels import prefix_shared_attention as A, yes_no_head as Y

def build(fn, sig, const, **opts):
    names = fn.arg_names
    full = {n: sig.get(n, "constexpr") for n in names}
    # pointers and strides divisible by 16, as triton specializes them at launch for real shapes
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in sig if sig[n].startswith("*") or n.startswith("stride")}
    src = ASTSource(fn=fn, signature=full, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

ptrs = {n: "*bf16" for n in ("Q", "K", "V", "PK", "PV", "Out")}
ptrs.update({n: "*i32" for n in ("CU_SEQ", "CU_PRE", "SEG_GROUP", "WORK", "BT")})
ptrs.update({n: "i32" for n in A._prefix_shared_attn_fwd.arg_names if n.startswith("stride") and not n.endswith("d")})
ptrs["qk_scale"] = "fp32"
const = {n: 1 for n in A._prefix_shared_attn_fwd.arg_names if n.startswith("stride") and n.endswith("d")}
import torch
bm, bn, nw, ns = A._rule_config(128, torch.bfloat16)  # the config a d-128 bf16 call gets without a tuned table
const.update(HEAD_DIM=128, BLOCK_D=128, GQA=4, BLOCK_M=bm, BLOCK_N=bn, DOT_FP32=False, IEEE=False, PAGE=0)
ptx = build(A._prefix_shared_attn_fwd, ptrs, const, num_warps=nw, num_stages=ns)
print("attention wgmma", ptx.count("wgmma.mma_async"), "cp.async", ptx.count("cp.async"))
const.update(PAGE=16)  # the paged prefix stream (block-table lookup in the kernel)
ptx = build(A._prefix_shared_attn_fwd, ptrs, const, num_warps=nw, num_stages=ns)
print("paged wgmma", ptx.count("wgmma.mma_async"), "cp.async", ptx.count("cp.async"))
sig = {"Hid": "*bf16", "NormW": "*bf16", "WYes": "*bf16", "WNo": "*bf16", "Score": "*fp32", "Diff": "*fp32",
       "S": "i32", "H": "i32", "stride_s": "i32", "eps": "fp32"}
build(Y._yes_no_head_kernel, sig, dict(stride_h=1, BLOCK_S=4, BLOCK_H=1024), num_warps=4)
print("head ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels are compiled and run by the tests above")
def test_kernels_compile_for_hopper_without_a_gpu():
    """Ahead-of-time compile for sm_90 (triton's bundled ptxas, no driver): the GPU path at least
    builds in CPU-only CI, and the hot attention config lowers to Hopper tensor cores (wgmma)
    with pipelined cp.async loads."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", _SM90_COMPILE], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"sm_90 compile failed:\n{res.stderr[-3000:]}"
    counts = res.stdout.split("\n")[0].split()
    assert counts[0] == "attention" and int(counts[2]) > 0 and int(counts[4]) > 0, f"no wgmma / cp.async: {res.stdout}"
    paged = res.stdout.split("\n")[1].split()
    assert paged[0] == "paged" and int(paged[2]) > 0, f"paged variant lost the tensor cores: {res.stdout}"
    assert "head ok" in res.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp16 shares bf16's code path
def test_triton_gpu_qwen3_4b_heads(dtype):
    """The GPU path at Qwen3-4B heads (32 q / 8 kv, d 128): accuracy and batch invariance."""
    seg_lens, prefix_lens, groups = [1, 7, 59, 97, 512], [1000, 1], [0, 1, 0, 0, 1]
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, 32, 8, 128, dtype)
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="triton")
    ref = prefix_shared_attention_ref(*(t.float() for t in (q, k, v)), cu, *(t.float() for t in (pk, pv)), cp, sg)
    if dtype == torch.float32:
        _assert_close_fp32(out, ref, "GPU fp32")
    else:
        plain = _plain_attention(q, k, v, cu, pk, pv, cp, sg, 1.0 / math.sqrt(128))
        err_kernel = (out.float() - ref).abs().max().item()
        err_plain = (plain.float() - ref).abs().max().item()
        assert err_kernel <= 2 * err_plain + 2 * (ref + 0.3 - 0.3 - ref).abs().max().item(), (
            f"{dtype}: kernel err {err_kernel:.3e} vs plain PyTorch {err_plain:.3e}")
    # the 59-token segment alone (with its group's prefix) gives the same bits
    a, b = cu[2].item(), cu[3].item()
    alone = prefix_shared_attention(q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a], dtype=torch.int32, device=DEVICE),
                                    pk[:1000], pv[:1000], torch.tensor([0, 1000], dtype=torch.int32, device=DEVICE),
                                    torch.zeros(1, dtype=torch.int32, device=DEVICE), backend="triton")
    assert torch.equal(alone, out[a:b]), f"{int((alone != out[a:b]).sum())} elements differ alone vs in batch"


# ---------------------------------------------------------------- torch backend: its two inner paths
def _concat_oracle(q, k, v, cu, pk, pv, cp, sg):
    """Attention over the literally concatenated sequence prefix ++ segment (causal), via SDPA."""
    out = torch.zeros_like(q, dtype=torch.float32)
    r = q.shape[1] // k.shape[1]
    for s, g in enumerate(sg.tolist()):
        a, b = cu[s].item(), cu[s + 1].item()
        if a == b:
            continue
        P = cp[g + 1].item() - cp[g].item()
        keys = torch.cat([pk[cp[g]:cp[g + 1]], k[a:b]]).float().repeat_interleave(r, 1).transpose(0, 1)
        vals = torch.cat([pv[cp[g]:cp[g + 1]], v[a:b]]).float().repeat_interleave(r, 1).transpose(0, 1)
        # queries sit at positions P..P+L-1 of the concatenated sequence: causal mask with an offset
        L = b - a
        mask = torch.ones(L, P + L, dtype=torch.bool).tril(diagonal=P)
        out[a:b] = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].float().transpose(0, 1), keys, vals, attn_mask=mask).transpose(0, 1)
    return out


TORCH_PATH_CASES = [
    # (segment lengths, prefix lengths, group of each segment, Hq, Hkv, d)
    ([1, 7, 59, 97], [1, 63, 300], [0, 1, 2, 1], 4, 2, 64),
    ([1], [1], [0], 2, 2, 64),                       # one segment of one token, prefix of one token
    ([5, 0, 3, 11], [40, 0], [1, 0, 0, 1], 8, 1, 128),  # empty segment, empty prefix, GQA 8
    ([3] * 9, [17, 4, 9], [0, 1, 2, 0, 1, 2, 2, 1, 0], 6, 3, 32),  # interleaved groups
    ([13, 2], [29], [0, 0], 4, 4, 16),
]


@pytest.mark.parametrize("path", ["cpu-flash", "matmul"])
@pytest.mark.parametrize("seg_lens,prefix_lens,groups,Hq,Hkv,d", TORCH_PATH_CASES)
def test_torch_backend_equals_concatenated_attention(seg_lens, prefix_lens, groups, Hq, Hkv, d, path, monkeypatch):
    """Both inner paths: torch's fused CPU flash kernel, and the matmul path other devices take."""
    import acarerank.ops.attention as att
    if path == "matmul":
        monkeypatch.setattr(att, "_FLASH_CPU", None)
    (q, k, v), cu, (pk, pv), cp, sg = _pack(seg_lens, prefix_lens, groups, Hq, Hkv, d, device="cpu")
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    ref = _concat_oracle(q, k, v, cu, pk, pv, cp, sg)
    err = (out - ref).abs()
    assert err.max() <= 1e-5, f"max err {err.max():.3e} at {divmod(int(err.argmax()), Hq * d)}"
    ref2 = prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg)
    assert (ref2 - ref).abs().max() <= 1e-5


def test_torch_backend_chunks_large_prefix(monkeypatch):
    """The prefix GEMM is cut into row blocks under a memory budget; results must not change."""
    import acarerank.ops.attention as att
    monkeypatch.setattr(att, "_FLASH_CPU", None)  # the fused CPU kernel needs no chunking
    (q, k, v), cu, (pk, pv), cp, sg = _pack([31, 17], [257], [0, 0], 4, 2, 32, device="cpu")
    full = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    monkeypatch.setattr(att, "_TORCH_SCORE_BUDGET", 2 * 257 * 5)
    chunked = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    assert (full - chunked).abs().max() <= 1e-6


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_torch_backend_half_precision(dtype, tol):
    (q, k, v), cu, (pk, pv), cp, sg = _pack([7, 59], [63, 5], [0, 1], 4, 2, 64, dtype, device="cpu")
    out = prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend="torch")
    assert out.dtype == dtype
    ref = _concat_oracle(q, k, v, cu, pk, pv, cp, sg)
    # fp32 accumulation inside, so the only error is the final rounding to the half type
    assert (out.float() - ref).abs().max() <= tol


def test_attention_bad_inputs():
    (q, k, v), cu, (pk, pv), cp, sg = _pack([3, 4], [5], [0, 0], 4, 2, 16, device="cpu")
    call = lambda **kw: prefix_shared_attention(**{**dict(q=q, k=k, v=v, cu_seqlens=cu, prefix_k=pk, prefix_v=pv,
                                                            cu_prefix_lens=cp, segment_group=sg), **kw})
    with pytest.raises(ValueError, match="not a multiple"):
        call(k=torch.randn(7, 3, 16), v=torch.randn(7, 3, 16), prefix_k=torch.randn(5, 3, 16), prefix_v=torch.randn(5, 3, 16))
    with pytest.raises(TypeError, match="int32"):
        call(cu_seqlens=cu.long())
    with pytest.raises(TypeError, match="dtype"):
        call(k=k.double())
    with pytest.raises(ValueError, match="end at T"):
        call(cu_seqlens=torch.tensor([0, 3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="segment_group values"):
        call(segment_group=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(BackendError, match="unknown backend"):
        call(backend="nope")


@pytest.mark.parametrize("backend", [b for b in ("torch", "native") if b in available_backends(
    "prefix_shared_attention", "cpu")])
def test_bad_metadata_is_refused_on_the_cpu_without_validate(backend):
    """validate=False skips the checks that need a device sync; the torch backend then indexed its
    host lists unchecked: a segment_group of -2 read group 2's prefix (the wrong output, no error)
    and a cu_seqlens ending before T left rows of uninitialised memory. It checks the host copy it
    reads now, as the native kernel does."""
    (q, k, v), cu, (pk, pv), cp, sg = _pack([2, 4], [3, 2, 4], [0, 1], 2, 1, 8, device="cpu")
    call = lambda **kw: prefix_shared_attention(**{**dict(q=q, k=k, v=v, cu_seqlens=cu, prefix_k=pk, prefix_v=pv,
                                                            cu_prefix_lens=cp, segment_group=sg), **kw},
                                                backend=backend, validate=False)
    with pytest.raises((ValueError, RuntimeError), match="segment_group"):
        call(segment_group=torch.tensor([-2, 0], dtype=torch.int32))
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens"):
        call(cu_seqlens=torch.tensor([0, 2, 4], dtype=torch.int32))


# ---------------------------------------------------------------- plan once per forward
def _tiny_runner(layers, backend):
    from _tiny import random_qwen3
    from acarerank.model import Qwen3Runner
    model = random_qwen3(vocab=96, hidden=32, intermediate=48, layers=layers, heads=4, kv_heads=2, head_dim=16, tie=True)
    return Qwen3Runner.from_hf(model, backend=backend)


@pytest.mark.skipif(DEVICE == "cuda", reason="counts host reads of CPU-resident metadata")
@pytest.mark.parametrize("backend,syncs,plans", [("torch", 1, 0), ("triton", 0, 1)])
def test_runner_plans_once_per_forward(backend, syncs, plans, monkeypatch):
    """Per packed forward: the metadata is read to the host ``syncs`` times and the Triton work
    list is built ``plans`` times, whatever the number of layers (before the plan: 3 reads
    and one work list per layer). Every host read of the metadata goes through
    ``attention._device_to_host`` (the layers then read the plan's host copy)."""
    import acarerank.kernels.prefix_shared_attention as kernel
    import acarerank.ops.attention as att

    counts = {}
    for mod, name, key in ((att, "_device_to_host", "d2h"), (kernel, "_work_list", "work")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _k=key, **kw: (counts.__setitem__(_k, counts.get(_k, 0) + 1),
                                                                             _r(*a, **kw))[1])
    seen = []
    for layers in (1, 3):
        runner = _tiny_runner(layers, backend)
        cache = runner.prefill([[1, 2, 3, 4, 5], [6, 7]])
        counts.clear()
        runner.forward(cache, [[8, 9, 10], [11], [12, 13]], [0, 1, 0], output="last")
        seen.append(dict(counts))
    assert seen[0] == seen[1], f"host reads grow with the layers: 1 layer {seen[0]} vs 3 layers {seen[1]}"
    assert seen[1].get("d2h", 0) == syncs and seen[1].get("work", 0) == plans, seen[1]


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf")])
def test_a_non_finite_value_reaches_only_the_rows_that_see_it(bad):
    """A non-finite own value v[j] makes non-finite exactly the rows that see it (rows j.. of its
    segment, the query heads of its kv head, that dimension); the rows before it are finite and
    equal the oracle on the same data with that value finite. The oracle and the "torch" backend
    multiplied a hidden key's weight 0 by it: NaN rows before j where the native kernel, which
    never reads a hidden key, was right."""
    torch.manual_seed(5)
    (q, k, v), cu, (pk, pv), cp, sg = _pack([20, 6], [37, 10], [0, 1], 4, 2, 16, device="cpu")
    clean = prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg)
    v[8, 1, 3] = bad   # token 8 of segment 0, kv head 1 = query heads 2 and 3
    sees = torch.zeros(q.shape[:2], dtype=torch.bool)
    sees[8:20, 2:4] = True
    if bad == float("inf"):   # and a -inf further on: the rows that see both are NaN, the others inf
        v[12, 1, 3] = float("-inf")
    cpu_backends = [b for b in ("torch", "native", "cpp") if b in available_backends("prefix_shared_attention", "cpu")]
    for name, out in [("oracle", prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg))] + \
            [(b, prefix_shared_attention(q, k, v, cu, pk, pv, cp, sg, backend=b)) for b in cpu_backends]:
        off = ~torch.isfinite(out)
        assert torch.equal(off.any(-1), sees), f"{name}: non-finite rows {off.any(-1).nonzero()[:6].tolist()}"
        if bad == float("inf"):
            assert (out[8:12, 2:4, 3] == float("inf")).all() and out[12:20, 2:4, 3].isnan().all(), name
        assert off[sees][:, 3].all() and not off[sees][:, :3].any(), f"{name}: only dim 3 of the rows that see it"
        _assert_close_fp32(out[~sees], clean[~sees], f"{name}: the rows that do not see it")


def test_plan_checks_shapes_and_backend():
    from acarerank.ops import plan_prefix_shared_attention
    (q, k, v), cu, (pk, pv), cp, sg = _pack([3, 4], [5], [0, 0], 4, 2, 16, device="cpu")
    plan = plan_prefix_shared_attention(cu, cp, sg, num_tokens=7, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                        dtype=torch.float32, backend="torch")
    out = prefix_shared_attention(q, k, v, None, pk, pv, None, None, plan=plan)
    _assert_close_fp32(out, prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg), "planned call")
    with pytest.raises(ValueError, match="plan was built for"):
        prefix_shared_attention(q[:, :2], k, v, None, pk, pv, None, None, plan=plan)
    with pytest.raises(ValueError, match="pass backend= to plan_prefix_shared_attention"):
        prefix_shared_attention(q, k, v, None, pk, pv, None, None, plan=plan, backend="torch")
    # a prefix shorter (or longer) than the plan's cu_prefix_lens: "torch" sliced it short, a wrong
    # output with no error (the native kernel refused it); every backend of a plan that read the
    # metadata on the host refuses it now
    for name in ("torch",) + (("native",) if "native" in available_backends("prefix_shared_attention", "cpu") else ()):
        p = plan_prefix_shared_attention(cu, cp, sg, num_tokens=7, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                         dtype=torch.float32, backend=name, validate=False)
        assert p.prefix_rows == 5, (name, p.prefix_rows)
        for pk2, pv2, which in ((pk[:3], pv, "prefix_k has 3"), (pk, torch.cat([pv, pv]), "prefix_v has 10")):
            with pytest.raises(ValueError, match=f"cu_prefix_lens ends at 5 but {which} rows"):
                prefix_shared_attention(q, k, v, None, pk2, pv2, None, None, plan=p)
    with pytest.raises(ValueError, match="end at T=8"):
        plan_prefix_shared_attention(cu, cp, sg, num_tokens=8, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                     dtype=torch.float32)
    with pytest.raises(BackendError, match="no 'cpp' backend"):
        plan_prefix_shared_attention(cu, cp, sg, num_tokens=7, num_q_heads=4, num_kv_heads=2, head_dim=16,
                                     dtype=torch.float32, backend="cpp")


# ---------------------------------------------------------------- fixed configs
def test_attention_configs_are_fixed_and_do_not_spill():
    """No timing-based autotune; every rule config and every table entry keeps the fp32
    accumulator <= 64 registers/thread and shared memory <= 160 KB (docs/ARCHITECTURE.md,
    "Kernel configs"); a 128x128 fp32 accumulator in one warpgroup (4 warps) is refused.
    This estimate is only the tuner's quick filter: tests/ops/test_spill_free.py compiles the
    shipped configs and reads the compiler's own register and spill report."""
    import pathlib

    import acarerank.kernels.prefix_shared_attention as A
    src = pathlib.Path(A.__file__).read_text()
    assert "triton.autotune" not in src and "Autotuner" not in type(A._prefix_shared_attn_fwd).__name__
    dtypes = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    for d in (16, 64, 80, 128, 256):
        for dt in dtypes.values():
            cfg = A._rule_config(d, dt)
            assert A.fits(cfg, d, dt), (d, dt, cfg, A.acc_registers(cfg, d), A.smem_bytes(cfg, d, dt))
            assert all(A.fits(c, d, dt) for c in A.candidate_configs(d, dt))
    for key, cfg in A._TABLE.items():
        _, dt, dd, _ = key.split("/")
        assert A.fits(cfg, int(dd[1:]), dtypes[dt]), (key, cfg)
    assert not A.fits((128, 64, 4, 2), 128, torch.bfloat16)


def _every_other(t):
    """``t`` (1-D) as a strided view: every other entry of a buffer whose other entries are garbage."""
    buf = torch.full((2 * t.numel(),), 99, dtype=t.dtype, device=t.device)
    buf[::2] = t
    return buf[::2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_metadata(backend):
    """cu_seqlens / cu_prefix_lens / segment_group as strided views equal their contiguous copies.
    The Triton kernel read them at unit stride: the garbage entries were taken for segment
    offsets and groups (wrong rows with no error, max error 2.8; here a segfault)."""
    (q, k, v), cu, (pk, pv), cp, sg = _pack([3, 0, 4], [4, 5], [1, 0, 1], 4, 2, 16)
    meta = [_every_other(t) for t in (cu, cp, sg)]
    assert not any(t.is_contiguous() for t in meta)
    out = prefix_shared_attention(q, k, v, meta[0], pk, pv, meta[1], meta[2], backend=backend)
    _assert_close_fp32(out, prefix_shared_attention_ref(q, k, v, cu, pk, pv, cp, sg), f"{backend}, strided metadata")


def _minus_inf_case(case):
    """Packed fp32 inputs (CPU) where some rows' scores over their own keys, their prefix or both
    are all −inf: a −inf in k or in the prefix's k against a positive q, a q holding +inf against
    keys negative there, or a q·k past fp32's range from finite inputs (1e20 · −1e20). Segments
    [3, 3, 3]; segments 0 and 1 in group 0 (prefix of 5), segment 2 in group 1 (no prefix)."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(9, 4, 16, generator=g).abs()
    k, v = torch.randn(9, 2, 16, generator=g), torch.randn(9, 2, 16, generator=g)
    pk, pv = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    ninf = float("-inf")
    if case == "own-key":        # row 0: its one own key; row 6 (no prefix), kv head 0: NaN as plain softmax
        k[0, :, 0] = ninf
        k[6, 0, 0] = ninf
    elif case == "prefix":       # every prefix key: group 0's rows see their own keys only
        pk[:, :, 0] = ninf
    elif case == "both":         # row 3 sees no key above −inf: NaN
        pk[:, :, 0] = ninf
        k[3, :, 0] = ninf
    elif case == "q-inf":        # +inf · (−1) on every key: rows (1, 0) and (4, 3) NaN
        k[:, :, 0], pk[:, :, 0] = -1.0, -1.0
        q[1, 0, 0] = q[4, 3, 0] = float("inf")
    elif case == "overflow-prefix":  # finite inputs, the prefix's products overflow to −inf
        q[:, :, 0], pk[:, :, 0], k[:, :, 0] = 1e20, -1e20, 0.0
    elif case == "overflow-own":
        q[:, :, 0], k[:, :, 0], pk[:, :, 0] = 1e20, -1e20, 0.0
    meta = (torch.tensor([0, 3, 6, 9], dtype=torch.int32), torch.tensor([0, 5, 5], dtype=torch.int32),
            torch.tensor([0, 0, 1], dtype=torch.int32))
    return q, k, v, pk, pv, meta


MINUS_INF_CASES = ["own-key", "prefix", "both", "q-inf", "overflow-prefix", "overflow-own"]


@pytest.mark.parametrize("case", MINUS_INF_CASES)
@pytest.mark.parametrize("path", ["torch-cpu-flash", "torch-matmul", "native", "triton"])
def test_scores_all_minus_inf_in_one_part_weigh_nothing(case, path, monkeypatch):
    """A row whose own (causal) keys, or whose prefix keys, all score −inf: those keys get weight 0
    (FlashAttention's rule) and the row is the softmax over its other keys, as the reference; no
    finite key at all: NaN, as the reference. torch's fused CPU flash kernel returned lse 0 (not
    −inf) for such a block and the log-sum-exp merge gave its keys the weight of a score 0: a
    wrong finite row (max error 1.8) with no error; the matmul path gave NaN · 0 = NaN rows; the
    Triton kernel (interpreter here) computed −inf − (−inf) for a row whose prefix keys were all
    −inf and gave NaN rows, and 0 for a row with no finite key."""
    import acarerank.ops.attention as att
    backend = path if path in ("native", "triton") else "torch"
    if backend not in available_backends("prefix_shared_attention", "cpu"):
        pytest.skip(f"{backend} does not run here")
    if path == "torch-matmul":
        monkeypatch.setattr(att, "_FLASH_CPU", None)
    q, k, v, pk, pv, (cs, cp, sg) = _minus_inf_case(case)
    ref = prefix_shared_attention_ref(q, k, v, cs, pk, pv, cp, sg)
    nan = torch.isnan(ref)
    assert (~nan).any() and (case in ("prefix", "overflow-prefix")) == (not nan.any())
    out = prefix_shared_attention(q, k, v, cs, pk, pv, cp, sg, backend=backend)
    assert torch.equal(torch.isnan(out), nan), \
        f"NaN rows {torch.nonzero(torch.isnan(out).any(-1)).tolist()}, want {torch.nonzero(nan.any(-1)).tolist()}"
    _assert_close_fp32(out.masked_fill(nan, 0), ref.masked_fill(nan, 0), f"{path}, {case}")
