"""Vocabulary-parallel topk_logprobs / linear_logprob / rescore against the single-process ops.

Spawned gloo process groups of 2 and 4 ranks (tests/_vocab_parallel_workers.py), one of each
shared by every case of this module (spawning costs seconds). Every rank must return what
the single-process op returns on the full weight (ids exactly; log-probs within 1e-6 relative),
and all ranks the same bits. Exact ids need exact logits: "dyadic" inputs (multiples of 1/4,
H ≤ 64) make every GEMM exact whatever its blocking, and they tie often, so the tie rule
(lower id first) is exercised across shard boundaries. Bad input must raise on every rank,
and the group must still work afterwards (no rank left waiting in a collective).
"""
import re

import pytest
import torch

from _vocab_parallel_workers import Group, rescore_queries, shard_bounds, tiny_runner
from acarerank.ops import VocabShard, linear_logprob, linear_logprob_ref, topk_logprobs, topk_logprobs_ref

QWEN3_V = 151669
REL = 1e-6  # fp32 log-probs: |Δ| ≤ REL · max(1, |ref|)


@pytest.fixture(scope="module")
def groups():
    made = {}

    def get(world):
        if world not in made:
            made[world] = Group(world)
        return made[world]

    yield get
    for g in made.values():
        g.close()


pytestmark = pytest.mark.usefixtures("one_thread")


def _dyadic(T, H, V, seed=0, span=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-span, span + 1, (T, H), generator=g).float() / 4,
            torch.randint(-span, span + 1, (V, H), generator=g).float() / 4)


def _gauss(T, H, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, generator=g) / H ** 0.5 * 3, torch.randn(V, H, generator=g)


def _targets(h, w, k, V, bounds=None):
    """Even rows: an id from the top-k (in_topk); odd rows: an id of rank (i // 2) mod W's
    valid rows, so every rank owns some targets (given enough rows)."""
    T = h.shape[0]
    top = (h @ w[:V].T).topk(min(k, V), dim=1).indices
    tg = top[torch.arange(T), torch.arange(T) % top.shape[1]]
    live = [(s, min(e, V)) for s, e in (bounds or [(0, V)]) if min(e, V) > s]
    for i in range(1, T, 2):
        s, e = live[(i // 2) % len(live)]
        tg[i] = s + (i * 7919) % (e - s)
    return tg


def _ok(out, what):
    bad = [(r, p) for r, (s, p) in enumerate(out) if s != "ok"]
    assert not bad, f"{what}: rank {bad[0][0]} raised {bad[0][1][0]}: {bad[0][1][1]}\n{bad[0][1][2]}"
    return [p for _, p in out]


def _close(got, want, what, rel=REL):
    err = (got.double() - want.double()).abs()
    bad = (err > rel * want.double().abs().clamp_min(1.0)).nonzero()
    assert bad.numel() == 0, f"{what}: {bad.shape[0]} mismatches, first at {bad[:5].tolist()}, max err {err.max():.3e}"


def _exact(h, w, tg, ids, temperature=1.0, renormalize=True, outside="floor", floor=-20.0, **_):
    """fp64 (topk_logprobs, target_logprob) at the given top-k ids: the yardstick for values
    normalised over the whole vocabulary, where fp32 summation order alone moves ~1e-6."""
    z = (h.double() @ w.double().T) / temperature
    zk = z.gather(1, ids)
    norm = torch.logsumexp(zk if renormalize else z, dim=1, keepdim=True)
    inside = (ids == tg[:, None]).any(1)
    zt = z.gather(1, tg[:, None])
    out = {"floor": torch.full_like(zt, floor), "mask": torch.zeros_like(zt),
           "full": zt - torch.logsumexp(z, dim=1, keepdim=True)}[outside]
    return zk - norm, torch.where(inside[:, None], zt - norm, out).squeeze(1)


def _check_topk(results, h, w, tg, k, V, what, **kw):
    """ids exact and bitwise-equal ranks; values within REL of the single-process op, or — where
    they are normalised over the whole vocabulary (renormalize=False, outside="full") — no
    further from the fp64 values than 2× the single-process op's own error + REL (flash-attn's rule)."""
    want = topk_logprobs(h, w[:V], tg, k=k, **kw)
    oracle = topk_logprobs_ref(h, w[:V], tg, k=k, **kw)
    assert torch.equal(want.topk_ids, oracle.topk_ids), f"{what}: single-process op vs oracle (test premise)"
    full_norm = {"topk_logprobs": not kw.get("renormalize", True),
                 "target_logprob": not kw.get("renormalize", True) or kw.get("outside") == "full"}
    exact = dict(zip(("topk_logprobs", "target_logprob"), _exact(h, w[:V], tg, want.topk_ids, **kw)))
    for r, res in enumerate(results):
        got = type(want)(*res)
        bad = (got.topk_ids != want.topk_ids).nonzero()
        assert bad.numel() == 0, f"{what} rank {r}: {bad.shape[0]} ids differ, first (row, rank) {bad[:5].tolist()}"
        assert torch.equal(got.in_topk, want.in_topk), f"{what} rank {r}: in_topk differs"
        for name in ("topk_logprobs", "target_logprob"):
            a, b, x = getattr(got, name), getattr(want, name), exact[name]
            if full_norm[name]:
                e_single = (b.double() - x).abs().max().item()
                e_dist = (a.double() - x).abs().max().item()
                assert e_dist <= 2 * e_single + REL, f"{what} rank {r} {name}: error {e_dist:.3e} vs fp64, " \
                                                     f"single-process op {e_single:.3e}"
            else:
                _close(a, b, f"{what} rank {r} {name}")
        for a, b in zip(res, results[0]):
            assert torch.equal(a, b), f"{what}: rank {r} differs bitwise from rank 0"
    return want


# --------------------------------------------------------------------- topk_logprobs
TOPK_CASES = [
    # id, world, T, H, V, k, input kind, shard rule, extra rows (padding), keyword arguments
    ("even", 2, 17, 64, 1000, 128, "dyadic", "megatron", 0, {}),
    ("uneven-k1", 4, 300, 64, 1000, 1, "dyadic", [100, 400, 250, 250], 0, {}),
    ("shard<k", 2, 17, 64, 1000, 128, "dyadic", [37, 963], 0, {"temperature": 0.5}),
    ("k=V-full", 4, 17, 256, 1000, 1000, "gauss", "megatron", 0,
     {"temperature": 0.7, "outside": "full", "renormalize": False}),
    ("qwen3-padded", 2, 1, 64, QWEN3_V, 1000, "dyadic", "megatron", 139, {}),  # 151,808 = 593 · 256 rows
    ("qwen3-ceil", 4, 17, 64, QWEN3_V, 128, "dyadic", "megatron", 0, {"outside": "mask"}),
    ("ties", 4, 17, 8, 1000, 128, "ties", "megatron", 0, {}),
    ("empty-shard", 4, 3, 8, 5, 5, "dyadic", "megatron", 0, {}),  # shards of 2, 2, 1 and 0 rows
]


@pytest.mark.parametrize("name,world,T,H,V,k,kind,rule,pad,kw", TOPK_CASES, ids=[c[0] for c in TOPK_CASES])
def test_topk_logprobs_equals_single_process(groups, name, world, T, H, V, k, kind, rule, pad, kw):
    if kind == "gauss":
        h, w = _gauss(T, H, V + pad)
    else:
        h, w = _dyadic(T, H, V + pad, span=1 if kind == "ties" else 8)
    if kind == "ties":  # rows duplicated across every shard boundary: equal logits, ids on two ranks
        for b in range(V // world, V, V // world):
            w[b:b + 3] = w[b - 3:b]
    if pad:  # padding rows that would beat every real logit of row 0 if they entered the top-k
        w[V:] = 16 * torch.sign(h[0])
    rows = V + pad
    bounds = shard_bounds(rows, world, "sizes", rule) if isinstance(rule, list) else shard_bounds(rows, world)
    tg = _targets(h, w, k, V, bounds)
    owners = {next(r for r, (s, e) in enumerate(bounds) if s <= t < e) for t in tg.tolist()}
    assert T < 4 or len(owners) == world or name == "empty-shard", f"targets must fall on every rank, got {owners}"
    out = _ok(groups(world).run("topk", hidden=h, weight=w, targets=tg, bounds=bounds, k=k,
                                pass_start=isinstance(rule, list), vocab_size=V if pad else None, **kw), name)
    want = _check_topk(out, h, w, tg, k, V, name, **kw)
    if kind == "ties":
        z = h @ w.T
        kth = want.topk_ids[:, -1:]
        tied = (z == z.gather(1, kth)).sum(1) > 1
        assert tied.any(), "the ties case must tie at the k-th place"


MASKED_CASES = [
    # id, world, masked shards, k, keyword arguments
    ("last-shard", 2, [1], 8, {}),
    ("first-shard-k>finite", 2, [0], 600, {"outside": "full", "renormalize": False}),
    ("two-of-four", 4, [1, 3], 300, {"temperature": 0.5}),
]


@pytest.mark.parametrize("name,world,masked,k,kw", MASKED_CASES, ids=[c[0] for c in MASKED_CASES])
def test_topk_logprobs_with_a_shard_all_minus_inf(groups, name, world, masked, k, kw):
    """Rows whose logits are −inf on a whole shard (a masked part of the vocabulary: finite
    weights, products overflowing fp32): the single-process op's result on the full row, the −inf
    entries ranked last in id order where k reaches them. The shard's own lse is −inf there,
    which its local pass took for non-finite input: a ValueError on every rank."""
    T, H, V = 17, 64, 1000
    h, w = _dyadic(T, H, V, seed=7)
    bounds = shard_bounds(V, world)
    h[:, 0], w[:, 0] = 0.0, 0.0
    h[::2, 0] = 2.0                                  # even rows: every logit of the masked shards is −inf
    for r in masked:
        w[bounds[r][0]:bounds[r][1], 0] = -3e38
    tg = _targets(h, w, 4, V, bounds)
    z = h @ w.T
    assert torch.isneginf(z[::2, bounds[masked[0]][0]:bounds[masked[0]][1]]).all() and torch.isfinite(z[1::2]).all()
    want = topk_logprobs(h, w, tg, k=k, **kw)
    oracle = topk_logprobs_ref(h, w, tg, k=k, **kw)
    assert torch.equal(want.topk_ids, oracle.topk_ids), "single-process op vs oracle (test premise)"
    assert torch.isneginf(want.topk_logprobs[::2, -1]).all() == (k > V - sum(e - s for s, e in
                                                                               (bounds[r] for r in masked)))
    out = _ok(groups(world).run("topk", hidden=h, weight=w, targets=tg, bounds=bounds, k=k, **kw), name)
    full_norm = {"topk_logprobs": not kw.get("renormalize", True),
                 "target_logprob": not kw.get("renormalize", True) or kw.get("outside") == "full"}
    exact = dict(zip(("topk_logprobs", "target_logprob"), _exact(h, w, tg, want.topk_ids, **kw)))
    for r, res in enumerate(out):
        got = type(want)(*res)
        assert torch.equal(got.topk_ids, want.topk_ids), f"{name} rank {r}: ids differ"
        assert torch.equal(got.in_topk, want.in_topk), f"{name} rank {r}: in_topk differs"
        for field in ("topk_logprobs", "target_logprob"):
            a, b = getattr(got, field), getattr(want, field)
            fin = torch.isfinite(b)
            assert torch.equal(a[~fin], b[~fin]) and torch.isfinite(a[fin]).all(), \
                f"{name} rank {r} {field}: infinities differ (or NaN)"
            if full_norm[field]:  # the whole-vocabulary sum in another order: the rule of _check_topk
                x = exact[field][fin]
                e_single, e_dist = (b[fin].double() - x).abs().max(), (a[fin].double() - x).abs().max()
                assert e_dist <= 2 * e_single + REL, f"{name} rank {r} {field}: {e_dist:.3e} vs {e_single:.3e}"
            else:
                _close(a[fin], b[fin], f"{name} rank {r} {field}")


def test_topk_logprobs_row_minus_inf_everywhere_raises_on_every_rank(groups):
    """A row −inf on every shard: the single-process op's ValueError (non-finite logits, the
    row named), on every rank."""
    h, w = _dyadic(5, 64, 1000, seed=8)
    h[:, 0], w[:, 0] = 0.0, -3e38
    h[3, 0] = 2.0                                    # row 3: −inf everywhere
    tg = _targets(h, w, 4, 1000)
    with pytest.raises(ValueError, match=r"non-finite logits .* rows \[3\]"):
        topk_logprobs(h, w, tg, k=4)
    out = groups(2).run("topk", hidden=h, weight=w, targets=tg, bounds=shard_bounds(1000, 2), k=4)
    for r, (status, payload) in enumerate(out):
        assert status == "error" and re.search(r"non-finite logits .* rows \[3\]", payload[1]), \
            f"rank {r}: {status} {payload[:2] if status == 'error' else ''}"


def test_topk_logprobs_on_subgroups(groups):
    """Two independent groups of 2 inside the 4 ranks, as Megatron's tensor-parallel groups are."""
    h, w = _dyadic(9, 64, 1000, seed=5)
    tg = _targets(h, w, 32, 1000, shard_bounds(1000, 2))
    out = _ok(groups(4).run("topk_subgroups", hidden=h, weight=w, targets=tg, k=32), "subgroups")
    _check_topk(out[:2], h, w, tg, 32, 1000, "subgroup {0, 1}")
    _check_topk(out[2:], h, w, tg.flip(0), 32, 1000, "subgroup {2, 3}")


# --------------------------------------------------------------------- linear_logprob
LINEAR_CASES = [
    # id, world, T, H, rows, V (true vocabulary), shard rule, temperature, entropy
    ("even-entropy", 2, 17, 64, 1000, 1000, "megatron", 0.7, True),
    ("uneven-padded", 4, 300, 256, 1000, 950, [100, 400, 250, 250], 1.0, False),
    ("qwen3-padded", 2, 3, 64, 151808, QWEN3_V, "megatron", 1.0, True),
]


@pytest.mark.parametrize("name,world,T,H,rows,V,rule,tau,entropy", LINEAR_CASES, ids=[c[0] for c in LINEAR_CASES])
def test_linear_logprob_forward_backward(groups, name, world, T, H, rows, V, rule, tau, entropy):
    h, w = _gauss(T, H, rows)
    w[V:] = 30.0  # padding rows would dominate the softmax if they entered it
    bounds = shard_bounds(rows, world, "sizes", rule) if isinstance(rule, list) else shard_bounds(rows, world)
    tg = _targets(h, w, 16, V, bounds)
    out = _ok(groups(world).run("linear", hidden=h, weight=w, targets=tg, bounds=bounds,
                                pass_start=isinstance(rule, list), vocab_size=V if V < rows else None,
                                temperature=tau, return_entropy=entropy, chunk=128), name)
    def grads(fn, dtype):  # the same loss as the ranks: Σ g·logprob (+ Σ e·entropy), g, e seeded alike
        hh = h.to(dtype).clone().requires_grad_(True)
        ww = w[:V].to(dtype).clone().requires_grad_(True)
        res = fn(hh, ww, tg, temperature=tau, return_entropy=entropy)
        lp, ent = res if entropy else (res, None)
        g = torch.Generator().manual_seed(0)
        loss = (torch.randn(lp.shape, generator=g).to(dtype) * lp).sum()
        if entropy:
            loss = loss + (torch.randn(ent.shape, generator=g).to(dtype) * ent).sum()
        loss.backward()
        gw = torch.cat([ww.grad, torch.zeros(rows - V, H, dtype=dtype)])
        return lp.detach(), (ent.detach() if entropy else None), hh.grad, gw

    # vs an fp64 oracle. logprob/entropy: the rule of tests/ops/test_op_linear_logprob.py (≤ 1e-5 abs + rel
    # + 2× the materialised fp32 path's error). Gradients: normwise ≤ 3e-5 · max|grad|. Their
    # entries are sums of V terms that nearly cancel (one-hot vs softmax), so their fp32 error
    # follows the summation grouping, not the result: on "even-entropy" the single-process op
    # itself moves from 1.6e-6 to 1.2e-5 normwise between chunk=1000 and chunk=250. A missing or
    # doubled shard contribution is an O(1) error.
    mat, oracle = grads(linear_logprob_ref, torch.float32), grads(linear_logprob_ref, torch.float64)
    for r, res in enumerate(out):
        s, e = bounds[r]
        for i, nm in enumerate(("logprob", "entropy", "grad_hidden", "grad_weight")):
            if res[i] is None:
                continue
            a, m, o = res[i].double(), mat[i].double(), oracle[i].double()
            if nm == "grad_weight":
                m, o = m[s:e], o[s:e]
            err = (a - o).abs()
            if nm.startswith("grad"):
                assert err.max() <= 3e-5 * oracle[i].abs().max(), \
                    f"{name} rank {r} {nm}: max err {err.max():.3e}, max |grad| {oracle[i].abs().max():.3e}"
                continue
            bad = err > 1e-5 + 1e-5 * o.abs() + 2 * (m - o).abs()
            assert not bad.any(), (f"{name} rank {r} {nm}: {int(bad.sum())} mismatches at {bad.nonzero()[:3].tolist()}, "
                                   f"max err {err.max():.3e} (materialised fp32: {(m - o).abs().max():.3e})")
        assert torch.all(res[3][max(0, V - s):] == 0), f"{name} rank {r}: padding rows got a gradient"
        assert torch.equal(res[0], out[0][0]) and torch.equal(res[2], out[0][2]), f"{name}: ranks differ"


def test_linear_logprob_takes_targets_made_under_inference_mode(groups):
    """Rollout ids sampled under torch.inference_mode() are inference tensors; the op saved them
    for its backward as given, which autograd refuses (a RuntimeError naming neither the op nor
    the argument). Now the same log-probs and gradients as plain targets."""
    h, w = _gauss(9, 16, 200)
    bounds = shard_bounds(200, 2)
    tg = _targets(h, w, 16, 200, bounds)
    kw = dict(hidden=h, weight=w, targets=tg, bounds=bounds, return_entropy=True, chunk=64)
    plain = _ok(groups(2).run("linear", **kw), "plain targets")
    got = _ok(groups(2).run("linear", inference_targets=True, **kw), "inference-mode targets")
    for r in range(2):
        for i, nm in enumerate(("logprob", "entropy", "grad_hidden", "grad_weight")):
            assert torch.equal(got[r][i], plain[r][i]), f"rank {r} {nm}: inference-mode targets differ"


@pytest.mark.parametrize("c", [0.0, 1e4])
def test_linear_logprob_entropy_of_offset_logits(groups, c):
    """Entropy and gradients of logits + c (a ones column of hidden against a column of c): the
    shards' sums are relative to their own max and moved to the global one, and the backward
    works relative to the global max, so the offset cancels before any rounding: within the fp32
    rule (1e-5 abs + rel + 2× the materialised path's error; max errors for gradients) of the
    fp64 oracle. Combining Σ e^{z−m_r}·z per shard lost ~c · 2⁻²⁴ (1.9e-3 at c = 1e4, the
    materialised path 8.8e-4); the backward from an fp32 lse, ∂hidden 9.6 against 0.05."""
    h, w = _gauss(17, 64, 1000, seed=2)
    h, w = torch.cat([h, torch.ones(17, 1)], 1), torch.cat([w, torch.full((1000, 1), c)], 1)
    bounds = shard_bounds(1000, 2)
    tg = _targets(h, w, 16, 1000, bounds)
    out = _ok(groups(2).run("linear", hidden=h, weight=w, targets=tg, bounds=bounds, return_entropy=True,
                            temperature=0.7, chunk=128), "offset")
    g = torch.Generator().manual_seed(0)  # the ranks' loss: Σ g·logprob + Σ e·entropy
    g_lp, g_ent = torch.randn(17, generator=g), torch.randn(17, generator=g)

    def ref(dtype):
        hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        lp, ent = linear_logprob_ref(hh, ww, tg, 0.7, return_entropy=True)
        return (ent.detach().double(), *torch.autograd.grad((g_lp.to(dtype) * lp + g_ent.to(dtype) * ent).sum(),
                                                            (hh, ww)))

    mat, oracle = ref(torch.float32), ref(torch.float64)
    for r, res in enumerate(out):
        s, e = bounds[r]
        for name, got, m, o in zip(("entropy", "grad_hidden", "grad_weight"), res[1:], mat,
                                   (oracle[0], oracle[1], oracle[2][s:e])):
            m = m[s:e] if name == "grad_weight" else m
            err, ref_err = (got.double() - o).abs(), (m.double() - o).abs()
            if name != "entropy":
                err, ref_err, o = err.max(), ref_err.max(), o.abs().max()
            bad = err > 1e-5 + 1e-5 * o.abs() + 2 * ref_err
            assert not bad.any(), (f"rank {r} {name} at offset {c}: max err {err.max():.3e} "
                                   f"(materialised fp32: {ref_err.max():.3e})")


@pytest.mark.parametrize("world", [2, 4])
def test_linear_logprob_gradcheck_fp64(groups, world):
    """torch.autograd.gradcheck of (hidden, full weight) → (logprob, entropy) on every rank,
    the weight cut into shards (the last row padding) inside the function."""
    g = torch.Generator().manual_seed(3)
    T, H, rows, V = 3, 4, 11, 10
    h = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.randn(rows, H, generator=g, dtype=torch.float64)
    tg = torch.tensor([0, 9, 5])
    out = _ok(groups(world).run("gradcheck", hidden=h, weight=w, targets=tg, bounds=shard_bounds(rows, world),
                                vocab_size=V, temperature=0.9), "gradcheck")
    assert out == [True] * world


@pytest.mark.parametrize("entropy", [False, True])
def test_linear_logprob_double_backward_raises_naming_the_op(groups, entropy):
    """Gradients taken with create_graph=True are the single-process op's; a backward through them
    raises a RuntimeError naming linear_logprob on every rank — even a backward in which they
    only appear multiplied by 0 (the graph is followed, not the values). The backward's
    out= GEMMs once raised 'functions with out=... arguments don't support automatic
    differentiation' already at the create_graph=True step."""
    g = torch.Generator().manual_seed(4)
    T, H, V = 5, 6, 37
    h, w = torch.randn(T, H, generator=g, dtype=torch.float64), torch.randn(V, H, generator=g, dtype=torch.float64)
    tg = torch.tensor([0, 36, 5, 20, 17])
    bounds = shard_bounds(V, 2)
    out = _ok(groups(2).run("double_backward", hidden=h, weight=w, targets=tg, bounds=bounds,
                            return_entropy=entropy), "double backward")
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    res = linear_logprob(hh, ww, tg, return_entropy=entropy, chunk=7)
    want_h, want_w = torch.autograd.grad(res[0].sum() + res[1].sum() if entropy else res.sum(), (hh, ww))
    for r, (gh, gw, errors) in enumerate(out):
        s, e = bounds[r]
        _close(gh, want_h, f"rank {r} grad_hidden", rel=1e-12)
        _close(gw, want_w[s:e], f"rank {r} grad_weight", rel=1e-12)
        for i, err in enumerate(errors):
            assert err is not None and "linear_logprob: no second derivative" in err[1], \
                f"rank {r} second loss {i}: {err}"


def test_both_ops_compiled_at_two_temperatures(groups):
    """torch.compile (fullgraph=False) of a teacher's topk_logprobs and a policy loss's linear_logprob,
    both with process_group=, in one process, at temperatures 1.0 then 0.7: each call is a graph
    break run eagerly (docs/api.md), so every one gives the single-process op's top-k and
    linear_logprob_ref's log-probs, entropies and gradients (the fp32 rule of
    test_linear_logprob_entropy_of_offset_logits). The second temperature made Dynamo recompile the
    protocol with a symbolic temperature: InternalTorchDynamoError (RecursionError) on both ranks.
    fullgraph=True is Dynamo's error naming the op and process_group= (it was torch's "Attempted to
    call function marked as skipped ... is_functorch_wrapped_tensor", naming neither)."""
    T, H, V, k, temps = 9, 16, 200, 8, (1.0, 0.7)
    h, w = _gauss(T, H, V, seed=6)
    bounds = shard_bounds(V, 2)
    tg = _targets(h, w, k, V, bounds)
    out = _ok(groups(2).run("compiled", hidden=h, weight=w, targets=tg, bounds=bounds, k=k, temperatures=temps),
              "compiled")
    for t in temps:
        _check_topk([res[t][0] for res, _ in out], h, w, tg, k, V, f"compiled topk_logprobs T={t}", temperature=t)
        g = torch.Generator().manual_seed(0)  # the ranks' loss: Σ g·logprob + Σ e·entropy
        g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)

        def ref(dtype):
            hh, ww = h.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
            lp, ent = linear_logprob_ref(hh, ww, tg, t, return_entropy=True)
            return (lp.detach(), ent.detach(),
                    *torch.autograd.grad((g_lp.to(dtype) * lp + g_ent.to(dtype) * ent).sum(), (hh, ww)))

        mat, oracle = ref(torch.float32), ref(torch.float64)
        for r, (res, _) in enumerate(out):
            s, e = bounds[r]
            for name, got, m, o in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), res[t][1:],
                                       (*mat[:3], mat[3][s:e]), (*oracle[:3], oracle[3][s:e])):
                err, ref_err = (got.double() - o).abs().max(), (m.double() - o).abs().max()
                assert err <= 1e-5 + 1e-5 * o.abs().max() + 2 * ref_err, \
                    f"rank {r} T={t} {name}: max err {err:.3e} vs fp64 (materialised fp32: {ref_err:.3e})"
    for r, (_, errors) in enumerate(out):
        for op, err in errors.items():
            assert err is not None and f"{op}(process_group=) runs eagerly" in err[1] and "fullgraph=False" in err[1], \
                f"rank {r} {op} under fullgraph=True: {err and (err[0], err[1][:300])}"


# --------------------------------------------------------------------- rescore
def test_rescore_with_sharded_output_layers(groups):
    """Both models' output layers split over 2 ranks, Megatron-padded to 1,024 rows (997 real)."""
    from acarerank.ato import rescore

    k, outside, tau = 400, "full", 0.9
    want = rescore(tiny_runner(1), tiny_runner(2), rescore_queries(), k=k, outside=outside, temperature=tau)
    out = _ok(groups(2).run("rescore", bounds=shard_bounds(1024, 2), vocab_size=None, k=k, outside=outside,
                            temperature=tau, pad_rows=1024 - 997), "rescore")
    assert 0 < int(want.teacher_in_topk.sum()) < int(want.response_mask.sum()), "targets inside and outside the top-k"
    for r, (lp_old, lp_t, in_topk, atd) in enumerate(out):
        _close(lp_old, want.logp_old, f"rank {r} logp_old", rel=1e-5)
        _close(lp_t, want.logp_teacher, f"rank {r} logp_teacher", rel=1e-5)
        _close(atd, want.atd, f"rank {r} atd", rel=1e-5)
        assert torch.equal(in_topk, want.teacher_in_topk), f"rank {r}: teacher_in_topk differs"


def test_rescore_rejects_a_bare_weight_as_head():
    from acarerank.ato import rescore

    with pytest.raises(TypeError, match="VocabShard"):
        rescore(tiny_runner(1), tiny_runner(2), rescore_queries(), teacher_head=torch.zeros(3, 32))


# --------------------------------------------------------------------- bad input: an error on every rank, no hang
def _bad_cases():
    h, w = _dyadic(17, 64, 1000)
    tg = _targets(h, w, 8, 1000)
    even = shard_bounds(1000, 2)
    base = dict(name="topk", kw=dict(hidden=h, weight=w, targets=tg, bounds=even, k=8))
    inf_w = w.clone()
    inf_w[700, 3] = float("inf")

    def topk(per_rank=None, **over):
        kw = dict(base["kw"], **over)
        return kw, per_rank or {}

    lin = dict(hidden=h, weight=w, targets=tg, bounds=even)
    pos_h, ninf_w = h.clone(), w.clone()           # logit 700 is -inf in every row, never +inf
    pos_h[:, 3] = h[:, 3].abs() + 0.5
    ninf_w[700, 3] = float("-inf")
    return {
        # id: (world, case name, job, per-rank overrides, {rank: (exception, message pattern)}, default pattern)
        "gap": (2, "topk", *topk({1: {"bounds": [(0, 500), (520, 1000)], "pass_start": True}}),
                "do not tile .* a gap at id 500"),
        "overlap": (2, "topk", *topk({1: {"bounds": [(0, 500), (400, 1000)], "pass_start": True}}),
                    "do not tile .* an overlap at id 400"),
        "uneven-no-start": (2, "topk", *topk(bounds=[(0, 600), (600, 1000)]), "pass vocab_start on every rank"),
        "k": (2, "topk", *topk({1: {"k": 9}}), "disagree on k .*rank 0: 8, rank 1: 9"),
        "T": (2, "topk", *topk({1: {"hidden": h[:16], "targets": tg[:16]}}), "disagree on T"),
        "targets": (2, "topk", *topk({1: {"targets": tg.flip(0)}}), "disagree on targets"),
        "temperature": (2, "topk", *topk({0: {"temperature": 0.5}}), "disagree on temperature"),
        "dtype-one-rank": (2, "topk", *topk({1: {"hidden": h.double()}}),
                           {1: "hidden is torch.float64 but weight is torch.float32",
                            0: "rank 1 of the process group rejected its input: TypeError: .*hidden is torch.float64"}),
        "nonfinite-one-rank": (2, "topk", *topk(weight=inf_w), {1: "non-finite logits", 0: "rank 1 failed"}),
        "target-range": (2, "topk", *topk(targets=torch.full((17,), 1000)), "target id 1000 is out of range"),
        "target-negative": (2, "linear", dict(lin, targets=torch.full((17,), -100)), {},
                            r"target id -100 is out of range .*there is no ignore_index"),
        "vocab_size": (2, "topk", *topk(vocab_size=1001), "vocab_size=1001 but the shards hold only 1000 rows"),
        "k>V": (2, "topk", *topk(k=1001), "k must be <= V, got k=1001 > the vocabulary size 1000"),
        "k>MAX_K": (2, "topk", *topk({1: {"backend": "triton"}}, k=513),
                    {1: "k must be <= 512 with the 'triton' backend", 0: "rank 1 .* rejected its input"}),
        "k-world4": (4, "topk", *topk({3: {"k": 7}}, bounds=shard_bounds(1000, 4)), "disagree on k"),
        "entropy": (2, "linear", dict(lin), {1: {"return_entropy": True}}, "disagree on flags"),
        # each rank's dtype valid alone: the backward's all-reduce then met an fp64 buffer and an
        # fp32 one, and gloo aborted the process (SIGABRT) on the size mismatch
        "linear-dtype": (2, "linear", dict(lin), {1: {"hidden": h.double(), "weight": w.double()}},
                         "disagree on hidden's dtype .*rank 0: float32, rank 1: float64"),
        # every rank returned a different result with no error
        "renormalize": (2, "topk", *topk({1: {"renormalize": False}}), "disagree on outside / renormalize"),
        "outside": (2, "topk", *topk({0: {"outside": "mask"}}), "disagree on outside / renormalize"),
        "floor": (2, "topk", *topk({1: {"floor": -10.0}}), "disagree on floor .*rank 0: -20.0, rank 1: -10.0"),
        "entropy-not-bool": (2, "linear", dict(lin), {1: {"return_entropy": "no"}},
                             {1: "return_entropy must be a bool, got str", 0: "rank 1 .* rejected its input"}),
        "renormalize-not-bool": (2, "topk", *topk({1: {"renormalize": "false"}}),
                                 {1: "renormalize must be a bool, got str", 0: "rank 1 .* rejected its input"}),
        # as the single-process op: an error on every rank, never a silent NaN log-prob
        "linear-nonfinite-one-rank": (2, "linear", dict(lin, weight=inf_w), {}, "non-finite logits"),
        # a -inf logit: finite log-probs, but a NaN entropy (0·log 0), an error too
        "linear-entropy-ninf": (2, "linear", dict(lin, hidden=pos_h, weight=ninf_w, return_entropy=True), {},
                                "non-finite logits"),
        # as the single-process op: named before any collective work, not torch's error from the save
        "linear-inference-hidden-one-rank": (2, "linear", dict(lin), {1: {"inference": "hidden"}},
                                             {1: "linear_logprob: hidden is an inference tensor .*torch.no_grad",
                                              0: "rank 1 .* rejected its input: ValueError: linear_logprob: hidden "
                                                 "is an inference tensor"}),
        "linear-inference-weight": (2, "linear", dict(lin, inference="weight"), {},
                                    {1: "linear_logprob: weight is an inference tensor",
                                     0: "linear_logprob: weight is an inference tensor"}),
        "linear-gap": (2, "linear", dict(lin), {1: {"bounds": [(0, 500), (501, 1000)], "pass_start": True}},
                       "do not tile"),
        # docs/api.md: a RuntimeError naming the op and process_group=, on every rank; it was torch's "Batching
        # rule not implemented for c10d::allgather_" (topk) and "must override the setup_context staticmethod"
        # (linear), naming no op
        "topk-vmap-one-rank": (2, "topk", *topk({1: {"vmap": True}}),
                               {1: r"^topk_logprobs: no torch.func.vmap with process_group= .*once per example",
                                0: "rank 1 .* rejected its input: RuntimeError: topk_logprobs: no torch.func.vmap"}),
        "linear-vmap": (2, "linear", dict(lin, vmap=True), {},
                        r"^linear_logprob: no torch.func.vmap with process_group= \(its collectives"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_raises_on_every_rank(groups, case):
    world, name, kw, per_rank, pattern = BAD[case]
    h, w = _dyadic(5, 64, 1000, seed=1)
    tg = _targets(h, w, 4, 1000)
    bounds = shard_bounds(1000, world)
    good = dict(name="topk", kw=dict(hidden=h, weight=w, targets=tg, bounds=bounds, k=4))
    g = groups(world)
    jobs = {r: {"case": {"name": name, "kw": dict(kw, **per_rank.get(r, {}))}} for r in range(world)}
    out = _ok(g.run("bad", per_rank=jobs, good=good), case)
    for r, (err, after) in enumerate(out):
        pat = pattern.get(r, pattern.get(0)) if isinstance(pattern, dict) else pattern
        assert err is not None, f"{case}: rank {r} did not raise"
        assert re.search(pat, err[1]), f"{case}: rank {r} raised {err[0]}: {err[1]!r}, expected /{pat}/"
    _check_topk([after for _, after in out], h, w, tg, 4, 1000, f"{case}: the group after the error")


def test_process_group_none_is_the_single_process_op():
    h, w = _dyadic(5, 16, 50)
    tg = _targets(h, w, 4, 50)
    a, b = topk_logprobs(h, w, tg, k=4), topk_logprobs(h, w, tg, k=4, process_group=None)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="pass process_group too"):
        topk_logprobs(h, w, tg, k=4, vocab_start=0)
    with pytest.raises(ValueError, match="pass process_group too"):
        linear_logprob(h, w, tg, vocab_size=50)
    with pytest.raises(RuntimeError, match="not initialised"):
        topk_logprobs(h, w, tg, k=4, process_group=object())
    assert VocabShard(w, None).vocab_start is None
