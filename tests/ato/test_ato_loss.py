"""clipped_policy_loss (Eq. 11–12) against a per-token plain formula and verl's aggregation modes."""
import pytest
import torch

from acarerank.ato import AGG_MODES, agg_loss, clipped_policy_loss


def _plain(logp, old, adv, mask, eps, agg):
    """Loops over tokens and sequences; no vectorised tricks."""
    N, L = logp.shape
    per = [[0.0] * L for _ in range(N)]
    for i in range(N):
        for j in range(L):
            if mask[i, j]:
                rho = torch.exp(logp[i, j] - old[i, j])
                a = adv[i, j]
                per[i][j] = -torch.minimum(rho * a, torch.clamp(rho, 1 - eps, 1 + eps) * a)
    tot = sum(per[i][j] for i in range(N) for j in range(L))
    counts = [int(mask[i].sum()) for i in range(N)]
    if agg == "token-mean":
        return tot / sum(counts)
    if agg == "seq-mean-token-sum":
        return sum(sum(per[i]) for i in range(N)) / N
    if agg == "seq-mean-token-mean":
        return sum(sum(per[i]) / counts[i] for i in range(N)) / N
    return tot / L


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    N, L = 4, 6
    old = -torch.rand(N, L, generator=g) * 3
    logp = old + torch.randn(N, L, generator=g) * 0.4  # ratios both inside and outside [0.8, 1.2]
    adv = torch.randn(N, L, generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    return logp, old, adv, mask


@pytest.mark.parametrize("agg", AGG_MODES)
def test_matches_plain_formula(agg):
    logp, old, adv, mask = _batch()
    got = clipped_policy_loss(logp, old, adv, mask, eps_clip=0.2, agg=agg)
    want = _plain(logp, old, adv, mask, 0.2, agg)
    assert torch.allclose(got, torch.as_tensor(want, dtype=got.dtype), atol=1e-6), (agg, got.item(), float(want))


def test_gradient_at_snapshot_is_advantage_weighted_score_lemma1():
    """Lemma 1 (Appendix A): at θ = θ_old the clip is inactive and ∂L/∂logp = −A·M/ΣM (token-mean)."""
    _, old, adv, mask = _batch(1)
    logp = old.clone().requires_grad_()
    clipped_policy_loss(logp, old, adv, mask).backward()
    want = torch.where(mask, -adv / mask.sum(), torch.zeros(()))
    assert torch.allclose(logp.grad, want, atol=1e-7)


def test_clip_stops_gradient_only_where_ppo_says():
    old = torch.zeros(1, 4)
    logp = torch.log(torch.tensor([[1.5, 1.5, 0.5, 0.5]])).requires_grad_()  # ρ = 1.5, 1.5, 0.5, 0.5
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    clipped_policy_loss(logp, old, adv, torch.ones(1, 4, dtype=torch.bool), eps_clip=0.2).backward()
    g = logp.grad[0]
    # ρ > 1+ε with A > 0, and ρ < 1−ε with A < 0: clipped term is the min -> no gradient
    assert g[0] == 0 and g[3] == 0
    # the other two take the unclipped branch: ∂(−ρA/4)/∂logp = −ρA/4
    assert torch.allclose(g[1], torch.tensor(1.5 / 4)) and torch.allclose(g[2], torch.tensor(-0.5 / 4))


def test_padding_cannot_make_nan():
    logp, old, adv, mask = _batch(2)
    old = torch.where(mask, old, torch.full_like(old, float("-inf")))
    logp = torch.where(mask, logp, torch.full_like(logp, float("nan"))).requires_grad_()
    adv = torch.where(mask, adv, torch.full_like(adv, float("inf")))
    for agg in AGG_MODES:
        loss = clipped_policy_loss(logp, old, adv, mask, agg=agg)
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), agg
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert clipped_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), empty) == 0


def test_bad_input():
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="agg must be one of"):
        clipped_policy_loss(logp, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="must all be"):
        clipped_policy_loss(logp, old[:, :3], adv, mask)
    with pytest.raises(ValueError, match="eps_clip"):
        clipped_policy_loss(logp, old, adv, mask, eps_clip=0.0)


def test_agg_loss_takes_its_mask_as_bool_of_the_same_shape():
    """agg_loss is public: a [L] mask against [N, L] losses broadcast (token-mean 2.0 for all-ones
    losses of 2 sequences, instead of 1.0), and a mask of 0.5 counted a whole token in the
    numerator but half of one in the denominator. Now: the same shape, read as bool throughout
    (a 0.5 entry is refused unless validate=False: test_agg_loss_refuses_a_mask_entry_other_than_0_or_1)."""
    ones = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"must both be \[N, L\]; got \(2, 3\) and \(3,\)"):
        agg_loss(ones, torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask must be a tensor, got list"):
        agg_loss(ones, [[1, 1, 1], [1, 1, 1]])
    with pytest.raises(TypeError, match="logp_old must be a tensor, got list"):
        clipped_policy_loss(ones, [[0.0] * 3] * 2, ones, ones.bool())
    half = torch.tensor([[0.5, 1.0, 0.0], [1.0, 1.0, 0.0]])
    for agg in AGG_MODES:
        assert agg_loss(ones, half, agg, validate=False) == agg_loss(ones, half.bool(), agg), agg
    assert agg_loss(ones, half, "token-mean", validate=False) == 1.0


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_of_an_empty_batch_or_length_is_zero(agg):
    """As the docstring says of a batch without valid tokens: 0, with a zero gradient. N = 0 made
    the seq-mean modes a mean of nothing and L = 0 seq-mean-token-sum-norm a division by 0: NaN."""
    for shape in ((0, 5), (3, 0), (0, 0)):
        loss_mat = torch.randn(shape).requires_grad_()
        out = agg_loss(loss_mat, torch.ones(shape, dtype=torch.bool), agg)
        (g,) = torch.autograd.grad(out, loss_mat)
        assert out.item() == 0.0 and g.shape == shape, (agg, shape, out)
    logp = torch.zeros(0, 4, requires_grad=True)
    assert clipped_policy_loss(logp, torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4, dtype=torch.bool),
                               agg=agg) == 0


def test_agg_loss_and_eps_clip_name_their_bad_type():
    with pytest.raises(TypeError, match="loss_mat must be floating point, got torch.int64"):
        agg_loss(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3), "seq-mean-token-sum")
    logp, old, adv, mask = _batch()
    for bad in ("0.2", None, True):
        with pytest.raises(ValueError, match="eps_clip must be a number > 0"):
            clipped_policy_loss(logp, old, adv, mask, eps_clip=bad)
    # the ratio is computed in logp's dtype: an int64 logp once truncated logp_old (-0.9 -> 0)
    # and returned a loss
    with pytest.raises(TypeError, match="logp must be floating point, got torch.int64"):
        clipped_policy_loss(logp.detach().long(), old, adv, mask)


def _plain_agg(loss_mat, mask, agg):
    """verl's formulas (module docstring) by loops over the valid tokens only."""
    N, L = loss_mat.shape
    rows = [[float(loss_mat[i, j]) for j in range(L) if mask[i, j]] for i in range(N)]
    if agg == "token-mean":
        return sum(map(sum, rows)) / max(sum(map(len, rows)), 1)
    if agg == "seq-mean-token-sum":
        return sum(map(sum, rows)) / N
    if agg == "seq-mean-token-mean":
        return sum(sum(r) / max(len(r), 1) for r in rows) / N
    return sum(map(sum, rows)) / L


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_agg_loss_refuses_a_nonfinite_loss_at_a_valid_token(value, agg):
    """agg_loss is public (a user's own per-token loss): a NaN at a valid token gave a NaN loss
    with no error, ±inf an infinite one, where clipped_policy_loss named its bad input. Now the
    same ValueError naming loss_mat and its first bad [i, l]; at a masked token it is padding
    (never read: the loss equals the masked reference, its gradient finite), and validate=False
    is the unchecked loss."""
    _, _, loss, mask = _batch(7)
    loss = loss.clone()
    loss[1, 2] = loss[3, 0] = value
    with pytest.raises(ValueError, match=rf"agg_loss: loss_mat\[1, 2\] is {value} at a valid token.*"
                                         rf"2 such position\(s\), first \[\(1, 2\), \(3, 0\)\]"):
        agg_loss(loss.clone().requires_grad_(), mask, agg)
    unchecked = agg_loss(loss, mask, agg, validate=False)
    assert not torch.isfinite(unchecked), (agg, unchecked)  # the number the check stands in front of
    loss[1, 2] = loss[3, 0] = 0.5
    loss[2, 5] = value  # padding
    padded = loss.clone().requires_grad_()
    got = agg_loss(padded, mask, agg)
    (g,) = torch.autograd.grad(got, padded)
    torch.testing.assert_close(got, torch.tensor(_plain_agg(loss, mask, agg)), rtol=1e-6, atol=1e-7)
    assert torch.isfinite(g).all() and (g[~mask] == 0).all(), g


@pytest.mark.parametrize("agg", AGG_MODES)
def test_agg_loss_refuses_a_mask_entry_other_than_0_or_1(agg):
    """verl's agg_loss multiplies by the mask: a weighted mask ported from it (0.5) gave another
    loss here, read as bool, with no error. Now a ValueError naming the first such valid entry and
    the rule; 0/1 floats and integers are the bool mask (values within 1e-6), a 0.5 at a masked
    token cannot exist (0 is the masked value), and validate=False reads the mask as bool."""
    _, _, loss, mask = _batch(8)
    want = agg_loss(loss, mask, agg)
    for ok in (mask.float(), mask.double(), mask.to(torch.uint8), mask.long()):
        torch.testing.assert_close(agg_loss(loss, ok, agg), want, rtol=1e-6, atol=1e-6)
    weighted = mask.float()
    weighted[1, 1] = weighted[3, 4] = 0.5
    with pytest.raises(ValueError, match=r"agg_loss: mask\[1, 1\] is 0\.5; 2 such position\(s\), first "
                                         r"\[\(1, 1\), \(3, 4\)\]\. A mask entry must be 0 or 1: acarerank "
                                         r"reads a mask as bool.*unlike verl's agg_loss, which multiplies by it"):
        agg_loss(loss, weighted, agg)
    for bad, shown in ((2, "2"), (-1, "-1")):  # not a 0/1 mask either, in a float or an integer one
        for dtype in (torch.float32, torch.int64):
            m = mask.to(dtype)
            m[0, 3] = bad
            with pytest.raises(ValueError, match=rf"agg_loss: mask\[0, 3\] is {shown}(\.0)?; 1 such"):
                agg_loss(loss, m, agg)
    assert torch.equal(agg_loss(loss, weighted, agg, validate=False), want)
    with pytest.raises(ValueError, match=r"clipped_policy_loss: mask\[1, 1\] is 0\.5;"):
        clipped_policy_loss(*_batch(8)[:3], weighted, agg=agg)
    with pytest.raises(TypeError, match="agg_loss: validate must be a bool"):
        agg_loss(loss, mask, agg, validate=1)
    with pytest.raises(ValueError, match="agg_loss: mask is on meta, loss_mat is on cpu"):
        agg_loss(loss, mask.to("meta"), agg)


def test_norm_length_is_a_constant_divisor_whatever_the_padding():
    """seq-mean-token-sum-norm divided by the padded length: the same rollouts padded to the
    batch's longest (``rescore``) gave another loss, and gradient scale, in each batch. With
    ``norm_length`` (the response budget, verl's fixed response length) it is Σ ℓ·M / norm_length."""
    logp, old, adv, mask = _batch()
    N, L = logp.shape
    pad = 7  # the same rollouts, padded further (a batch whose longest rollout is longer)
    wide = [torch.cat([t, torch.zeros(N, pad, dtype=t.dtype)], dim=1) for t in (logp, old, adv, mask)]
    budget = L + pad + 5
    short = clipped_policy_loss(logp, old, adv, mask, agg="seq-mean-token-sum-norm", norm_length=budget)
    long = clipped_policy_loss(*wide, agg="seq-mean-token-sum-norm", norm_length=budget)
    plain = _plain(logp, old, adv, mask, 0.2, "seq-mean-token-sum-norm") * L / budget
    torch.testing.assert_close(short, long, rtol=1e-6, atol=0)
    torch.testing.assert_close(short, torch.as_tensor(plain, dtype=short.dtype), rtol=1e-5, atol=1e-7)
    # without it the divisor is the padded length (documented), so the two batches differ
    default = [clipped_policy_loss(*t, agg="seq-mean-token-sum-norm") for t in ((logp, old, adv, mask), wide)]
    assert not torch.allclose(default[0], default[1]), default


@pytest.mark.parametrize("kw, needle", [
    (dict(agg="token-mean", norm_length=10), "only"),            # given where it is not used: never ignored
    (dict(agg="seq-mean-token-sum-norm", norm_length=0), "positive"),
    (dict(agg="seq-mean-token-sum-norm", norm_length=True), "positive"),
    (dict(agg="seq-mean-token-sum-norm", norm_length=2.0), "positive"),
    (dict(agg="seq-mean-token-sum-norm", norm_length=1), "shorter than the padded length"),
])
def test_a_bad_norm_length_is_named(kw, needle):
    logp, old, adv, mask = _batch()
    with pytest.raises(ValueError, match="norm_length") as e:
        clipped_policy_loss(logp, old, adv, mask, **kw)
    assert needle in str(e.value), e.value
    with pytest.raises(ValueError, match="norm_length"):
        agg_loss(logp.detach(), mask, **kw)


@pytest.mark.parametrize("name", ["logp_old", "advantage", "logp"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_input_at_a_valid_token_is_named(name, value):
    """A NaN logp_old (or advantage, or logp) at a valid token gave a NaN loss with no error, and
    ±inf a finite wrong one (the log-ratio is clamped to ±20: logp_old = +inf made ρ = e⁻²⁰).
    Now a ValueError naming the tensor and its first bad position; padding may still hold
    anything, and validate=False is the unchecked loss."""
    logp, old, adv, mask = _batch(3)
    args = {"logp": logp.clone(), "logp_old": old.clone(), "advantage": adv.clone()}
    args[name][1, 2] = value
    args[name][3, 0] = value
    args[name][2, 5] = value  # padding: not an error
    with pytest.raises(ValueError, match=rf"clipped_policy_loss: {name}\[1, 2\] is {value} at a valid token.*"
                                         rf"2 such position\(s\), first \[\(1, 2\), \(3, 0\)\]"):
        clipped_policy_loss(args["logp"].clone().requires_grad_(), args["logp_old"], args["advantage"], mask)
    unchecked = clipped_policy_loss(args["logp"], args["logp_old"], args["advantage"], mask, validate=False)
    if value != value:  # NaN: the loss the check stands in front of
        assert torch.isnan(unchecked)
    args[name][1, 2] = args[name][3, 0] = 0.0
    loss = clipped_policy_loss(args["logp"], args["logp_old"], args["advantage"], mask)
    want = _plain(args["logp"], args["logp_old"], args["advantage"], mask, 0.2, "token-mean")
    assert torch.allclose(loss, torch.as_tensor(want, dtype=loss.dtype), atol=1e-6)


def test_a_float_mask_with_nan_and_inputs_of_the_wrong_type_are_named():
    """A NaN in a float mask read as valid (nonzero); an integer logp_old or advantage (ids passed
    by mistake) was cast to logp's dtype; a mask on another device failed inside torch.where."""
    logp, old, adv, mask = _batch(4)
    fmask = mask.float()
    fmask[0, 4] = float("nan")
    with pytest.raises(ValueError, match=r"clipped_policy_loss: mask\[0, 4\] is nan;"):
        clipped_policy_loss(logp, old, adv, fmask)
    want = clipped_policy_loss(logp, old, adv, mask)
    assert torch.equal(clipped_policy_loss(logp, old, adv, mask.float()), want)
    assert torch.equal(clipped_policy_loss(logp, old, adv, mask.to(torch.uint8)), want)
    with pytest.raises(TypeError, match="clipped_policy_loss: logp_old must be floating point, got torch.int64"):
        clipped_policy_loss(logp, old.long(), adv, mask)
    with pytest.raises(TypeError, match="clipped_policy_loss: advantage must be floating point, got torch.int32"):
        clipped_policy_loss(logp, old, adv.int(), mask)
    with pytest.raises(ValueError, match="clipped_policy_loss: mask is on meta, logp is on cpu"):
        clipped_policy_loss(logp, old, adv, mask.to("meta"))
    with pytest.raises(TypeError, match="validate must be a bool"):
        clipped_policy_loss(logp, old, adv, mask, validate="no")


def test_the_check_runs_in_a_compiled_loss():
    """The check reads the data: as a Python branch it was an error under fullgraph=True. It runs
    inside a registered op, so the compiled loss raises the eager error and otherwise equals it."""
    logp, old, adv, mask = _batch(5)
    step = torch.compile(clipped_policy_loss, backend="aot_eager", fullgraph=True, dynamic=True)
    assert torch.allclose(step(logp, old, adv, mask), clipped_policy_loss(logp, old, adv, mask), rtol=1e-6, atol=0)
    old[2, 0] = float("nan")
    with pytest.raises(ValueError, match=r"logp_old\[2, 0\] is nan at a valid token"):
        step(logp, old, adv, mask)
    # agg_loss on its own, validate on (the default), its mask and loss_mat checks included
    agg = torch.compile(agg_loss, backend="aot_eager", fullgraph=True, dynamic=True)
    loss_mat = adv.clone().requires_grad_()
    fmask = mask.float()
    for mode in AGG_MODES:
        got = agg(loss_mat, fmask, mode)
        (g,) = torch.autograd.grad(got, loss_mat)
        want = agg_loss(loss_mat, fmask, mode)
        (want_g,) = torch.autograd.grad(want, loss_mat)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        torch.testing.assert_close(g, want_g, rtol=1e-6, atol=0)
    nan = adv.clone()
    nan[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"agg_loss: loss_mat\[3, 1\] is nan at a valid token"):
        agg(nan, fmask)
    fmask[1, 0] = 0.5
    with pytest.raises(ValueError, match=r"agg_loss: mask\[1, 0\] is 0\.5;"):
        agg(adv, fmask)


def test_opcheck_policy_loss_valid():
    """The check's registered op: its fake kernel agrees with the real one (shape, dtype, strides),
    on a transposed float mask and an empty batch too."""
    from acarerank.ato.loss import policy_loss_valid

    logp, old, adv, mask = _batch(6)
    for m in (mask, mask.float().t().contiguous().t(), mask[:0]):
        n = m.shape[0]
        torch.library.opcheck(policy_loss_valid, (logp[:n], old[:n], adv[:n], m, True))


def test_opcheck_agg_loss_valid():
    """agg_loss's check op, as policy_loss_valid's: fake and real kernels agree (a transposed
    float mask, an integer one, an empty batch; validate off too)."""
    from acarerank.ato.loss import agg_loss_valid

    _, _, loss, mask = _batch(6)
    for m in (mask, mask.float().t().contiguous().t(), mask.to(torch.uint8), mask[:0]):
        for validate in (True, False):
            torch.library.opcheck(agg_loss_valid, (loss[:m.shape[0]], m, validate))
