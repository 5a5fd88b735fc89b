"""prefix_shared_attention_paged == prefix_shared_attention on the same data.

Pages are filled with the gathered prefixes at shuffled block ids (so a wrong lookup reads
another group's values), groups share leading blocks, prefixes end mid-block or are empty.
torch: ≤ 1e-6 fp32 against the packed op and the plain oracle; Triton (interpreter, small
shapes) or on CUDA where a GPU is present (the module is then marked ``cuda``): bitwise equal to
the packed Triton kernel.
"""
import math

import pytest
import torch

from acarerank.ops import (BackendError, available_backends, plan_prefix_shared_attention_paged, prefix_shared_attention,
                           prefix_shared_attention_paged, prefix_shared_attention_paged_ref,
                           prefix_shared_attention_ref)

# Triton runs on the GPU where there is one (the interpreter is off there: CPU tensors would be refused)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []


def on(args, device=DEVICE):
    """A case's tensors on ``device``."""
    return [a.to(device) for a in args]


def make_case(prefix_lens, seg_lens, seg_group, Hq, Hkv, d, block_size, share=True, dtype=torch.float32, seed=0,
              consecutive=False):
    """Random pages + block table; returns (paged args, packed args). Group 1 reuses group 0's
    first full blocks when ``share`` (several groups pointing at the same pages).
    ``consecutive``: every group's blocks are one run of ids (as a prefill allocates them), the
    groups' runs in reverse order with a garbage page between them; no sharing."""
    g = torch.Generator().manual_seed(seed)
    G = len(prefix_lens)
    nblk = [-(-p // block_size) for p in prefix_lens]
    num_blocks = sum(nblk) + G + 3  # spare pages hold garbage that must never be read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, nxt = [], 0
    if consecutive:
        start = 1
        for gi in reversed(range(G)):
            tables.insert(0, list(range(start, start + nblk[gi])))
            start += nblk[gi] + 1
    for gi in range(G if not consecutive else 0):
        row = []
        for b in range(nblk[gi]):
            if share and gi == 1 and b < nblk[0] and (b + 1) * block_size <= min(prefix_lens[0], prefix_lens[1]):
                row.append(tables[0][b])  # a full block of group 0, shared
            else:
                row.append(perm[nxt])
                nxt += 1
        tables.append(row)
    max_blocks = max([len(r) for r in tables] + [1]) + 1  # one unused column (never read)
    bt = torch.full((G, max_blocks), -7, dtype=torch.int32)  # padding is deliberately invalid
    for gi, row in enumerate(tables):
        bt[gi, :len(row)] = torch.tensor(row, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, Hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, Hkv, d, generator=g).to(dtype)
    pk = torch.cat([k_cache[bt[gi, c // block_size], c % block_size][None] for gi in range(G)
                    for c in range(prefix_lens[gi])] or [k_cache.new_empty(0, Hkv, d)])
    pv = torch.cat([v_cache[bt[gi, c // block_size], c % block_size][None] for gi in range(G)
                    for c in range(prefix_lens[gi])] or [v_cache.new_empty(0, Hkv, d)])
    T = sum(seg_lens)
    q = torch.randn(T, Hq, d, generator=g).to(dtype)
    k = torch.randn(T, Hkv, d, generator=g).to(dtype)
    v = torch.randn(T, Hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0] + torch.tensor(seg_lens).cumsum(0).tolist(), dtype=torch.int32)
    sg = torch.tensor(seg_group, dtype=torch.int32)
    pl = torch.tensor(prefix_lens, dtype=torch.int32)
    cp = torch.tensor([0] + torch.tensor(prefix_lens).cumsum(0).tolist(), dtype=torch.int32)
    return (q, k, v, cu, k_cache, v_cache, bt, pl, sg), (q, k, v, cu, pk, pv, cp, sg)


def report(a, b):
    diff = (a.float() - b.float()).abs()
    i = int(diff.flatten().argmax())
    return f"max |diff| {diff.max().item():.3g} at flat index {i} (row {i // (a.shape[1] * a.shape[2])})"


CASES = [  # prefix_lens, seg_lens, seg_group
    ([37, 70], [5, 1, 9], [0, 1, 1]),            # mid-block ends, a decode-like 1-token segment
    ([0, 33], [3, 0, 4], [0, 1, 1]),             # empty prefix, empty segment
    ([300, 300, 17], [2, 7, 1, 6], [2, 0, 1, 0]),  # shared blocks, segments out of group order
]


@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (8, 2), (8, 1)])
@pytest.mark.parametrize("d", [64, 128])
def test_torch_paged_equals_packed(block_size, Hq, Hkv, d):
    for prefix_lens, seg_lens, seg_group in CASES:
        paged, packed = make_case(prefix_lens, seg_lens, seg_group, Hq, Hkv, d, block_size)
        out = prefix_shared_attention_paged(*paged, backend="torch")
        want = prefix_shared_attention(*packed, backend="torch")
        assert (out - want).abs().max().item() <= 1e-6, report(out, want)
        ref = prefix_shared_attention_ref(*packed)
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), report(out, ref)


IN_PLACE_CASES = CASES + [
    ([16, 48, 5], [3, 8, 2, 4], [1, 0, 2, 1]),   # whole-block and sub-block prefixes; group 1's segments apart
    ([0, 0], [4, 1], [0, 1]),                     # no prefix at all
]


def _plan(paged):
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    return plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                              head_dim=q.shape[2], block_size=kc.shape[1], num_blocks=kc.shape[0],
                                              dtype=q.dtype, backend="torch")


@pytest.mark.parametrize("block_size", [16, 32, 256])
@pytest.mark.parametrize("Hq,Hkv", [(2, 2), (8, 2), (6, 1)])
def test_torch_reads_consecutive_pages_in_place(block_size, Hq, Hkv):
    """Blocks in one run per group: the CPU path reads them as views of the pool. The plan's
    gather indices are then overwritten with another group's rows, so an answer that still
    equals the oracle cannot have come through a gather."""
    for prefix_lens, seg_lens, seg_group in IN_PLACE_CASES:
        paged, packed = make_case(prefix_lens, seg_lens, seg_group, Hq, Hkv, 64, block_size, consecutive=True)
        plan = _plan(paged)
        assert plan.aux[3].tolist() == [int(paged[6][g, 0]) if n else -1 for g, n in enumerate(prefix_lens)]
        plan.aux = (plan.aux[0].flip(0), plan.aux[1].flip(0), *plan.aux[2:])  # wrong rows if anything gathers
        out = prefix_shared_attention_paged(*paged, plan=plan)
        ref = prefix_shared_attention_ref(*packed)
        assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), (prefix_lens, report(out, ref))
        want = prefix_shared_attention(*packed, backend="torch")
        assert (out - want).abs().max().item() <= 1e-6, (prefix_lens, report(out, want))


def test_torch_scattered_or_unviewable_pages_are_gathered():
    """Scattered blocks (shared pages, shuffled ids) and a pool whose block stride is not
    block_size rows (pages of a [num_blocks, 2, ...] stack) are read through the gather indices."""
    paged, packed = make_case([37, 70], [5, 1, 9], [0, 1, 1], 4, 2, 32, 16)
    assert (_plan(paged).aux[3] == -2).all()  # cpu_paged_attention.SCATTERED
    paged, packed = make_case([37, 70], [5, 1, 9], [0, 1, 1], 4, 2, 32, 16, consecutive=True)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    big_k, big_v = torch.stack([kc, kc.neg()], dim=1)[:, 0], torch.stack([vc, vc.neg()], dim=1)[:, 0]
    assert big_k.stride(0) != big_k.shape[1] * big_k.stride(1)
    out = prefix_shared_attention_paged(q, k, v, cu, big_k, big_v, bt, pl, sg, plan=_plan(paged))
    ref = prefix_shared_attention_ref(*packed)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), report(out, ref)


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("consecutive", [False, True])
def test_cpu_paged_bf16_and_nan_rows(consecutive, backend):
    """bf16 pages through each CPU backend, asked for by name (the fp32-inside torch path, the
    native kernel), against the fp32 oracle on the same bf16 values; a NaN in q makes exactly
    that output row NaN, as in the oracle."""
    if backend not in available_backends("prefix_shared_attention_paged", "cpu"):
        pytest.skip(f"{backend} does not run here")
    paged, packed = make_case([37, 70], [5, 1, 9], [0, 1, 1], 8, 2, 64, 16, dtype=torch.bfloat16,
                              consecutive=consecutive)
    paged[0][3, 5, 7] = float("nan")
    paged = on(paged, "cpu")
    out = prefix_shared_attention_paged(*paged, backend=backend).float()
    ref = prefix_shared_attention_ref(*[t.float() if t.is_floating_point() else t for t in packed]).float()
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(out), nan) and nan[3, 5].all() and nan.sum() == 64, "NaN rows differ"
    assert torch.allclose(out[~nan], ref[~nan], atol=2e-2, rtol=2e-2), report(out.nan_to_num(), ref.nan_to_num())


def test_paged_ref_gathers_like_the_test():
    paged, packed = make_case([37, 70], [5, 1, 9], [0, 1, 1], 4, 2, 16, 16)
    assert torch.equal(prefix_shared_attention_paged_ref(*paged), prefix_shared_attention_ref(*packed))


def test_plan_reused_across_layers_and_strided_cache():
    paged, packed = make_case([37, 70], [5, 1, 9], [0, 1, 1], 4, 2, 32, 16)
    q, k, v, cu, kc, vc, bt, pl, sg = paged
    plan = plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=4, num_kv_heads=2, head_dim=32, block_size=16,
                                              num_blocks=kc.shape[0], dtype=q.dtype, backend="torch")
    # a non-contiguous pool (pages of a [L, num_blocks, ...] stack, every other layer)
    big_k = torch.stack([kc, kc.neg()], dim=1)[:, 0]
    big_v = torch.stack([vc, vc.neg()], dim=1)[:, 0]
    assert not big_k.is_contiguous()
    for _ in range(2):  # the same plan serves every layer
        out = prefix_shared_attention_paged(q, k, v, cu, big_k, big_v, bt, pl, sg, plan=plan)
        want = prefix_shared_attention(*packed, backend="torch")
        assert (out - want).abs().max().item() <= 1e-6, report(out, want)


@pytest.mark.parametrize("backend", [b for b in available_backends("prefix_shared_attention_paged", "cpu")
                                     if b != "triton"])
@pytest.mark.parametrize("strided", ["q", "k", "v", "k_cache", "v_cache"])
def test_head_dim_strided_inputs(backend, strided):
    """One input at a time with head_dim not at unit stride (transposed storage, or every other
    element): equal to the packed oracle. torch's private CPU flash kernel reads head_dim at unit
    stride whatever the tensor says, so the torch backend returned wrong values for such views."""
    paged, packed = make_case([37, 70], [5, 1, 9], [0, 1, 1], 4, 2, 16, 16)
    args = dict(zip(("q", "k", "v", "cu", "k_cache", "v_cache", "bt", "pl", "sg"), paged))
    t = args[strided]
    args[strided] = (torch.stack([t, -t], dim=-1)[..., 0] if strided in ("k", "v_cache")
                     else t.movedim(-1, 0).contiguous().movedim(0, -1))
    assert torch.equal(args[strided], t) and args[strided].stride(-1) != 1
    out = prefix_shared_attention_paged(*args.values(), backend=backend)
    want = prefix_shared_attention_ref(*packed)
    assert (out - want).abs().max().item() <= 1e-5, report(out, want)


TRITON_CASES = [
    (16, 2, 2, 64, [37, 70], [5, 1, 9], [0, 1, 1]),
    (64, 8, 2, 64, [0, 33], [3, 0, 4], [0, 1, 1]),
    (256, 4, 4, 128, [300, 300, 17], [2, 7, 1, 6], [2, 0, 1, 0]),
    (16, 8, 1, 64, [40, 40], [3, 2], [1, 0]),
]


@pytest.mark.parametrize("block_size,Hq,Hkv,d,prefix_lens,seg_lens,seg_group", TRITON_CASES)
def test_triton_paged_bitwise_equals_packed(block_size, Hq, Hkv, d, prefix_lens, seg_lens, seg_group):
    paged, packed = make_case(prefix_lens, seg_lens, seg_group, Hq, Hkv, d, block_size)
    out = prefix_shared_attention_paged(*on(paged), backend="triton")
    want = prefix_shared_attention(*on(packed), backend="triton")
    assert torch.equal(out, want), report(out, want)
    out, ref = out.cpu(), prefix_shared_attention_ref(*packed)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), report(out, ref)


def test_triton_paged_bf16_bitwise_equals_packed():
    paged, packed = make_case([37, 20], [4, 3], [0, 1], 4, 2, 64, 16, dtype=torch.bfloat16)
    out = prefix_shared_attention_paged(*on(paged), backend="triton")
    want = prefix_shared_attention(*on(packed), backend="triton")
    assert torch.equal(out, want), report(out, want)


def test_the_triton_kernel_refuses_a_strided_block_table_the_op_copies_it():
    """The kernel reads block ids at unit stride along a row: a strided view given to it directly is
    a clear error (never ids of another column); the op's triton backend copies such a table
    once, so it reads it as the torch backend does (every backend: test_strided_metadata)."""
    from acarerank.kernels.prefix_shared_attention import prefix_shared_attention_paged_triton

    paged, packed = make_case([37, 70], [5, 1, 9], [0, 1, 1], 4, 2, 64, 16)
    paged = on(paged)
    bt = paged[6]
    wide = torch.full((bt.shape[0], 2 * bt.shape[1]), -7, dtype=torch.int32, device=bt.device)
    wide[:, ::2] = bt
    paged[6] = wide[:, ::2]  # same values, stride (2·max_blocks, 2)
    assert paged[6].stride(1) == 2 and torch.equal(paged[6], bt)
    q, k, v, cu, kc, vc, table, pl, sg = paged
    cp = torch.zeros(pl.numel() + 1, dtype=torch.int32, device=pl.device)
    cp[1:] = pl.cumsum(0)
    with pytest.raises(ValueError, match="block_table must be unit-stride"):
        prefix_shared_attention_paged_triton(q, k, v, cu, kc, vc, table, cp, sg, 1.0 / math.sqrt(q.shape[-1]))
    ref = prefix_shared_attention_ref(*packed)
    for backend in ("triton", "torch"):
        out = prefix_shared_attention_paged(*paged, backend=backend)
        assert torch.allclose(out.cpu(), ref, atol=2e-5, rtol=1e-5), (backend, report(out.cpu(), ref))


def _args():
    return list(make_case([37, 70], [5, 1, 9], [0, 1, 1], 4, 2, 16, 16)[0])


@pytest.mark.parametrize("mutate,match", [
    (lambda a: a.__setitem__(6, a[6].clone().index_fill_(1, torch.tensor([0]), 999)), "block id 999"),
    (lambda a: a.__setitem__(7, torch.tensor([37, 16 * 6 + 1], dtype=torch.int32)), "longer than its"),
    (lambda a: a.__setitem__(6, a[6].long()), "block_table must be a 2-D int32"),
    (lambda a: a.__setitem__(7, a[7].long()), "prefix_lens must be a 1-D int32"),
    (lambda a: a.__setitem__(4, a[4].double()), "k_cache dtype"),
    (lambda a: (a.__setitem__(4, a[4][:, :12]), a.__setitem__(5, a[5][:, :12])), "power of two"),
    (lambda a: (a.__setitem__(4, a[4][:, :8]), a.__setitem__(5, a[5][:, :8])), "power of two"),
    (lambda a: a.__setitem__(5, a[5][:-1]), "differ"),
    (lambda a: a.__setitem__(7, a[7][:1]), "prefix_lens has 1 entries"),
    (lambda a: a.__setitem__(8, torch.tensor([0, 1, 2], dtype=torch.int32)), "segment_group values"),
])
def test_bad_input_is_a_clear_error(mutate, match):
    a = _args()
    mutate(a)
    with pytest.raises((ValueError, TypeError), match=match):
        prefix_shared_attention_paged(*a, backend="torch")


@pytest.mark.parametrize("backend", [b for b in ("torch", "native", "triton") if b in available_backends(
    "prefix_shared_attention_paged", "cpu")])
@pytest.mark.parametrize("which", ["-1", "-num_blocks", "num_blocks"])
def test_block_id_out_of_range_is_refused_without_validate_on_the_host(backend, which):
    """validate=False skips the metadata checks that need a device sync, but a block id out of
    range in a host table read another page (torch indexing wraps -1 to the last page): a wrong
    output with no error. On the CPU the used ids are range-checked whatever ``validate``."""
    a = on(_args(), "cpu")
    nb = a[4].shape[0]
    bad = {"-1": -1, "-num_blocks": -nb, "num_blocks": nb}[which]
    a[6] = a[6].clone()
    a[6][1, 0] = bad  # group 1's first block: read by every one of its rows
    with pytest.raises(ValueError, match=f"block id {bad} in block_table is out of range"):
        prefix_shared_attention_paged(*a, backend=backend, validate=False)
    # an unused entry (past ceil(P_g / block_size)) is never read, so never refused
    a = on(_args(), "cpu")
    a[6] = torch.cat([a[6], torch.full((2, 1), bad, dtype=torch.int32)], 1)
    got = prefix_shared_attention_paged(*a, backend=backend, validate=False)
    want = prefix_shared_attention_paged_ref(*a)
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), report(got, want)


@pytest.mark.parametrize("backend", [b for b in ("torch", "native") if b in available_backends(
    "prefix_shared_attention_paged", "cpu")])
@pytest.mark.parametrize("field,value", [("segment_group", [-1, -1, -1]), ("segment_group", [0, 2, 1]),
                                         ("cu_seqlens", [0, 5, 6, 12]), ("cu_seqlens", [0, 6, 5, 15])])
def test_bad_metadata_is_refused_on_the_cpu_without_validate(backend, field, value):
    """validate=False skips the metadata checks that need a device sync; on the CPU the torch
    backend indexed Python lists with the values unchecked: a segment_group of -1 killed the
    process (SIGFPE in torch's flash kernel, given no keys). It now checks the host copy it reads
    (as the native kernel does): a clear error naming the field, on every CPU backend."""
    a = on(_args(), "cpu")
    a[{"cu_seqlens": 3, "segment_group": 8}[field]] = torch.tensor(value, dtype=torch.int32)
    with pytest.raises((ValueError, RuntimeError), match=field):
        prefix_shared_attention_paged(*a, backend=backend, validate=False)


@pytest.mark.parametrize("backend", [b for b in ("torch", "native") if b in available_backends(
    "prefix_shared_attention_paged", "cpu")])
def test_an_infinite_prefix_value_stays_infinite(backend):
    """A −inf prefix value with a weight ≥ 0.5 gave NaN on the torch backend (its merge was
    torch.lerp, which computes end − (end − start)·(1 − w): −inf − (−inf)); the oracle gives −inf."""
    a = on(_args(), "cpu")
    q, k, v, cu, kc, vc, table, pl, sg = a
    kc, vc = kc.clone(), vc.clone()
    kc[table[0, 0], 0] = 0.0           # group 0's first prefix key: score 0 for every query
    k = k * 0.01                       # own keys close to score 0 too: the prefix weighs most
    vc[table[0, 0], 0, :, 0] = float("-inf")
    a = [q, k, v, cu, kc, vc, table, pl, sg]
    got = prefix_shared_attention_paged(*a, backend=backend)
    want = prefix_shared_attention_paged_ref(*a)
    rows = slice(0, int(cu[1]))        # segment 0 (group 0)
    assert torch.isneginf(want[rows, :, 0]).all(), want[rows, :, 0]
    assert torch.equal(torch.isneginf(got[:, :, 0]), torch.isneginf(want[:, :, 0])), (got[:, :, 0], want[:, :, 0])
    assert not torch.isnan(got).any(), got.isnan().nonzero()[:5]


def test_unknown_backend_is_a_backend_error():
    with pytest.raises(BackendError, match="has no 'cpp' backend"):
        prefix_shared_attention_paged(*_args(), backend="cpp")


def test_registered_op_passes_opcheck():
    """The custom op behind the public function: schema, fake tensor and dispatch checks."""
    from acarerank.ops.paged_attention import prefix_shared_attention_paged_op

    q, k, v, cu, kc, vc, bt, pl, sg = _args()
    plan = plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=q.shape[1], num_kv_heads=k.shape[1],
                                              head_dim=q.shape[2], block_size=kc.shape[1], num_blocks=kc.shape[0],
                                              dtype=q.dtype, backend="torch")
    torch.library.opcheck(prefix_shared_attention_paged_op,
                          (q, k, v, cu, kc, vc, plan.block_table, plan.cu_prefix_lens, sg, list(plan.aux), 0.25,
                           "torch"))


def test_plan_mismatch_and_plan_validation_are_errors():
    q, k, v, cu, kc, vc, bt, pl, sg = _args()
    plan = plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16,
                                              num_blocks=kc.shape[0], dtype=q.dtype, backend="torch")
    with pytest.raises(ValueError, match="plan was built for"):
        prefix_shared_attention_paged(q[:-1], k[:-1], v[:-1], cu, kc, vc, bt, pl, sg, plan=plan)
    # heads, head_dim and dtype too, as the packed op's plan: the Triton work list is built for them
    assert (plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.dtype) == (4, 2, 16, q.dtype)
    for qq, kk, vv, kcc, vcc in ((q[:, :2], k, v, kc, vc),                             # Hq 2, not 4
                                 (q[..., :8], k[..., :8], v[..., :8], kc[..., :8], vc[..., :8]),  # d 8, not 16
                                 (q.bfloat16(), k.bfloat16(), v.bfloat16(), kc.bfloat16(), vc.bfloat16())):
        with pytest.raises(ValueError, match="plan was built for"):
            prefix_shared_attention_paged(qq, kk, vv, cu, kcc, vcc, bt, pl, sg, plan=plan)
    with pytest.raises(ValueError, match="not with plan="):
        prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg, backend="torch", plan=plan)
    with pytest.raises(ValueError, match="segment_group values"):
        plan_prefix_shared_attention_paged(cu, bt, pl, torch.tensor([0, 1, 5], dtype=torch.int32), num_heads=4,
                                           num_kv_heads=2, head_dim=16, block_size=16, num_blocks=kc.shape[0],
                                           dtype=q.dtype)



def test_tables_beside_a_plan_must_be_the_plans():
    """With a plan the plan's tables run: a block table (or prefix lengths, cu_seqlens, segment
    groups) of another batch passed beside it was ignored without a word — the output was the old
    batch's attention. It is an error now; the plan's own tensors (what the runner passes) run."""
    q, k, v, cu, kc, vc, bt, pl, sg = _args()
    backends = [b for b in available_backends("prefix_shared_attention_paged", "cpu") if b != "triton"]
    for backend in backends:
        plan = plan_prefix_shared_attention_paged(cu, bt, pl, sg, num_heads=4, num_kv_heads=2, head_dim=16,
                                                  block_size=16, num_blocks=kc.shape[0], dtype=q.dtype,
                                                  backend=backend)
        want = prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg, backend=backend)
        out = prefix_shared_attention_paged(q, k, v, cu, kc, vc, bt, pl, sg, plan=plan)
        assert torch.equal(out, want)
        bt2, pl2 = bt.flip(0).contiguous(), pl.flip(0).contiguous()  # the groups' prefixes swapped
        for args in ((bt2, pl2, sg, cu), (bt.clone(), pl, sg, cu), (bt, pl.clone(), sg, cu),
                     (bt, pl, sg.clone(), cu), (bt, pl, sg, cu.clone())):
            b, p, g, c = args
            with pytest.raises(ValueError, match="differ from the plan's"):
                prefix_shared_attention_paged(q, k, v, c, kc, vc, b, p, g, plan=plan)


@pytest.mark.parametrize("scale,error", [(0.0, ValueError), (-0.25, ValueError), (float("nan"), ValueError),
                                         (float("inf"), ValueError), (1e39, ValueError), (1e-50, ValueError),
                                         (True, TypeError), ("0.25", TypeError)])
def test_bad_softmax_scale_is_refused_as_by_the_packed_op(scale, error):
    """The paged op took any scale: on the torch backend a scale <= 0 or NaN gave NaN rows and no
    error (the native kernel refused it; the packed op refuses it before any backend). 1e39 and
    1e-50 are finite and > 0 in double but inf / 0 in the kernels' fp32: NaN rows on the native
    and torch backends, no error."""
    a = _args()
    for backend in [b for b in available_backends("prefix_shared_attention_paged", "cpu") if b != "triton"]:
        with pytest.raises(error, match="prefix_shared_attention_paged: softmax_scale"):
            prefix_shared_attention_paged(*a, softmax_scale=scale, backend=backend)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_paged_flash_cascade_on_cuda():
    """The paged cascade (flash-attn reading the pages through its block_table + the merge) at
    Qwen3 heads in bf16, against the fp32 oracle by flash-attn's 2x rule."""
    import math

    from test_op_attention import _plain_attention
    cascade = pytest.importorskip("acarerank.ops.cascade", reason="no FlashAttention-2 kernel here")
    if not cascade.VARLEN_KERNEL.startswith("flash-attn"):
        pytest.skip(f"the paged cascade reads pages through flash-attn's block_table; here: {cascade.VARLEN_KERNEL}")
    paged, packed = make_case([300, 700, 17], [2, 7, 1, 64], [2, 0, 1, 0], 16, 8, 128, 256, dtype=torch.bfloat16)
    out = prefix_shared_attention_paged(*on(paged), backend="flash_attn_cascade").float().cpu()
    q, k, v, cu, pk, pv, cp, sg = packed
    ref = prefix_shared_attention_ref(q.float(), k.float(), v.float(), cu, pk.float(), pv.float(), cp, sg)
    plain = _plain_attention(*on(packed), 1.0 / math.sqrt(128)).float().cpu()
    err, err_plain = (out - ref).abs().max().item(), (plain - ref).abs().max().item()
    atol = 2 * (ref + 0.3 - 0.3 - ref).abs().max().item()
    assert err <= 2 * err_plain + atol, f"paged cascade err {err:.3e} vs plain bf16 {err_plain:.3e}"


@pytest.mark.parametrize("backend", available_backends("prefix_shared_attention_paged", "cpu"))
def test_strided_metadata(backend):
    """cu_seqlens / prefix_lens / segment_group as strided views (every other entry of a buffer
    of garbage) give the packed reference: the Triton kernel read them at unit stride (here a
    segfault: garbage offsets)."""
    (q, k, v, cu, kc, vc, bt, pl, sg), packed = make_case([5, 9], [3, 0, 4], [0, 1, 1], 4, 2, 16, 16)

    def every_other(t):
        buf = torch.full((2 * t.numel(),), 99, dtype=t.dtype)
        buf[::2] = t
        return buf[::2]

    cu2, pl2, sg2 = (every_other(t) for t in (cu, pl, sg))
    out = prefix_shared_attention_paged(q, k, v, cu2, kc, vc, bt, pl2, sg2, backend=backend)
    ref = prefix_shared_attention_ref(*packed)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), report(out, ref)
    # a block table strided along its blocks (every other column of a wider one): every backend
    # takes it (the Triton one refused it while the others read it as it is)
    wide = torch.full((bt.shape[0], 2 * bt.shape[1]), 10**6, dtype=bt.dtype)
    wide[:, ::2] = bt
    out = prefix_shared_attention_paged(q, k, v, cu, kc, vc, wide[:, ::2], pl, sg, backend=backend)
    assert torch.allclose(out, ref, atol=2e-5, rtol=1e-5), report(out, ref)


def _minus_inf_pages(case, consecutive):
    """Paged fp32 inputs (CPU) where some rows' scores over their own keys, their prefix pages or
    both are all −inf (a −inf in k or in the pages against a positive q, a q holding +inf against
    keys negative there, or 1e20 · −1e20 past fp32's range from finite inputs). Segments
    [3, 3, 3]: segments 0 and 1 in group 0 (a prefix of 37 tokens, mid-block), 2 in group 1 (none)."""
    paged, _ = make_case([37, 0], [3, 3, 3], [0, 0, 1], 4, 2, 16, 16, consecutive=consecutive)
    q, k, v, cu, kc, vc, bt, pl, sg = on(paged, "cpu")
    q.abs_()
    ninf = float("-inf")
    if case == "own-key":        # row 0: its one own key; row 6 (no prefix), kv head 0: NaN as plain softmax
        k[0, :, 0] = ninf
        k[6, 0, 0] = ninf
    elif case == "prefix":       # every page: group 0's rows see their own keys only
        kc[..., 0] = ninf
    elif case == "both":         # row 3 sees no key above −inf: NaN
        kc[..., 0] = ninf
        k[3, :, 0] = ninf
    elif case == "q-inf":        # +inf · (−1) on every key: rows (1, 0) and (4, 3) NaN
        k[..., 0], kc[..., 0] = -1.0, -1.0
        q[1, 0, 0] = q[4, 3, 0] = float("inf")
    elif case == "overflow-prefix":
        q[..., 0], kc[..., 0], k[..., 0] = 1e20, -1e20, 0.0
    elif case == "overflow-own":
        q[..., 0], k[..., 0], kc[..., 0] = 1e20, -1e20, 0.0
    return q, k, v, cu, kc, vc, bt, pl, sg


@pytest.mark.parametrize("case", ["own-key", "prefix", "both", "q-inf", "overflow-prefix", "overflow-own"])
@pytest.mark.parametrize("path", ["torch-pages", "torch-gathered", "native", "triton"])
@pytest.mark.parametrize("consecutive", [False, True])
def test_scores_all_minus_inf_in_one_part_weigh_nothing(case, path, consecutive, monkeypatch):
    """As the packed op's test of the same name: keys whose scores are all −inf in the prefix part
    or the own part of a row weigh nothing (the reference's softmax), a row without a finite
    score is NaN. The CPU torch path took torch's fused flash kernel's lse 0 for such a block
    (it is −inf) and merged a wrong finite row, no error. "torch-gathered": the path other devices
    take (prefix rows gathered into the packed torch backend)."""
    from acarerank.ops import cpu_paged_attention
    backend = path if path in ("native", "triton") else "torch"
    if backend not in available_backends("prefix_shared_attention_paged", "cpu"):
        pytest.skip(f"{backend} does not run here")
    if path == "torch-gathered":
        monkeypatch.setattr(cpu_paged_attention, "available", lambda q: False)
    paged = _minus_inf_pages(case, consecutive)
    ref = prefix_shared_attention_paged_ref(*paged)
    nan = torch.isnan(ref)
    assert (~nan).any() and (case in ("prefix", "overflow-prefix")) == (not nan.any())
    out = prefix_shared_attention_paged(*paged, backend=backend)
    assert torch.equal(torch.isnan(out), nan), \
        f"NaN rows {torch.nonzero(torch.isnan(out).any(-1)).tolist()}, want {torch.nonzero(nan.any(-1)).tolist()}"
    assert (out.masked_fill(nan, 0) - ref.masked_fill(nan, 0)).abs().max().item() <= 1e-5, report(out, ref)
