"""Property tests of the native CPU attention kernel (both ops) and of qk_norm_rope's page write,
against their plain-PyTorch oracles, on shapes hypothesis draws.

Attention (``prefix_shared_attention_paged`` and ``prefix_shared_attention``, backend "native"):
1–5 groups, prefixes of 0..~300 tokens (block multiples and ±1 likely), pages of every size the
op takes at shuffled ids in a pool with spare pages, some groups sharing their first blocks, NaN
in every page slot no group reads and -1 / ±2^31 ids in every block-table entry none reads; 0–6
segments of 1..70 tokens per group (at least one in all) in any order, GQA 1/2/4/8, head_dim
64/128/80, fp32 and bf16; q, the pools and the packed op's prefix rows contiguous or strided views
with NaN between their elements. fp32 within 1e-5 of
``prefix_shared_attention_ref``, bf16 by flash-attn's rule (both in
``test_op_cpu_attention_native._finite_and_within_the_rule``). The decode-like shape (one-token
segments: the direct-rows path where the CPU has AVX512_BF16) has its own test.

qk_norm_rope with pages (backend "native"): scattered slots (random or runs of consecutive
slots, as appends fill pages), positions in any order, GQA, head_dim, dtype; the caches start
full of a sentinel, and afterwards must be exactly the sentinel caches with the returned k, v
written at the slots (nothing else changed), the returned values within the suite's tolerance
of ``qk_norm_rope_ref``.

Examples per test: ``ACARERANK_FUZZ_EXAMPLES`` (default 25, derandomized so CI sees the same
ones; set, the examples are drawn afresh each run — e.g. 300 under ``scripts/sanitize.sh``).
"""
import os

import pytest
import torch

from _ext import needs_native
from _hypothesis import HealthCheck, given, settings, st
from acarerank.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_ref, write_pages_ref
from test_op_cpu_attention_native import _finite_and_within_the_rule, make
from test_op_qk_norm_rope_pages import _close_to_ref, _tables

pytestmark = [needs_native, pytest.mark.usefixtures("one_thread")]

def _fuzz_examples():
    """ACARERANK_FUZZ_EXAMPLES: None (unset, 25 fixed examples) or a positive count, drawn afresh."""
    raw = os.environ.get("ACARERANK_FUZZ_EXAMPLES")
    if raw is None:
        return None
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"ACARERANK_FUZZ_EXAMPLES must be a positive number of examples, got {raw!r}")
    return int(raw)


_FUZZ = _fuzz_examples()
FUZZ = settings(max_examples=_FUZZ or 25, deadline=None, derandomize=_FUZZ is None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])

BLOCK_SIZES = [16, 32, 64, 128, 256]  # paged_attention.check_block_size: powers of two in [16, 256]
PRIMES = [2, 3, 5, 7, 11, 13, 17, 31, 37, 53, 59, 61, 67]


@st.composite
def prefix_len(draw, block_size, most=300):
    """0..most, with exact multiples of the block size and ±1 likely."""
    return draw(st.one_of(st.integers(0, most),
                          st.builds(lambda m, e: max(0, min(most, m * block_size + e)),
                                    st.integers(0, most // block_size + 1), st.sampled_from([-1, 0, 1]))))


@st.composite
def attention_case(draw, decode=False, most=300, longest=70, dtypes=(torch.float32, torch.bfloat16)):
    """(make's args, make's keyword args, dtype, head_dim, the value of the block-table entries no
    group reads) of one call of the attention ops: prefixes of 0..most tokens, segments of
    1..longest tokens (wider ranges, other dtypes: for an ad hoc deep run)."""
    dtype = draw(st.sampled_from(dtypes))
    d = draw(st.sampled_from([64, 128, 80]))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from([1, 2, 4, 8]))
    bs = draw(st.sampled_from(BLOCK_SIZES))
    G = draw(st.integers(1, 5 if not decode else 8))
    prefix = [draw(prefix_len(bs, most)) for _ in range(G)]
    if decode:  # one-token segments, 1-2 per group: r or 2r rows against the whole prefix
        segs = [(g, 1) for g in range(G) for _ in range(draw(st.integers(1, 2)))]
    else:
        length = st.one_of(st.sampled_from(PRIMES), st.integers(1, longest))
        segs = [(g, draw(length)) for g in range(G) for _ in range(draw(st.integers(0, 6)))]
        if not segs:
            segs = [(draw(st.integers(0, G - 1)), draw(length))]
    segs = draw(st.permutations(segs))  # a group's segments need not be adjacent
    share = []
    for g in range(G):  # some groups start with another one's full blocks (a shared cached prefix)
        full = [h for h in range(G) if h != g and prefix[h] >= bs and prefix[g] > 0]
        if full and draw(st.booleans()):
            h = draw(st.sampled_from(full))
            n = draw(st.integers(1, min(prefix[h] // bs, -(-prefix[g] // bs))))
            share.append((g, h, n))
    args = ([n for _, n in segs], prefix, [g for g, _ in segs], Hq, Hkv, d, bs)
    kwargs = dict(dtype=dtype, seed=draw(st.integers(0, 2**31 - 1)), spare=draw(st.integers(1, 4)),
                  share=share, unused=float("nan"))
    junk = draw(st.sampled_from([-1, -(2**31), 2**31 - 1]))  # block-table entries no group reads
    return args, kwargs, dtype, d, junk


def _in_nan(t, steps):
    """A view equal to ``t`` inside a NaN-filled buffer, every ``steps[dim]``-th index along each
    given dim (head_dim stays unit-stride, as the kernel reads it): a read past the view is NaN."""
    if not steps:
        return t
    shape = [n * steps.get(i, 1) for i, n in enumerate(t.shape)]
    view = torch.full(shape, float("nan"), dtype=t.dtype)[tuple(slice(None, None, steps.get(i, 1))
                                                                for i in range(t.dim()))]
    view.copy_(t)
    return view


def _check_case(case, layout):
    """layout: (q's, the pools', the packed prefix rows') strides as ``_in_nan`` steps."""
    args, kwargs, dtype, d, junk = case
    q_steps, pool_steps, prefix_steps = layout
    (q, k, v, cu, kc, vc, bt, pl, sg), (_, _, _, _, pk, pv, cp, _) = make(*args, **kwargs)
    unread = torch.arange(bt.shape[1])[None, :] >= (pl[:, None] + kc.shape[1] - 1) // kc.shape[1]
    bt[unread] = junk  # entries past a group's ceil(P / block_size) are never read (nor checked)
    q, kc, vc = _in_nan(q, q_steps), _in_nan(kc, pool_steps), _in_nan(vc, pool_steps)
    pk, pv = _in_nan(pk, prefix_steps), _in_nan(pv, prefix_steps)
    _finite_and_within_the_rule((q, k, v, cu, kc, vc, bt, pl, sg), (q, k, v, cu, pk, pv, cp, sg), dtype, d)


# strides of q [T, Hq, d], the pools [blocks, block_size, Hkv, d], the packed prefix [Ptot, Hkv, d]
LAYOUTS = st.tuples(st.sampled_from([{}, {1: 2}, {0: 3}]), st.sampled_from([{}, {0: 2}, {1: 2}, {2: 2}]),
                    st.sampled_from([{}, {0: 2, 1: 2}, {0: 3}]))


@FUZZ
@given(case=attention_case(), layout=LAYOUTS)
def test_paged_and_packed_native_equal_the_oracle_on_drawn_shapes(case, layout):
    _check_case(case, layout)


@FUZZ
@given(case=attention_case(decode=True), layout=LAYOUTS)
def test_decode_like_calls_equal_the_oracle_on_drawn_shapes(case, layout):
    _check_case(case, layout)


# -- qk_norm_rope with pages ------------------------------------------------------------------
SENTINEL = 777.0  # exact in fp32 and bf16; the op writes no such value from these inputs


@st.composite
def page_write_case(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    d = draw(st.sampled_from([2, 8, 64, 96, 128, 256]))
    Hkv = draw(st.integers(1, 4))
    Hq = Hkv * draw(st.sampled_from([1, 2, 4, 8]))
    T = draw(st.integers(0, 80))
    bs = draw(st.sampled_from([1, 3, 16, 32, 256]))  # the op takes any page size
    num_blocks = -(-T // bs) + draw(st.integers(0, 3))
    num_blocks = max(num_blocks, 1)
    cap = num_blocks * bs
    if draw(st.booleans()):  # any distinct slots
        slots = draw(st.lists(st.integers(0, cap - 1), min_size=T, max_size=T, unique=True))
    else:  # consecutive slots through the pages in a shuffled order, from any start (as appends fill pages)
        order = draw(st.permutations(range(num_blocks)))
        slots = [b * bs + o for b in order for o in range(bs)]
        start = draw(st.integers(0, cap - T))
        slots = slots[start:start + T]
    return dict(dtype=dtype, d=d, Hq=Hq, Hkv=Hkv, T=T, bs=bs, num_blocks=num_blocks, slots=slots,
                pos0=draw(st.integers(0, 40000)), shuffle=draw(st.booleans()),
                tables=draw(st.sampled_from(["fp32", "dtype"])), strided=draw(st.booleans()),
                seed=draw(st.integers(0, 2**31 - 1)))


@FUZZ
@given(c=page_write_case())
def test_native_page_write_on_drawn_slots_changes_only_those_slots(c):
    dtype, d, Hq, Hkv, T = c["dtype"], c["d"], c["Hq"], c["Hkv"], c["T"]
    gen = torch.Generator().manual_seed(c["seed"])
    qkv = (torch.randn(T, (Hq + 2 * Hkv) * d, generator=gen) * 2).to(dtype)
    if c["strided"]:
        qkv = torch.cat([qkv, qkv], 1)[:, ::2]
    qw = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    kw = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    cos, sin = _tables(T, d, start=c["pos0"])
    if c["shuffle"]:  # positions in any order (rows of different sequences)
        perm = torch.randperm(T, generator=gen)
        cos, sin = cos[perm], sin[perm]
    if c["tables"] == "dtype":
        cos, sin = cos.to(dtype), sin.to(dtype)
    kc = torch.full((c["num_blocks"], c["bs"], Hkv, d), SENTINEL, dtype=dtype)
    vc = kc.clone()
    slots = torch.tensor(c["slots"], dtype=torch.int64)

    q, k, v = qk_norm_rope(qkv, qw, kw, cos, sin, Hq, Hkv, 1e-6, backend="native", k_cache=kc, v_cache=vc,
                           slots=slots)
    want_k, want_v = torch.full_like(kc, SENTINEL), torch.full_like(vc, SENTINEL)
    write_pages_ref(want_k, want_v, slots, k, v)
    for name, got, want in (("k_cache", kc, want_k), ("v_cache", vc, want_v)):
        wrong = (got != want).flatten(2).any(-1).nonzero()[:5].tolist()
        assert not wrong, f"{name}: (block, offset) rows other than the returned rows at their slots: {wrong}"
    rq, rk, rv = qk_norm_rope_ref(qkv, qw, kw, cos, sin, Hq, Hkv, 1e-6)
    _close_to_ref("q", q, rq, dtype)
    _close_to_ref("k", k, rk, dtype)
    assert torch.equal(v, rv), "v must be qkv's v columns unchanged"
