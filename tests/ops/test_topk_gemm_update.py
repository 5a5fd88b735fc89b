"""The fused rest of a bf16 top-k call (csrc/cpu/topk_gemm_update.cpp):

    acarerank::topk_gemm_update(hidden [T, H] bf16, weight [V, H] bf16, id0, temperature, targets,
                                run_v, run_i, m, s, tgt)

Reference: what the native core ran before it, chunk by chunk — ``mm_bf16_f32`` into a chunk of
fp32 logits, divided by the temperature, folded in by ``topk_chunk_update`` — on the same state.
The logits are the same GEMM's (same panels, same K blocks), so the entries, the running max and
the target logits must be bitwise the same. The log-sum-exp's s sums the same logits' exp terms in
other groups (fp32 sums over blocks of up to ``max(chunk, 256)`` logits; another running max per
column part, so each term's 2-ulp exp at another shift, rescaled in fp64): relative bound
``(max(chunk, 256) + 8) · 2⁻²⁴``.
"""
import importlib

import pytest
import torch

from _ext import needs_native
from acarerank.ops import _native, topk_logprobs, topk_logprobs_ref

pytestmark = [needs_native, pytest.mark.skipif(
    not (_native.available() and _native.bf16_logits_gemm()),
    reason="this CPU has no AVX512_BF16 (or ACARERANK_CPU_BASELINE=1): the op refuses it and the core "
           "upcasts to an fp32 GEMM there")]
TOPK = importlib.import_module("acarerank.ops.topk_logprobs")
MAX_BLOCK = 256  # the fused op's widest block of logits (256 kB at 256 rows)


def _ops():
    from acarerank.ops._native_backend import native_kernel

    return (native_kernel("mm_bf16_f32", lambda a, b, out: None),
            native_kernel("topk_chunk_update", TOPK._topk_chunk_update_fake),
            native_kernel("topk_gemm_update", TOPK._topk_gemm_update_fake))


def _state(h, w, tg, k, id0, temperature):
    """The state after ids [0, id0) as the core holds it: the exact top-k of those logits (ties by
    lower id), their max and Σ exp(z − max) in fp64, the target logits seen so far (NaN otherwise)."""
    mm, _, _ = _ops()
    T = h.shape[0]
    z = torch.empty(T, id0)
    mm(h, w[:id0], z)
    if temperature != 1.0:
        z.div_(temperature)
    key = torch.where(torch.isnan(z), torch.full_like(z, float("-inf")), z)
    order = key.sort(dim=1, descending=True, stable=True).indices[:, :k]
    run_v, run_i = z.gather(1, order).contiguous(), order.contiguous()
    m = key.max(dim=1).values
    shift = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    s = torch.exp(z.double() - shift[:, None].double()).sum(1)
    tgt = torch.full((T,), float("nan"))
    seen = tg < id0
    tgt[seen] = z[seen, tg[seen]]
    return [run_v, run_i, m, s, tgt]


def _sequential(h, w, tg, state, id0, temperature, chunk):
    mm, update, _ = _ops()
    state = [t.clone() for t in state]
    V = w.shape[0]
    for c0 in range(id0, V, chunk):
        c1 = min(V, c0 + chunk)
        x = torch.empty(h.shape[0], c1 - c0)
        mm(h, w[c0:c1], x)
        if temperature != 1.0:
            x.div_(temperature)
        update(x, c0, tg, *state)
    return state


def _fused(h, w, tg, state, id0, temperature):
    _, _, fused = _ops()
    state = [t.clone() for t in state]
    fused(h, w, id0, temperature, tg, *state)
    return state


def _check(got, want, chunk, what):
    for name, a, b in zip(("run_v", "run_i", "m"), got[:3], want[:3]):
        bad = ~((a == b) | (a.isnan() & b.isnan()))
        assert not bad.any(), f"{what}: {name} differs at {bad.nonzero()[:5].tolist()}"
    a, b = got[4], want[4]
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()]), f"{what}: tgt differs"
    a, b = got[3], want[3]
    bound = (max(chunk, MAX_BLOCK) + 8) * 2.0 ** -24
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    err = torch.where(same, torch.zeros_like(a), (a - b).abs() / b.abs().clamp_min(1e-300))
    assert (err <= bound).all(), f"{what}: s off by {err.max().item():.2e} (rel; bound {bound:.1e})"


def _inputs(T, H, V, g, kind="gaussian"):
    h = torch.randn(T, H, generator=g).bfloat16()
    w = (0.3 * torch.randn(V, H, generator=g)).bfloat16()
    if kind == "ties":  # small integers: every logit exact, ties everywhere, duplicates far apart in id
        h = torch.randint(-2, 3, (T, H), generator=g).bfloat16()
        w = torch.randint(-2, 3, (V, H), generator=g).bfloat16()
        w[V // 2:] = w[:V - V // 2]
    if kind == "rising":  # logits rising with the id: many candidates in every block
        h[:, 0], w[:, 0] = 1.0, torch.linspace(-60, 60, V).bfloat16()
    tg = torch.randint(0, V, (T,), generator=g)
    return h, w, tg


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("T,H,V,k,id0,n_threads,kind", [
    (1, 64, 5000, 8, 2048, 2, "gaussian"),     # one row: two column parts
    (7, 96, 3001, 128, 300, 3, "gaussian"),    # three column parts, a partial last panel
    (40, 128, 9000, 64, 2048, 2, "ties"),      # equal logits across the parts: lower id wins
    (300, 32, 4099, 16, 700, 4, "rising"),     # four column parts; > k candidates a block
    (600, 64, 2500, 32, 64, 2, "gaussian"),    # two column parts, three row blocks
    (1100, 32, 3000, 16, 100, 4, "ties"),      # two row groups (1,024 rows or more) × two column parts
    (2100, 32, 2600, 8, 64, 3, "gaussian"),    # three row groups, one part (no copy)
    (257, 1024, 4200, 128, 2048, 1, "gaussian"),  # one thread; blocks of 256 logits at H 1,024
    (5, 2, 3000, 4, 100, 2, "gaussian"),       # H 2: blocks still 256 columns (the logits' budget)
    (3, 4096, 700, 8, 64, 2, "gaussian"),      # H 4,096: blocks of one 64-column panel (the weight's)
])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fused_equals_the_chunk_loop(T, H, V, k, id0, n_threads, kind, temperature, threads):
    threads(n_threads)
    g = torch.Generator().manual_seed(T + V + k)
    h, w, tg = _inputs(T, H, V, g, kind)
    state = _state(h, w, tg, k, id0, temperature)
    for chunk in (2048, 333):
        want = _sequential(h, w, tg, state, id0, temperature, chunk)
        got = _fused(h, w, tg, state, id0, temperature)
        _check(got, want, chunk, f"T={T} V={V} k={k} id0={id0} threads={n_threads} {kind} tau={temperature} chunk={chunk}")


def test_a_state_past_the_copy_cap_splits_the_rows(threads):
    """k 30,000 of 40,000 at T 200: a 72 MB state, past the 64 MB the column parts' copies may take,
    so the two threads take row groups of 100 instead (no copy) — the chunk loop's results still."""
    threads(2)
    g = torch.Generator().manual_seed(9)
    h, w, tg = _inputs(200, 32, 40000, g)
    state = _state(h, w, tg, 30000, 30000, 1.0)
    _check(_fused(h, w, tg, state, 30000, 1.0), _sequential(h, w, tg, state, 30000, 1.0, 2048), 2048, "k=30000")


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_nan_and_infinite_logits_as_the_chunk_loop(n_threads, threads):
    """A NaN hidden row (every logit NaN: s NaN, nothing enters, m kept), +inf and −inf logits
    (a weight row of 1e38 against hidden rows of one sign: the sums overflow): the loop's m, s, entries and targets."""
    threads(n_threads)
    g = torch.Generator().manual_seed(5)
    T, H, V, k, id0 = 6, 32, 3000, 8, 500
    h, w, tg = _inputs(T, H, V, g)
    h[2] = float("nan")
    w[2500] = 1e38
    h[3] = h[3].abs() + 0.25
    h[4] = -(h[4].abs() + 0.25)
    tg[2:5] = torch.tensor([2500, 2500, 2700])
    state = _state(h, w, tg, k, id0, 1.0)
    want = _sequential(h, w, tg, state, id0, 1.0, 2048)
    got = _fused(h, w, tg, state, id0, 1.0)
    assert torch.isnan(got[3][2]) and torch.isinf(got[3][3]) and torch.isfinite(got[3][4])
    _check(got, want, 2048, f"threads={n_threads}")


def test_nothing_left_or_no_rows_is_a_no_op():
    g = torch.Generator().manual_seed(1)
    h, w, tg = _inputs(3, 32, 200, g)
    state = _state(h, w, tg, 4, 200, 1.0)
    got = _fused(h, w, tg, state, 200, 1.0)
    for a, b in zip(got, state):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])
    empty = [torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0), torch.zeros(0, dtype=torch.float64),
             torch.zeros(0)]
    _ops()[2](h[:0], w, 10, 1.0, tg[:0], *empty)


def test_the_native_core_runs_it_for_the_rest_of_the_vocabulary(monkeypatch):
    """bf16 through ``topk_logprobs(backend="native")``: the first chunk by the chunk loop, the rest
    in one fused call from the first id the loop did not take; results within the fp32 rule of the
    fp64 oracle (the same bound as the chunk loop's test in test_logits_gemm.py)."""
    from acarerank.ops import _native_backend

    calls = []
    real = _native_backend.native_kernel

    def spying(name, fake):
        fn = real(name, fake)
        if name != "topk_gemm_update":
            return fn

        def fused(h, w, id0, *rest):
            calls.append(id0)
            return fn(h, w, id0, *rest)
        return fused
    monkeypatch.setattr(_native_backend, "native_kernel", spying)
    g = torch.Generator().manual_seed(11)
    h, w = torch.randn(9, 128, generator=g).bfloat16(), (0.1 * torch.randn(5001, 128, generator=g)).bfloat16()
    tg = torch.randint(0, 5001, (9,), generator=g)
    got = topk_logprobs(h, w, tg, k=16, outside="full", backend="native")
    want = topk_logprobs_ref(h, w, tg, k=16, outside="full")
    assert calls == [2048], calls
    assert torch.equal(got.topk_ids, want.topk_ids)
    assert (got.topk_logprobs - want.topk_logprobs).abs().max() <= 1e-5
    assert (got.target_logprob - want.target_logprob).abs().max() <= 1e-5


def _args(**change):
    g = torch.Generator().manual_seed(0)
    args = dict(hidden=torch.randn(2, 8, generator=g).bfloat16(), weight=torch.randn(20, 8, generator=g).bfloat16(),
                id0=4, temperature=1.0, targets=torch.zeros(2, dtype=torch.int64), run_v=torch.zeros(2, 3),
                run_i=torch.zeros(2, 3, dtype=torch.int64), m=torch.zeros(2), s=torch.zeros(2, dtype=torch.float64),
                tgt=torch.zeros(2))
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(hidden=torch.ones(2, 8)), "hidden must be BFloat16"),
    (dict(weight=torch.ones(20, 8)), "weight must be BFloat16"),
    (dict(weight=torch.ones(20, 6).bfloat16()), "same H"),
    (dict(hidden=torch.ones(2, 7).bfloat16(), weight=torch.ones(20, 7).bfloat16()), "H must be even"),
    (dict(hidden=torch.ones(2, 0).bfloat16(), weight=torch.ones(20, 0).bfloat16()), "H must be even and > 0"),
    (dict(weight=torch.ones(8, 20).bfloat16().T), "rows must be contiguous"),
    (dict(id0=21), r"id0 must be in \[0, V = 20\]"),
    (dict(id0=-1), r"id0 must be in \[0, V = 20\]"),
    (dict(temperature=0.0), "temperature must be finite and > 0"),
    (dict(temperature=float("nan")), "temperature must be finite and > 0"),
    (dict(m=torch.ones(3)), r"targets, m, s and tgt must be \[2\]"),
    (dict(s=torch.ones(2)), "s must be Double"),
    (dict(run_v=torch.zeros(2, 5)), "run_v and run_i must be"),
    (dict(run_v=torch.zeros(3, 2).T), "must be contiguous"),
])
def test_names_bad_input(change, match):
    with pytest.raises(RuntimeError, match=match):
        _ops()[2](**_args(**change))


def test_opcheck_topk_gemm_update():
    g = torch.Generator().manual_seed(3)
    h, w, tg = _inputs(5, 32, 300, g)
    state = _state(h, w, tg, 8, 100, 1.0)
    _ops()
    torch.library.opcheck(torch.ops.acarerank.topk_gemm_update.default, (h, w, 100, 1.0, tg, *state))


def test_calls_from_several_threads_at_once_get_their_own_results():
    """Four Python threads, each its own inputs, through the public op at once (each call runs its
    own parallel region: no state shared between calls): each result is that input's alone — the
    same ids, log-probs within the fp32 rule (test_logits_gemm.py's)."""
    import threading

    g = torch.Generator().manual_seed(4)
    cases = [_inputs(7 + i, 64, 4000 + 100 * i, g) for i in range(4)]
    alone = [topk_logprobs(h, w, tg, k=16, outside="full", backend="native") for h, w, tg in cases]
    got, errors = [None] * 4, []

    def run(i):
        try:
            for _ in range(3):
                got[i] = topk_logprobs(*cases[i], k=16, outside="full", backend="native")
        except Exception as e:  # reported below, with the thread's index
            errors.append((i, e))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, (a, b) in enumerate(zip(got, alone)):  # a thread's own OpenMP team size may group the sums otherwise
        assert torch.equal(a.topk_ids, b.topk_ids), i
        assert (a.topk_logprobs - b.topk_logprobs).abs().max() <= 1e-5, i
        assert (a.target_logprob - b.target_logprob).abs().max() <= 1e-5, i
