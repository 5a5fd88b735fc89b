"""linear_logprob (chunked forward + backward) against ``linear_logprob_ref`` (materialised
fp32 logits, log_softmax, autograd), and ``torch.autograd.gradcheck`` in fp64."""
import pytest
import torch

from acarerank.ops.linear_logprob import FP32_GRAD_ENV_VAR, linear_logprob, linear_logprob_ref


pytestmark = pytest.mark.usefixtures("one_thread")


def _inputs(T, H, V, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).to(dtype).requires_grad_()
    tg = torch.randint(0, V, (T,), generator=g)
    return h, w, tg


def _run(fn, h, w, tg, tau, entropy, g_lp, g_ent):
    out = fn(h, w, tg, tau, entropy)
    lp, ent = out if entropy else (out, None)
    loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy else 0)
    gh, gw = torch.autograd.grad(loss, (h, w))
    return lp.detach(), (ent.detach() if entropy else None), gh, gw


def _close(a, b, atol, rtol, what):
    err = (a.float() - b.float()).abs()
    bad = err > atol + rtol * b.float().abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} mismatches, first at {bad.nonzero()[:3].tolist()}, "
                           f"max err {err.max().item():.3e}")


@pytest.mark.parametrize("T,H,V,tau,entropy,chunk", [
    (1, 32, 4099, 1.0, False, None),
    (97, 48, 4099, 0.7, True, 500),
    (64, 16, 151669, 1.0, True, None),  # the real vocabulary
    (7, 24, 769, 1.3, False, 1),        # one vocabulary row per chunk
])
def test_fp32_forward_and_grads_match_materialised(T, H, V, tau, entropy, chunk):
    """fp32 vs the materialised fp32 path: ≤ 1e-5 (abs + rel), widened where the materialised
    path itself is further than that from an fp64 oracle (a grad_hidden row sums 151,669
    terms; flash-attn's rule: our error ≤ 2× that of plain PyTorch at the same precision)."""
    h, w, tg = _inputs(T, H, V, seed=T)
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)
    ours = _run(lambda *a: linear_logprob(*a, chunk=chunk), h, w, tg, tau, entropy, g_lp, g_ent)
    ref = _run(linear_logprob_ref, h, w, tg, tau, entropy, g_lp, g_ent)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    oracle = _run(linear_logprob_ref, h64, w64, tg, tau, entropy, g_lp.double(), g_ent.double())
    assert ours[0].dtype == torch.float32 and ours[0].shape == (T,)
    for name, a, b, o in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), ours, ref, oracle):
        if a is None:
            continue
        ref_err = (b.double() - o).abs()
        err = (a.double() - o).abs()
        bad = err > 1e-5 + 1e-5 * o.abs() + 2 * ref_err
        assert not bad.any(), (f"fp32 {name} T={T} V={V}: {int(bad.sum())} mismatches at {bad.nonzero()[:3].tolist()}, "
                               f"max err {err.max().item():.3e} (materialised fp32: {ref_err.max().item():.3e})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_rule(dtype, monkeypatch):
    """Rule: outputs equal the fp32 oracle on the same rounded inputs to fp32 tolerance;
    gradients are that fp32 gradient rounded once to ``dtype`` (≤ one rounding: 2⁻⁸ / 2⁻¹¹) —
    for bf16 with ACARERANK_LINEAR_LOGPROB_FP32_GRAD=1 (fp32 ∂z; the default bf16 ∂z of a CPU with
    AVX512_BF16: test_bf16_gradients_within_twice_the_error_of_plain_bf16_autograd)."""
    monkeypatch.setenv(FP32_GRAD_ENV_VAR, "1")
    h, w, tg = _inputs(33, 32, 2053, dtype=dtype, seed=3)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(33, generator=g), torch.randn(33, generator=g)
    ours = _run(lambda *a: linear_logprob(*a, chunk=300), h, w, tg, 0.8, True, g_lp, g_ent)
    h32 = h.detach().float().requires_grad_()
    w32 = w.detach().float().requires_grad_()
    ref = _run(linear_logprob_ref, h32, w32, tg, 0.8, True, g_lp, g_ent)
    assert ours[2].dtype == ours[3].dtype == dtype
    _close(ours[0], ref[0], 1e-5, 1e-5, f"{dtype} logprob")
    _close(ours[1], ref[1], 1e-5, 1e-5, f"{dtype} entropy")
    rel = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    _close(ours[2], ref[2], 1e-5, rel, f"{dtype} grad_hidden")
    _close(ours[3], ref[3], 1e-5, rel, f"{dtype} grad_weight")


def _plain_bf16(h, w, tg, tau, entropy):
    """What a user writes in bf16: materialised bf16 logits, log_softmax, autograd (the yardstick)."""
    lsm = ((h @ w.T) / tau).log_softmax(dim=1)
    lp = lsm.gather(1, tg[:, None])[:, 0]
    return (lp, -(lsm.exp() * lsm).sum(dim=1)) if entropy else lp


@pytest.mark.parametrize("fp32_grad", ["0", "1"])
@pytest.mark.parametrize("T,H,V,tau,entropy,chunk,scale", [
    (5, 32, 37, 1.0, True, 8, 1.0),          # tiny vocabulary, odd last chunk
    (64, 64, 151669, 1.0, True, None, 1.0),  # the real vocabulary (74 chunks, last one 117 wide)
    (97, 48, 4099, 0.7, True, 500, 1.0),     # T and V not multiples of anything, τ ≠ 1
    (33, 64, 3001, 1.0, False, 300, 8.0),    # large logits (|z| up to ~60): peaked softmax
    (33, 64, 3001, 1.3, True, 301, 8.0),     # the same with entropy, odd chunks
])
def test_bf16_gradients_within_twice_the_error_of_plain_bf16_autograd(T, H, V, tau, entropy, chunk, scale, fp32_grad,
                                                                       monkeypatch):
    """The project's rule (flash-attn's): against the fp32 reference on the same bf16 inputs, the
    op's bf16 gradients are off by at most 2× what plain bf16 autograd (``_plain_bf16``) is off,
    in max and in norm, for ∂hidden and ∂W. Default (on a CPU with AVX512_BF16): ∂z rounded to
    bf16 for the two gradient GEMMs: 0.07–0.72× plain bf16's max error and 0.10–0.61× its norm
    error on these cases (∂z rounded to 4 mantissa bits instead fails 4 of the 5, at up to 6× its
    max error); ACARERANK_LINEAR_LOGPROB_FP32_GRAD=1 (fp32 ∂z) meets it too."""
    monkeypatch.setenv(FP32_GRAD_ENV_VAR, fp32_grad)
    g = torch.Generator().manual_seed(T + V)
    h = (scale * torch.randn(T, H, generator=g)).bfloat16()
    w = (0.5 * torch.randn(V, H, generator=g) / (H / 16) ** 0.5).bfloat16()
    tg = torch.randint(0, V, (T,), generator=g)
    g_lp, g_ent = torch.randn(T, generator=g), torch.randn(T, generator=g)

    def grads(fn, hh, ww):
        return _run(fn, hh.clone().requires_grad_(), ww.clone().requires_grad_(), tg, tau, entropy, g_lp, g_ent)[2:]

    ours = grads(lambda *a: linear_logprob(*a, chunk=chunk), h, w)
    plain = grads(_plain_bf16, h, w)
    ref = grads(linear_logprob_ref, h.float(), w.float())
    for name, a, p, r in zip(("grad_hidden", "grad_weight"), ours, plain, ref):
        assert a.dtype == torch.bfloat16
        e, ep = (a.double() - r.double()).abs(), (p.double() - r.double()).abs()
        for what, ours_err, plain_err in (("max", e.max(), ep.max()), ("norm", e.norm(), ep.norm())):
            assert ours_err <= 2 * plain_err, (f"{name} {what} error {ours_err:.3e} > 2× plain bf16 autograd's "
                                               f"{plain_err:.3e} (fp32 grad {fp32_grad})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bad_fp32_grad_switch_is_an_error_naming_it(dtype, monkeypatch):
    """ACARERANK_LINEAR_LOGPROB_FP32_GRAD is 0 or 1; anything else is a ValueError naming it at the
    backward, on every path (not silently the default where the bf16 GEMM does not run)."""
    h, w, tg = _inputs(4, 8, 30, dtype=dtype, seed=8)
    lp = linear_logprob(h, w, tg)
    monkeypatch.setenv(FP32_GRAD_ENV_VAR, "yes")
    with pytest.raises(ValueError, match=f"{FP32_GRAD_ENV_VAR} must be 0 or 1, got 'yes'"):
        lp.sum().backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autocast_keeps_the_precision_rule(dtype):
    """Forward and backward inside ``torch.autocast`` (a training loop's region) equal the same
    calls outside it: the rule above still holds. The bf16 weight gradient's GEMM once ran in
    bf16 there (relative errors up to 3.3 against the ≤ 2⁻⁸ of the rule, no error)."""
    h, w, tg = _inputs(64, 256, 3000, dtype=dtype, seed=7)
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(64, generator=g), torch.randn(64, generator=g)
    outside = _run(lambda *a: linear_logprob(*a, chunk=700), h, w, tg, 0.9, True, g_lp, g_ent)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = _run(lambda *a: linear_logprob(*a, chunk=700), h, w, tg, 0.9, True, g_lp, g_ent)
    for name, a, b in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), inside, outside):
        assert a.dtype == b.dtype, f"{dtype} {name} under autocast: {a.dtype}, outside {b.dtype}"
        _close(a, b, 1e-6, 1e-6, f"{dtype} {name} under autocast")


def test_gradcheck_fp64():
    h, w, tg = _inputs(5, 6, 37, dtype=torch.float64, seed=4)
    assert torch.autograd.gradcheck(lambda a, b: linear_logprob(a, b, tg, temperature=0.7, return_entropy=True, chunk=8),
                                    (h, w))
    assert torch.autograd.gradcheck(lambda a, b: linear_logprob(a, b, tg, chunk=37), (h, w))


def test_only_one_input_needs_grad_and_no_grad_mode():
    h, w, tg = _inputs(9, 8, 300, seed=5)
    wd = w.detach()
    lp = linear_logprob(h, wd, tg, chunk=64)
    (gh,) = torch.autograd.grad(lp.sum(), (h,))
    ref_gh, = torch.autograd.grad(linear_logprob_ref(h, wd, tg).sum(), (h,))
    _close(gh, ref_gh, 1e-5, 1e-5, "grad_hidden only")
    with torch.inference_mode():
        lp2 = linear_logprob(h.detach(), wd, tg)
    _close(lp2, lp.detach(), 1e-6, 0, "inference mode")


def test_softmax_identities():
    """Paper-independent sanity: exp(logprob) summed over all targets of a row is 1, and the
    entropy equals −Σ p log p computed from those log-probs."""
    g = torch.Generator().manual_seed(6)
    V, H = 211, 8
    h = torch.randn(1, H, generator=g).expand(V, H).contiguous()
    w = torch.randn(V, H, generator=g)
    lp, ent = linear_logprob(h, w, torch.arange(V), return_entropy=True, chunk=50)
    assert abs(lp.exp().sum().item() - 1.0) < 1e-5
    assert abs(ent[0].item() + (lp.exp() * lp).sum().item()) < 1e-5


def test_bad_input():
    h, w, tg = _inputs(3, 8, 50)
    with pytest.raises(ValueError, match="H=8 but weight has H=4"):
        linear_logprob(h, w[:, :4], tg)
    with pytest.raises(TypeError, match="targets must be int64"):
        linear_logprob(h, w, tg.float())
    with pytest.raises(ValueError, match=r"target id .* is out of range \[0, V=50\)"):
        linear_logprob(h, w, torch.tensor([0, 50, 1]))
    with pytest.raises(TypeError, match="cast one of them"):
        linear_logprob(h, w.detach().double(), tg)
    with pytest.raises(ValueError, match="temperature"):
        linear_logprob(h, w, tg, temperature=-1.0)
    # 0 in fp32 (the chunk logits are divided by fp32(τ)): every logit inf/NaN, once refused as
    # "non-finite logits (inf/NaN in hidden or weight)"
    with pytest.raises(ValueError, match=r"temperature must be a finite number > 0 \(in float32 too\)"):
        linear_logprob(h, w, tg, temperature=1e-50)
    with pytest.raises(ValueError, match="chunk"):
        linear_logprob(h, w, tg, chunk=0)
    # nonzero in fp32 (a denormal), so accepted, but every h·w / τ overflows: the error names the
    # temperature as a cause, not only "inf/NaN in hidden or weight"
    with pytest.raises(ValueError, match=r"non-finite logits .* h·w / temperature past fp32's range"):
        linear_logprob(h, w, tg, temperature=1e-45)
    # a flag, not a truthy value: "no" returned the entropy too
    with pytest.raises(TypeError, match="return_entropy must be a bool, got str"):
        linear_logprob(h, w, tg, return_entropy="no")


@pytest.mark.parametrize("chunk", [64, 100, None])
def test_leading_overflowed_logits_do_not_depend_on_chunk(chunk):
    """Logits of ids [0, 64) overflow fp32 to −inf (finite weights, products beyond fp32), the
    rest are finite: the log-probs and gradients are the materialised ones whatever the chunk.
    With chunk=64 the first chunk once held only −inf: −inf − (−inf) = NaN, a "non-finite
    logits" error that chunk=100 did not raise."""
    h, w, tg = _inputs(4, 8, 300, seed=8)
    with torch.no_grad():
        h[:, 0] = h[:, 0].abs() + 2.0
        w[:64, 0] = -3e38  # · ≥ 2: beyond −3.4e38
    tg = 64 + tg % 236
    g_lp = torch.randn(4, generator=torch.Generator().manual_seed(9))
    ours = _run(lambda *a: linear_logprob(*a, chunk=chunk), h, w, tg, 1.0, False, g_lp, None)
    ref = _run(linear_logprob_ref, h, w, tg, 1.0, False, g_lp, None)
    assert torch.isfinite(ref[0]).all()  # the test's premise
    for name, a, b in zip(("logprob", "grad_hidden", "grad_weight"), ours[:1] + ours[2:], ref[:1] + ref[2:]):
        _close(a, b, 1e-5, 1e-5, f"chunk={chunk} {name}")


def test_non_finite_logits_raise_with_entropy_too():
    """inf/NaN in hidden or weight is an error naming the rows. A -inf logit alone leaves every
    log-prob finite, but the entropy's 0·log 0 is NaN there (the materialised reference gives
    NaN too): with return_entropy that is an error as well, never a silent NaN entropy."""
    h, w, tg = (x.detach() for x in _inputs(4, 8, 50))
    h[:, 0] = h[:, 0].abs() + 0.5
    w[7, 0] = float("-inf")                        # logit 7 is -inf in every row, never +inf
    tg[tg == 7] = 8
    assert torch.isfinite(linear_logprob(h, w, tg)).all()  # the log-probs themselves are fine
    assert torch.isnan(linear_logprob_ref(h, w, tg, return_entropy=True)[1]).all()
    with pytest.raises(ValueError, match=r"non-finite logits .* rows \[0, 1, 2, 3\]"):
        linear_logprob(h, w, tg, return_entropy=True)
    w[7, 0] = float("inf")                         # +inf: the log-probs are NaN, entropy or not
    with pytest.raises(ValueError, match=r"non-finite logits .* rows \[0, 1, 2, 3\]"):
        linear_logprob(h, w, tg)


def _offset_inputs(c, T=37, H=32, V=3001, seed=10):
    """fp32 hidden [T, H+1] and weight [V, H+1] whose logits are those of ``_inputs`` plus c in every
    entry (a ones column of hidden against a column of c in weight): a common offset per row."""
    h, w, tg = (x.detach() for x in _inputs(T, H, V, seed=seed))
    return torch.cat([h, torch.ones(T, 1)], 1), torch.cat([w, torch.full((V, 1), c)], 1), tg


@pytest.mark.parametrize("c", [0.0, 100.0, 1e4])
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_entropy_does_not_depend_on_a_common_offset(c, tau):
    """Entropy of logits + c vs the fp64 oracle: the rule of the fp32 test above (1e-5 abs + rel +
    2× the materialised fp32 path's error). As lse − Σ p·z the entropy cancelled two numbers of
    size c computed in fp32: 6× the materialised path's error at c = 1e4 (3.5e-3 vs 5.8e-4)."""
    h, w, tg = _offset_inputs(c)
    _, ent = linear_logprob(h, w, tg, tau, return_entropy=True, chunk=500)
    _, ref = linear_logprob_ref(h, w, tg, tau, return_entropy=True)
    _, oracle = linear_logprob_ref(h.double(), w.double(), tg, tau, return_entropy=True)
    ref_err, err = (ref.double() - oracle).abs(), (ent.double() - oracle).abs()
    bad = err > 1e-5 + 1e-5 * oracle.abs() + 2 * ref_err
    assert not bad.any(), (f"entropy at offset {c}: {int(bad.sum())} mismatches at {bad.nonzero()[:3].tolist()}, "
                           f"max err {err.max().item():.3e} (materialised fp32: {ref_err.max().item():.3e})")


@pytest.mark.parametrize("c", [0.0, 100.0, 1e4])
def test_grads_do_not_depend_on_a_common_offset(c):
    """Gradients of logits + c vs the fp64 oracle, the same rule (1e-5 abs + rel + 2× the
    materialised path's error). With lse and E_p[z] rounded to fp32, each p = exp(z − lse) carried
    an error of ~c · 2⁻²⁴: ∂hidden 3.6e-3 against the materialised 3.8e-4 at c = 100, 22 (of
    gradients ≤ 6) against 0.02 at c = 1e4. The backward now works relative to the row's max.
    Gradients compare max errors (the ones column's entries are c · Σ_j ∂L/∂z_j, sums that cancel
    to ~0: their fp32 error follows the summation grouping, entry by entry)."""
    h, w, tg = _offset_inputs(c)
    h, w = h.requires_grad_(), w.requires_grad_()
    g = torch.Generator().manual_seed(11)
    g_lp, g_ent = torch.randn(h.shape[0], generator=g), torch.randn(h.shape[0], generator=g)
    ours = _run(lambda *a: linear_logprob(*a, chunk=500), h, w, tg, 0.7, True, g_lp, g_ent)
    ref = _run(linear_logprob_ref, h, w, tg, 0.7, True, g_lp, g_ent)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    oracle = _run(linear_logprob_ref, h64, w64, tg, 0.7, True, g_lp.double(), g_ent.double())
    for name, a, b, o in zip(("logprob", "entropy", "grad_hidden", "grad_weight"), ours, ref, oracle):
        ref_err, err = (b.double() - o).abs(), (a.double() - o).abs()
        if name.startswith("grad"):
            ref_err, err, o = ref_err.max(), err.max(), o.abs().max()
        bad = err > 1e-5 + 1e-5 * o.abs() + 2 * ref_err
        assert not bad.any(), (f"{name} at offset {c}: {int(bad.sum())} mismatches at {bad.nonzero()[:3].tolist()}, "
                               f"max err {err.max().item():.3e} (materialised fp32: {ref_err.max().item():.3e})")


@pytest.mark.parametrize("entropy", [False, True])
def test_double_backward_raises_naming_the_op(entropy):
    """First derivatives only: gradients taken with create_graph=True are the right first
    derivatives, and a backward through them raises a RuntimeError naming linear_logprob (it
    named the internal linear_logprob_backward op and advised register_autograd) — never a
    silently missing second-order term."""
    h, w, tg = _inputs(5, 6, 37, dtype=torch.float64, seed=12)
    out = linear_logprob(h, w, tg, 0.8, entropy, chunk=8)
    loss = out[0].sum() + out[1].sum() if entropy else out.sum()
    gh, gw = torch.autograd.grad(loss, (h, w), create_graph=True)
    ref = linear_logprob_ref(h, w, tg, 0.8, entropy)
    ref_gh, ref_gw = torch.autograd.grad(ref[0].sum() + ref[1].sum() if entropy else ref.sum(), (h, w))
    _close(gh.detach(), ref_gh, 1e-10, 1e-10, "grad_hidden with create_graph")
    _close(gw.detach(), ref_gw, 1e-10, 1e-10, "grad_weight with create_graph")
    for second in ((gh ** 2).sum() + h.sum(), gw.sum()):
        with pytest.raises(RuntimeError, match="linear_logprob: no second derivative"):
            torch.autograd.grad(second, (h, w))


def test_func_transforms_vmap_works_gradient_transforms_raise_naming_the_op():
    """torch.func.vmap (over hidden, or over targets) equals the reference per sample; the
    gradient transforms (grad, jacrev, jvp; under vmap too) and forward-mode AD raise a
    RuntimeError naming linear_logprob. torch.func.grad failed deep in torch ("an
    autograd.Function ... must override the setup_context staticmethod"), and jvp / forward AD
    gave a tangent of 0 where the reference's is ~-10, with no error."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad, jacrev, jvp, vmap

    h, w, tg = (t.detach() for t in _inputs(5, 6, 37, seed=13))
    hb = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(14))
    tb = torch.randint(0, 37, (3, 5), generator=torch.Generator().manual_seed(15))
    _close(vmap(lambda x: linear_logprob(x, w, tg, 0.8, chunk=8))(hb),
           torch.stack([linear_logprob_ref(x, w, tg, 0.8) for x in hb]), 1e-5, 1e-5, "vmap over hidden")
    _close(vmap(lambda t: linear_logprob(h, w, t, 0.8, chunk=8))(tb),
           torch.stack([linear_logprob_ref(h, w, t, 0.8) for t in tb]), 1e-5, 1e-5, "vmap over targets")
    transforms = {
        "grad": lambda: grad(lambda x: linear_logprob(x, w, tg).sum())(h),
        "grad over w": lambda: grad(lambda v: linear_logprob(h, v, tg).sum())(w),
        "jacrev": lambda: jacrev(lambda x: linear_logprob(x, w, tg))(h),
        "jvp": lambda: jvp(lambda x: linear_logprob(x, w, tg), (h,), (h,)),
        "grad of vmap": lambda: grad(lambda x: vmap(lambda y: linear_logprob(y, w, tg))(x).sum())(hb),
        "vmap of grad": lambda: vmap(grad(lambda x: linear_logprob(x, w, tg).sum()))(hb),
    }
    for name, run in transforms.items():
        with pytest.raises(RuntimeError, match="linear_logprob: no torch.func.grad"):
            run()
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="linear_logprob: no torch.func.grad .* forward-mode AD"):
        linear_logprob(fwAD.make_dual(h, torch.ones_like(h)), w, tg)
    # inputs that do not depend on what is differentiated (made inside, detached) are constants of the
    # transform: the op's value, d/da (a * sum) = sum (they were refused as the ones above)
    a0, want = torch.tensor(0.5), linear_logprob(h, w, tg).sum()
    got = grad(lambda a: a * linear_logprob(h * 1.0, w * 1.0, tg).sum())(a0)
    assert torch.equal(got, want), f"grad of constants: {got.item()!r}, want {want.item()!r}"
    # forward mode refuses constants too (a tangent under a grad level reads None: _checks.func_transformed)
    with pytest.raises(RuntimeError, match="linear_logprob: no torch.func.grad"):
        jvp(lambda a: a * linear_logprob((h + 0 * a).detach(), w, tg).sum(), (a0,), (torch.ones_like(a0),))
