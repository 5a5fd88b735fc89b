"""Streaming top-k merge (the op ``topk_merge_update``, csrc/topk_merge.cuh) against the one top-k oracle.

The "cpp" backend runs the exact row algorithm of the CUDA kernel (radix select + bitonic
sort, one thread per row); "torch" is the plain sort-based update. Both must give the ids
of a stable descending sort of the full 151,669-wide logits (ties: lower id first) and
log-probs within 1e-6 of fp64 math, whatever the chunking.
"""
import numpy as np
import pytest
import torch

from acarerank.ops import BackendError, available_backends, topk_logprobs_core, topk_logprobs_ref
from acarerank.ops import topk_merge as tm

V = 151_669  # Qwen3 vocabulary
BACKENDS = available_backends("topk_merge_update", "cpu")  # declaring a backend tests it
LOGPROB_ATOL = 1e-6


class _Fields(dict):
    __getattr__ = dict.get


def _fields(renorm, full, topk_logits, lse=None):
    """The compared quantities from two finalizations (outside="full"; renormalised, and over V)."""
    has_t = renorm.in_topk is not None
    return _Fields(
        ids=renorm.topk_ids, topk_logits=topk_logits, logprobs=renorm.topk_logprobs, logprobs_full=full.topk_logprobs,
        logsumexp=lse, target_logprob=full.target_logprob if has_t else None,
        target_logprob_topk=torch.where(renorm.in_topk, renorm.target_logprob, float("-inf")) if has_t else None,
        target_in_topk=renorm.in_topk)


def _ref(logits, k, targets=None, temperature=1.0):
    """``topk_logprobs_ref`` on the logits themselves (weight=None), both normalisations."""
    kw = dict(targets=targets, k=k, outside="full", temperature=temperature)
    renorm = topk_logprobs_ref(logits, None, renormalize=True, **kw)
    full = topk_logprobs_ref(logits, None, renormalize=False, **kw)
    v = logits.float() / temperature if temperature != 1.0 else logits.float()
    return _fields(renorm, full, v.gather(1, renorm.topk_ids),
                   torch.logsumexp(v.double(), dim=1).float())


def _finalized(state):
    vals, ids, tl, lse = tm.topk_merge_core(state)
    return _fields(tm.topk_merge_finalize(state, outside="full", renormalize=True),
                   tm.topk_merge_finalize(state, outside="full", renormalize=False), vals, lse)


def _random_chunks(rng, width, max_chunk):
    """Random partition of [0, width) into [a, b) pieces of 1..max_chunk columns."""
    bounds, a = [], 0
    while a < width:
        b = min(width, a + int(rng.integers(1, max_chunk + 1)))
        bounds.append((a, b))
        a = b
    return bounds


def _logits(kind, T, gen):
    if kind == "normal":
        return torch.randn(T, V, generator=gen) * 3
    if kind == "ties":  # 33 distinct values: every top-k boundary is a tie
        return torch.randint(-16, 17, (T, V), generator=gen).float() / 4
    if kind == "neg_inf":  # masked vocabulary; row 0 has only 50 finite logits (< k)
        x = torch.randn(T, V, generator=gen)
        x[torch.rand(T, V, generator=gen) < 0.4] = float("-inf")
        x[0] = float("-inf")
        x[0, torch.randperm(V, generator=gen)[:50]] = torch.randn(50, generator=gen)
        return x
    if kind == "signed_zeros":  # −0.0 and +0.0 must tie (lower id first), as in torch
        x = torch.where(torch.rand(T, V, generator=gen) < 0.5, -0.5, 0.0)
        x[(x == 0) & (torch.rand(T, V, generator=gen) < 0.5)] = -0.0
        x[:, torch.randperm(V, generator=gen)[:20]] = 0.5  # fewer than k: the top-k boundary is among the zeros
        assert (x == 0).any() and torch.signbit(x[x == 0]).any() and not torch.signbit(x[x == 0]).all()
        return x
    raise ValueError(kind)


def _targets(ref_ids, gen):
    """Row 0: target inside the top-k (at rank 3); other rows: random ids, mostly outside."""
    T = ref_ids.shape[0]
    t = torch.randint(0, V, (T,), generator=gen)
    t[0] = ref_ids[0, min(3, ref_ids.shape[1] - 1)]
    return t


def _merge(logits, k, targets, temperature, pieces, backend):
    state = tm.topk_merge_init(logits.shape[0], k, logits.device, targets=targets, temperature=temperature)
    for a, b in pieces:
        tm.topk_merge_update(state, logits[:, a:b], a, backend=backend)
    return _finalized(state)


def assert_topk_equal(got, want, atol=LOGPROB_ATOL):
    if not torch.equal(got.ids.cpu(), want.ids.cpu()):
        bad = (got.ids.cpu() != want.ids.cpu()).nonzero()[:5].tolist()
        detail = [(r, c, int(got.ids[r, c]), int(want.ids[r, c]), float(want.topk_logits[r, c])) for r, c in bad]
        raise AssertionError(f"top-k ids differ at (row, rank, got id, want id, want value): {detail}")
    assert torch.equal(got.topk_logits.cpu(), want.topk_logits.cpu()), "top-k values differ"
    for name in ("logprobs", "logprobs_full", "logsumexp", "target_logprob", "target_logprob_topk"):
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            continue
        # the core hands the finalize an fp32 log-sum-exp: one fp32 rounding (rtol) beyond fp64 math
        torch.testing.assert_close(g.cpu(), w.cpu(), atol=atol, rtol=2.4e-7, equal_nan=True,
                                   msg=lambda m, name=name: f"{name}: {m}")
    if want.target_in_topk is not None:
        assert torch.equal(got.target_in_topk.cpu(), want.target_in_topk.cpu()), "target_in_topk differs"


CASES = [  # (logits kind, k, widest chunk, temperature)
    ("normal", 128, 40_000, 1.0),
    ("normal", 1, 9_000, 0.7),
    ("ties", 128, 300, 1.0),          # k larger than most chunks; ~1000 merges
    ("neg_inf", 200, 5_000, 1.0),
    ("signed_zeros", 97, 20_000, 1.3),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,k,max_chunk,temperature", CASES)
def test_streaming_merge_matches_full_sort(backend, kind, k, max_chunk, temperature):
    gen = torch.Generator().manual_seed(k + len(kind))
    rng = np.random.default_rng(k)
    logits = _logits(kind, 3, gen)
    targets = _targets(_ref(logits, k, temperature=temperature).ids, gen)
    want = _ref(logits, k, targets, temperature)
    got = _merge(logits, k, targets, temperature, _random_chunks(rng, V, max_chunk), backend)
    assert_topk_equal(got, want)
    assert bool(want.target_in_topk[0]) and not bool(want.target_in_topk.all()), "test needs targets in and out of the top-k"


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_order_does_not_matter(backend):
    gen = torch.Generator().manual_seed(5)
    rng = np.random.default_rng(5)
    logits = _logits("ties", 2, gen)
    pieces = _random_chunks(rng, V, 20_000)
    rng.shuffle(pieces)
    want = _ref(logits, 128)
    assert_topk_equal(_merge(logits, 128, None, 1.0, pieces, backend), want)


@pytest.mark.parametrize("buf_cap", [1, 100, 5000])
def test_candidate_buffer_overflow_path(buf_cap):
    """A small pass-0 buffer forces the chunk re-read path (the GPU's path on a first chunk)."""
    from acarerank.ops import _cpp
    gen = torch.Generator().manual_seed(buf_cap)
    logits = _logits("ties", 2, gen)
    targets = torch.tensor([7, 150_000])
    want = _ref(logits, 128, targets)
    state = tm.topk_merge_init(2, 128, "cpu", targets=targets)
    for a, b in _random_chunks(np.random.default_rng(buf_cap), V, 30_000):
        _cpp.topk_update(state, logits[:, a:b], a, cuda=False, buf_cap=buf_cap)
    assert_topk_equal(_finalized(state), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_chunks(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, V, generator=gen) * 4).to(dtype)  # bf16: thousands of ties
    want = _ref(logits, 128)
    assert_topk_equal(_merge(logits, 128, None, 1.0, [(a, min(V, a + 16384)) for a in range(0, V, 16384)], "cpp"), want)


def test_k_max_and_one_row_wide_vocab():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 20_000, generator=gen)
    want = _ref(logits, tm.TOPK_MAX_K)
    state = tm.topk_merge_init(1, tm.TOPK_MAX_K, "cpu")
    for a in range(0, 20_000, 3000):
        tm.topk_merge_update(state, logits[:, a:a + 3000], a, backend="cpp")
    assert_topk_equal(_finalized(state), want)


# ---------------------------------------------------------------- the drivers for topk_logprobs
def _integer_model(T, H, gen, dtype, vocab=V):
    """Small-integer hidden/weight: every logit is exact in any GEMM order, so ids can be compared exactly."""
    hidden = torch.randint(-3, 4, (T, H), generator=gen).to(dtype)
    weight = torch.randint(-2, 3, (vocab, H), generator=gen).to(dtype)
    return hidden, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,chunk,temperature", [
    (V, 4096 + 7, 1.0), (30_011, 100, 0.5),  # chunk < k: every merge straddles the top-k
    (V, V, 2.0), (V, None, 1.0)])
def test_core_cpp_matches_reference(dtype, vocab, chunk, temperature):
    gen = torch.Generator().manual_seed(3)
    hidden, weight = _integer_model(5, 16, gen, dtype, vocab)
    targets = torch.randint(0, vocab, (5,), generator=gen, dtype=torch.int32 if chunk is None else torch.int64)
    logits = (hidden.float() @ weight.float().t())
    want = _ref(logits, 128, targets.long(), temperature)
    vals, ids, target_logit, lse = topk_logprobs_core(hidden, weight, targets, 128, chunk, temperature, backend="cpp")
    assert vals.dtype == torch.float32 and ids.dtype == torch.int64 and vals.shape == ids.shape == (5, 128)
    assert torch.equal(ids, want.ids), f"ids differ in rows {(ids != want.ids).any(1).nonzero().flatten().tolist()}"
    assert torch.equal(vals, want.topk_logits)
    assert torch.equal(target_logit, logits.gather(1, targets.long()[:, None])[:, 0] / temperature)
    torch.testing.assert_close(lse, want.logsumexp, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_topk_logprobs_op_cpp_backend_equals_torch_backend(dtype):
    """Through the user-facing op: the "cpp" core and the "torch" core agree (ids exactly)."""
    from acarerank.ops.topk_logprobs import topk_logprobs
    gen = torch.Generator().manual_seed(6)
    hidden, weight = _integer_model(4, 16, gen, dtype)
    targets = torch.randint(0, V, (4,), generator=gen)
    targets[0] = int((hidden[0].float() @ weight.float().t()).argmax())  # one target inside the top-k
    for outside in ("floor", "full"):
        got = topk_logprobs(hidden, weight, targets, k=128, chunk=5000, outside=outside, temperature=0.9, backend="cpp")
        want = topk_logprobs(hidden, weight, targets, k=128, chunk=5000, outside=outside, temperature=0.9,
                             backend="torch")
        assert torch.equal(got.topk_ids, want.topk_ids) and torch.equal(got.in_topk, want.in_topk)
        assert bool(got.in_topk[0])
        torch.testing.assert_close(got.topk_logprobs, want.topk_logprobs, atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(got.target_logprob, want.target_logprob, atol=LOGPROB_ATOL, rtol=0)


def test_core_random_floats_and_empty_batch():
    gen = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(3, 64, generator=gen), torch.randn(V, 64, generator=gen) * 0.1
    targets = torch.randint(0, V, (3,), generator=gen)
    vals, ids, target_logit, lse = topk_logprobs_core(hidden, weight, targets, 128, 8192, 1.0, backend="cpp")
    logits = hidden @ weight.t()
    # chunked and full GEMMs may round differently: compare values at our ids, and the lse
    torch.testing.assert_close(vals, logits.gather(1, ids), atol=1e-5, rtol=1e-5)
    assert bool((vals[:, :-1] >= vals[:, 1:]).all()), "values not descending"
    torch.testing.assert_close(lse, torch.logsumexp(logits.double(), 1).float(), atol=1e-5, rtol=0)
    out = topk_logprobs_core(hidden[:0], weight, targets[:0], 128, 8192, 1.0, backend="cpp")
    assert [tuple(t.shape) for t in out] == [(0, 128), (0, 128), (0,), (0,)]


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs,err,match", [
    (dict(k=0), ValueError, "k must be >= 1, got k=0"),
    (dict(k=tm.TOPK_MAX_K + 1, weight=torch.zeros(5000, 8)), ValueError,
     "k must be <= 4096 with the 'cpp' backend, got k=4097; use 'torch' \\(any k\\)"),
    (dict(k=2.0), TypeError, "k must be an int"),
    (dict(chunk=0), ValueError, "chunk"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(targets=torch.tensor([0, 1000])), ValueError, r"target id 1000 is out of range \[0, V=1000\)"),
    (dict(targets=torch.tensor([0, -1])), ValueError, "target id -1 is out of range"),
    (dict(targets=torch.tensor([0, 1], dtype=torch.int16)), TypeError, "int64"),
    (dict(chunk=2.5), ValueError, "chunk"),
    (dict(weight=torch.zeros(1000, 8, dtype=torch.float64)), TypeError, "cast one of them"),
    (dict(weight=torch.zeros(1000, 9)), ValueError, "hidden has H=8 but weight has H=9"),
])
def test_core_bad_input(kwargs, err, match):
    args = dict(hidden=torch.zeros(2, 8), weight=torch.zeros(1000, 8), targets=torch.tensor([0, 1]),
                k=4, chunk=64, temperature=1.0)
    args.update(kwargs)
    with pytest.raises(err, match=match):
        topk_logprobs_core(**args, backend="cpp")


def test_core_k_above_vocab():
    with pytest.raises(ValueError, match="k=4 > the vocabulary size 3"):
        topk_logprobs_core(torch.zeros(1, 4), torch.zeros(3, 4), torch.tensor([0]), 4, 2, 1.0, backend="cpp")


def test_state_errors():
    state = tm.topk_merge_init(2, 4, "cpu", targets=torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="3 rows, the state 2"):
        tm.topk_merge_update(state, torch.zeros(3, 5), 0)
    with pytest.raises(ValueError, match="vocabulary ids"):
        tm.topk_merge_update(state, torch.zeros(2, 5), -1)
    with pytest.raises(TypeError, match="floating point"):
        tm.topk_merge_update(state, torch.zeros(2, 5, dtype=torch.int64), 0)
    with pytest.raises(BackendError, match="needs CUDA tensors"):
        tm.topk_merge_update(state, torch.zeros(2, 5), 0, backend="cuda")
    with pytest.raises(BackendError, match="has no 'triton' backend"):
        tm.topk_merge_update(state, torch.zeros(2, 5), 0, backend="triton")
    tm.topk_merge_update(state, torch.randn(2, 3), 0, backend="cpp")
    with pytest.raises(ValueError, match="k=4 exceeds the number of logits merged"):
        tm.topk_merge_finalize(state)
    tm.topk_merge_update(state, torch.randn(2, 3), 3, backend="cpp")
    with pytest.raises(ValueError, match="target id was in no merged chunk"):
        tm.topk_merge_finalize(state)
    with pytest.raises(ValueError, match="outside must be one of"):
        tm.topk_merge_finalize(state, outside="drop")
    for floor in (float("nan"), float("-inf"), True):  # as topk_logprobs: NaN would be every outside row's value
        with pytest.raises(ValueError, match="topk_merge_finalize: floor must be a finite number"):
            tm.topk_merge_finalize(state, floor=floor)
    with pytest.raises(TypeError, match="targets must be an int64 tensor"):
        tm.topk_merge_init(2, 4, "cpu", targets=torch.tensor([0]))


def test_finalize_renormalize_is_a_bool():
    """renormalize is held to bool as topk_logprobs' is: 0 or "false" picked a normalisation
    with no word (a complete state, which finalizes with True / False)."""
    state = tm.topk_merge_init(2, 4, "cpu", targets=torch.tensor([0, 5]))
    tm.topk_merge_update(state, torch.randn(2, 8, generator=torch.Generator().manual_seed(3)), 0, backend="cpp")
    for flag in (True, False):
        assert tm.topk_merge_finalize(state, renormalize=flag).target_logprob.shape == (2,)
    for flag, shown in ((0, "int 0"), ("false", "str 'false'")):
        with pytest.raises(TypeError, match=f"topk_merge_finalize: renormalize must be a bool, got {shown}"):
            tm.topk_merge_finalize(state, renormalize=flag)


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_merge_compiles_in_one_graph(backend):
    """init, a chunk loop of updates and finalize under torch.compile(fullgraph=True): the same
    result as eager and the oracle, and the finalize checks (fewer than k logits merged, a target
    in no merged chunk) still raise their ValueError. They were host syncs in topk_merge_core: a
    UserError about a data-dependent guard under fullgraph=True (three graph breaks without it)."""
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(21))
    targets = torch.tensor([0, 99, 37, 64])

    def stream(logits, targets, widths):
        state = tm.topk_merge_init(4, 8, logits.device, targets=targets, temperature=0.5)
        c0 = 0
        for n in widths:
            tm.topk_merge_update(state, logits[:, c0:c0 + n], c0, backend=backend)
            c0 += n
        return tm.topk_merge_finalize(state, outside="full")

    compiled = torch.compile(stream, backend="aot_eager", fullgraph=True)
    got, want = compiled(logits, targets, (32, 32, 36)), stream(logits, targets, (32, 32, 36))
    for name, a, b in zip(got._fields, got, want):
        assert torch.equal(a, b), f"{name}: compiled != eager"
    ref = topk_logprobs_ref(logits, None, targets, k=8, outside="full", temperature=0.5)
    assert torch.equal(got.topk_ids, ref.topk_ids), (got.topk_ids, ref.topk_ids)
    torch.testing.assert_close(got.topk_logprobs, ref.topk_logprobs, atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(got.target_logprob, ref.target_logprob, atol=LOGPROB_ATOL, rtol=0)
    with pytest.raises(ValueError, match="k=8 exceeds the number of logits merged into some row"):
        compiled(logits[:, :5], targets % 5, (5,))
    with pytest.raises(ValueError, match="a row's target id was in no merged chunk"):
        compiled(logits[:, :64], targets % 64 + torch.tensor([0, 0, 0, 64]), (32, 32))


def test_the_default_backend_first_used_in_compiled_code(monkeypatch):
    """The device default ("cpp" on CPU with the extension, "cuda" on CUDA) chosen for the first
    time inside torch.compile(fullgraph=True): the walk over the defaults loaded each inside the
    trace (importlib.import_module: an error under fullgraph=True); now it runs while Dynamo
    traces and the name is a constant of the graph."""
    monkeypatch.setattr(tm.UPDATE_OP, "_loaded", {})   # as in a fresh process: nothing loaded yet
    monkeypatch.delenv("ACARERANK_BACKEND", raising=False)
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(22))
    targets = torch.tensor([1, 39, 20])

    def stream(logits, targets):
        state = tm.topk_merge_init(3, 4, logits.device, targets=targets)
        tm.topk_merge_update(state, logits[:, :25], 0)
        tm.topk_merge_update(state, logits[:, 25:], 25)
        return tm.topk_merge_finalize(state)

    got = torch.compile(stream, backend="aot_eager", fullgraph=True)(logits, targets)
    ref = topk_logprobs_ref(logits, None, targets, k=4)
    assert torch.equal(got.topk_ids, ref.topk_ids), (got.topk_ids, ref.topk_ids)
    torch.testing.assert_close(got.topk_logprobs, ref.topk_logprobs, atol=LOGPROB_ATOL, rtol=0)
    assert tm.UPDATE_OP.resolve(None, logits.device) in tm.UPDATE_OP._loaded, "the default was not loaded"


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_merge_refuses_what_gave_wrong_log_probs(backend):
    """A NaN / +inf logit merged, a row −inf throughout, a column merged twice, a float c0: each
    a named error. They came out as NaN / −inf log-probs, an id twice in the top-k with its
    exp counted twice, and ids off by c0's fraction, with no error."""
    torch.manual_seed(0)
    z, targets = torch.randn(3, 20), torch.tensor([1, 7, 15])

    def merged(z, c0s=(0, 10)):
        state = tm.topk_merge_init(3, 4, "cpu", targets=targets)
        for c0 in c0s:
            tm.topk_merge_update(state, z[:, c0:c0 + 10], c0, backend=backend)
        return state

    ref = topk_logprobs_ref(z, torch.eye(20), targets, k=4)  # z @ I: the logits as given
    ok = tm.topk_merge_finalize(merged(z))
    assert torch.equal(ok.topk_ids, ref.topk_ids) and (ok.target_logprob - ref.target_logprob).abs().max() < 1e-6
    for row, col, bad in ((1, 3, float("nan")), (2, 17, float("inf"))):
        zb = z.clone()
        zb[row, col] = bad
        with pytest.raises(ValueError, match=rf"log-sum-exp of rows \[{row}\] is not finite"):
            tm.topk_merge_finalize(merged(zb))
    zb = z.clone()
    zb[0] = float("-inf")
    with pytest.raises(ValueError, match=r"rows \[0\] is not finite"):
        tm.topk_merge_core(merged(zb))
    with pytest.raises(ValueError, match="merged more than once"):
        tm.topk_merge_finalize(merged(z, (0, 10, 0)))
    with pytest.raises(TypeError, match="c0 must be an int"):
        tm.topk_merge_update(tm.topk_merge_init(3, 4, "cpu"), z[:, :10], 2.7, backend=backend)


# ---------------------------------------------------------------- coverage record
def _coverage_logits():
    """[3, 20] logits whose top-4 are columns 0..3 (values 5..8); the rest are N(0, 1)."""
    z = torch.randn(3, 20, generator=torch.Generator().manual_seed(31))
    z[:, :4] = torch.tensor([8.0, 7.0, 6.0, 5.0])
    return z, torch.tensor([1, 7, 15])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_column_merged_twice_outside_the_topk_is_refused_before_it_counts(backend):
    """Columns 12..15 merged a second time rank below the top-4, so no id shows twice at finalize:
    their exp terms were counted twice and the log-sum-exp came out 5e-4..7e-4 high (every
    log-prob that much low; 500x the tolerance), with no error. The overlap is refused at the
    update, before the state changes."""
    z, targets = _coverage_logits()
    state = tm.topk_merge_init(3, 4, "cpu", targets=targets)
    tm.topk_merge_update(state, z[:, :10], 0, backend=backend)
    tm.topk_merge_update(state, z[:, 10:], 10, backend=backend)
    with pytest.raises(ValueError, match=r"chunk columns \[12, 16\) overlap columns \[0, 20\) already merged"):
        tm.topk_merge_update(state, z[:, 12:16], 12, backend=backend)
    _, ids, _, lse = tm.topk_merge_core(state)   # untouched: the refused chunk counted nowhere
    torch.testing.assert_close(lse, torch.logsumexp(z.double(), dim=1).float(), atol=1e-6, rtol=0)
    ref = topk_logprobs_ref(z, None, targets, k=4)
    assert torch.equal(ids, ref.topk_ids)
    got = tm.topk_merge_finalize(state)
    torch.testing.assert_close(got.target_logprob, ref.target_logprob, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_columns_never_merged_are_refused_at_finalize(backend):
    """A gap between chunks (columns 10..14 skipped) and, with vocab_size=, a loop that stopped
    early (16..19): finalize names the columns. Their exp terms were left out of the log-sum-exp
    (10..14: 6e-4..1.3e-3 low), with no error."""
    z, targets = _coverage_logits()

    def merged(pieces, **kw):
        state = tm.topk_merge_init(3, 4, "cpu", targets=targets, **kw)
        for a, b in pieces:
            tm.topk_merge_update(state, z[:, a:b], a, backend=backend)
        return state

    with pytest.raises(ValueError, match=r"columns \[10, 15\) were never merged \(of \[0, 20\)\)"):
        tm.topk_merge_finalize(merged([(0, 10), (15, 20)]))
    with pytest.raises(ValueError, match=r"columns \[0, 4\), \[10, 15\) were never merged \(of \[0, 20\)\)"):
        tm.topk_merge_core(merged([(4, 10), (15, 20)]))
    with pytest.raises(ValueError, match=r"columns \[16, 20\) were never merged \(of \[0, 20\)\)"):
        tm.topk_merge_finalize(merged([(0, 8), (8, 16)], vocab_size=20))
    # no vocab_size: the state cannot know the vocabulary ended early (docs/ARCHITECTURE.md)
    tm.topk_merge_finalize(merged([(0, 8), (8, 16)]))
    # any order, any widths: the record coalesces to [0, 20) and the result is the oracle's
    got = tm.topk_merge_finalize(merged([(13, 20), (0, 5), (9, 13), (5, 9)], vocab_size=20), outside="full")
    ref = topk_logprobs_ref(z, None, targets, k=4, outside="full")
    assert torch.equal(got.topk_ids, ref.topk_ids)
    torch.testing.assert_close(got.target_logprob, ref.target_logprob, atol=LOGPROB_ATOL, rtol=0)


def test_the_record_coalesces_any_partition_in_any_order():
    rng = np.random.default_rng(5)
    for _ in range(20):
        pieces = _random_chunks(rng, 500, 40)
        merged = []
        for i in rng.permutation(len(pieces)):
            tm._record(merged, *pieces[i])
            assert merged == sorted(merged) and all(b < c for (_, b), (c, _) in zip(merged, merged[1:])), merged
        assert merged == [(0, 500)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_shard_state_covers_its_vocab_range(backend):
    """vocab_range=(lo, hi): one vocabulary shard's state (global ids). The columns below lo are
    not a gap; a chunk outside [lo, hi) and a gap inside it are refused."""
    z, _ = _coverage_logits()
    lo, hi = 8, 20
    targets = torch.tensor([8, 13, 19])
    state = tm.topk_merge_init(3, 4, "cpu", targets=targets, vocab_range=(lo, hi))
    with pytest.raises(ValueError, match=r"chunk columns \[4, 12\) lie outside the state's vocabulary columns "
                                         r"\[8, 20\)"):
        tm.topk_merge_update(state, z[:, 4:12], 4, backend=backend)
    tm.topk_merge_update(state, z[:, 14:hi], 14, backend=backend)
    with pytest.raises(ValueError, match=r"columns \[8, 14\) were never merged \(of \[8, 20\)\)"):
        tm.topk_merge_finalize(state)
    tm.topk_merge_update(state, z[:, lo:14], lo, backend=backend)
    got = tm.topk_merge_finalize(state, outside="full")
    ref = topk_logprobs_ref(z[:, lo:hi], None, targets - lo, k=4, outside="full")
    assert torch.equal(got.topk_ids, ref.topk_ids + lo)
    torch.testing.assert_close(got.topk_logprobs, ref.topk_logprobs, atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(got.target_logprob, ref.target_logprob, atol=LOGPROB_ATOL, rtol=0)


def test_a_shard_state_made_without_vocab_range_is_told_to_give_it():
    """A shard's chunks (global ids [8, 20)) merged into a state made without vocab_range: finalize
    refuses [0, 8) as never merged (the state cannot know its vocabulary starts at 8) and names the
    remedy, vocab_range=(8, hi); the message only guessed at a gap or a loop that stopped early."""
    z, _ = _coverage_logits()
    state = tm.topk_merge_init(3, 4, "cpu")
    tm.topk_merge_update(state, z[:, 8:], 8)
    with pytest.raises(ValueError, match=r"columns \[0, 8\) were never merged .*vocab_range=\(8, hi\)"):
        tm.topk_merge_finalize(state)
    # an inner gap is no shard: no such hint
    state = tm.topk_merge_init(3, 4, "cpu")
    for a, b in ((0, 8), (12, 20)):
        tm.topk_merge_update(state, z[:, a:b], a)
    with pytest.raises(ValueError, match=r"columns \[8, 12\) were never merged") as e:
        tm.topk_merge_finalize(state)
    assert "vocab_range" not in str(e.value)


def test_vocab_size_and_range_arguments_are_checked():
    for kw, err, match in ((dict(vocab_size=20, vocab_range=(0, 20)), ValueError, "not both"),
                           (dict(vocab_size=3), ValueError, r"k=4 > the 3 vocabulary columns \[0, 3\)"),
                           (dict(vocab_size=0), ValueError, r"columns \[0, 0\) must be non-empty"),
                           (dict(vocab_range=(5, 5)), ValueError, r"columns \[5, 5\) must be non-empty"),
                           (dict(vocab_range=(-1, 9)), ValueError, r"must be non-empty and lie in \[0, 2\^31\)"),
                           (dict(vocab_size=20.0), TypeError, "vocab_size must be an int"),
                           (dict(vocab_range=(0, 9, 1)), TypeError, r"vocab_range must be a pair")):
        with pytest.raises(err, match=match):
            tm.topk_merge_init(2, 4, "cpu", **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_coverage_record_compiles_in_one_graph(backend):
    """The record is a Python list of ints: torch.compile(fullgraph=True) traces it as constants
    (no graph break) — the stream with vocab_size= gives eager's result. A gap or an overlap is
    found while Dynamo traces: without fullgraph the frame falls back to eager and raises the
    ValueError; under fullgraph=True Dynamo reports it as Unsupported carrying the message
    (as every trace-time check of the update does)."""
    z, targets = _coverage_logits()

    def stream(z, targets, pieces):
        state = tm.topk_merge_init(3, 4, z.device, targets=targets, vocab_size=20)
        for a, b in pieces:
            tm.topk_merge_update(state, z[:, a:b], a, backend=backend)
        return tm.topk_merge_finalize(state, outside="full")

    compiled = torch.compile(stream, backend="aot_eager", fullgraph=True)
    pieces = ((8, 20), (0, 8))
    got, want = compiled(z, targets, pieces), stream(z, targets, pieces)
    for name, a, b in zip(got._fields, got, want):
        assert torch.equal(a, b), f"{name}: compiled != eager"
    lenient = torch.compile(stream, backend="aot_eager")
    for pieces, match in ((((0, 8), (8, 16)), r"columns \[16, 20\) were never merged"),
                          (((0, 8), (4, 12)), r"chunk columns \[4, 12\) overlap columns \[0, 8\)")):
        # (Dynamo may already run this frame eagerly after an earlier refusal: ValueError itself)
        with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match=match):
            compiled(z, targets, pieces)
        with pytest.raises(ValueError, match=match):
            lenient(z, targets, pieces)


def _dyn_stream(backend):
    """init (rows, vocab size from the logits' symbolic shape; temperature a float argument: a
    SymFloat under dynamic=True), a loop of updates over ``widths``, finalize."""
    def stream(logits, targets, widths, temperature):
        state = tm.topk_merge_init(logits.shape[0], 4, logits.device, targets=targets, temperature=temperature,
                                   vocab_size=logits.shape[1])
        c0 = 0
        for n in widths:
            tm.topk_merge_update(state, logits[:, c0:c0 + n], c0, backend=backend)
            c0 += n
        return tm.topk_merge_finalize(state, outside="full")
    return stream


def _loop(state, logits, pieces, backend):
    """Updates and finalize of a state made outside the compiled function (its record's ints
    and temperature are symbolic inside under dynamic=True)."""
    for a, b in pieces:
        tm.topk_merge_update(state, logits[:, a:b], a, backend=backend)
    return tm.topk_merge_finalize(state, outside="full")


@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_merge_compiles_with_dynamic_shapes(backend):
    """init + update loop + finalize under torch.compile(fullgraph=True, dynamic=True), as a
    training step compiles its loss (symbolic rows, vocabulary width and temperature): eager's
    result bit for bit, at two shapes and two temperatures, and the oracle's within its tolerance;
    the same for a state made outside the compiled function (its record holds plain ints after).
    init failed in the temperature check: math.isfinite on a SymFloat ("torch.* op returned non-Tensor")."""
    gen = torch.Generator().manual_seed(41)
    stream = _dyn_stream(backend)
    compiled = torch.compile(stream, backend="aot_eager", fullgraph=True, dynamic=True)
    for T, widths, t in ((4, (16, 16, 18), 0.5), (6, (20, 30, 7), 1.3)):
        logits = torch.randn(T, sum(widths), generator=gen)
        targets = torch.randint(0, sum(widths), (T,), generator=gen)
        got, want = compiled(logits, targets, widths, t), stream(logits, targets, widths, t)
        for name, a, b in zip(got._fields, got, want):
            assert torch.equal(a, b), f"{name}: compiled != eager (T={T}, widths={widths})"
        ref = topk_logprobs_ref(logits, None, targets, k=4, outside="full", temperature=t)
        assert torch.equal(got.topk_ids, ref.topk_ids), (got.topk_ids, ref.topk_ids)
        torch.testing.assert_close(got.topk_logprobs, ref.topk_logprobs, atol=LOGPROB_ATOL, rtol=0)
        torch.testing.assert_close(got.target_logprob, ref.target_logprob, atol=LOGPROB_ATOL, rtol=0)
    loop = torch.compile(_loop, backend="aot_eager", fullgraph=True, dynamic=True)
    logits, targets = torch.randn(3, 30, generator=gen), torch.tensor([0, 29, 12])
    pieces = ((10, 30), (0, 10))
    state = tm.topk_merge_init(3, 4, "cpu", targets=targets, temperature=0.7, vocab_size=30)
    got = loop(state, logits, pieces, backend)
    want = _loop(tm.topk_merge_init(3, 4, "cpu", targets=targets, temperature=0.7, vocab_size=30), logits, pieces,
                 backend)
    for name, a, b in zip(got._fields, got, want):
        assert torch.equal(a, b), f"{name}: compiled != eager (state made outside)"
    assert state.merged == [(0, 30)] and all(type(x) is int for x in state.merged[0]), state.merged


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bad_loop_compiled_with_dynamic_shapes_is_refused_with_our_message(backend, dynamic):
    """A gap, an overlap and a bad temperature under fullgraph=True, dynamic=False and True, the
    state made inside or outside the compiled function: Dynamo's Unsupported carries our message
    (the messages format int(x) / float(x), never a symbolic value). Under dynamic=True it was
    the temperature check's "torch.* op returned non-Tensor" (state made inside) or "BUILD_STRING
    type error" (made outside: its record's ints are SymInts there). A tensor temperature inside
    the compiled function is a TypeError saying to pass a float (it was a data-dependent-guard
    UserError); eagerly it is still taken."""
    raised = (ValueError, TypeError, torch._dynamo.exc.Unsupported)
    stream = torch.compile(_dyn_stream(backend), backend="aot_eager", fullgraph=True, dynamic=dynamic)
    loop = torch.compile(_loop, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    z, targets = _coverage_logits()
    gap = r"columns \[16, 20\) were never merged \(of \[0, 20\)\)"
    over = r"chunk columns \[4, 12\) overlap columns \[0, 8\)"
    outside = lambda: tm.topk_merge_init(3, 4, "cpu", targets=targets, vocab_size=20)  # noqa: E731
    for run, match in ((lambda: stream(z, targets, (8, 8), 1.0), gap),   # made inside: vocab_size 20, 16 merged
                       (lambda: loop(outside(), z, ((0, 8), (8, 16)), backend), gap),
                       (lambda: loop(outside(), z, ((0, 8), (4, 12)), backend), over)):
        torch._dynamo.reset()  # each case traced afresh (not the frame Dynamo left to run eagerly)
        with pytest.raises(raised, match=match):
            run()
    for t, match in ((-0.5, r"temperature must be finite and > 0 .* got -0\.5"),
                     (float("nan"), r"temperature must be finite and > 0 .* got nan"),
                     (torch.tensor(0.5), r"temperature is a tensor inside torch.compile")):
        torch._dynamo.reset()
        with pytest.raises(raised, match=match):
            stream(z, targets, (20,), t)
    want = _dyn_stream(backend)(z, targets, (8, 12), 0.5)
    got = _dyn_stream(backend)(z, targets, (8, 12), torch.tensor(0.5))  # eager: a 0-d tensor is read as a float
    for name, a, b in zip(got._fields, got, want):
        assert torch.equal(a, b), f"{name}: tensor temperature != float temperature"
