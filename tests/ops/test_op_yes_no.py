"""yes_no_score: every backend that runs here against ``yes_no_score_ref`` (RMSNorm, both full
logits, softmax over [no, yes]). Triton runs on CPU under TRITON_INTERPRET=1 (conftest.py), on
CUDA when present (then every test here is marked ``cuda``). The C++ twin's fp64-exactness
tests are in test_ext_yes_no.py.
"""
import pytest
import torch

from acarerank.ops import available_backends, yes_no_score, yes_no_score_op, yes_no_score_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda] if DEVICE == "cuda" else []
BACKENDS = available_backends("yes_no_score", DEVICE)  # declaring a backend tests it
EPS = 1e-6


def _inputs(S, H, dtype):
    h = (torch.randn(S, H) * 3).to(dtype)
    nw = (torch.rand(H) + 0.5).to(dtype)
    w_yes, w_no = (torch.randn(H) * 0.05).to(dtype), (torch.randn(H) * 0.05).to(dtype)
    return [t.to(DEVICE) for t in (h, nw, w_yes, w_no)]


def _check(h, nw, w_yes, w_no, what, backend="triton"):
    score, diff = yes_no_score(h, nw, w_yes, w_no, eps=EPS, backend=backend)
    ref_score, ref_diff = yes_no_score_ref(h, nw, w_yes, w_no, EPS)
    assert score.dtype == diff.dtype == torch.float32 and score.shape == diff.shape == (h.shape[0],)
    # fp32 summation over H terms: bound the error by 1e-5 of the sum of |terms| of each dot product
    hn = h.float() * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + EPS) * nw.float()
    mag = hn.abs() @ (w_yes.float().abs() + w_no.float().abs())
    tol = 1e-5 * (1 + mag)
    bad = ((diff - ref_diff).abs() > tol) | ((score - ref_score).abs() > 1e-5)
    assert not bad.any(), (f"{what}: rows {bad.nonzero().flatten().tolist()[:10]} mismatch; "
                           f"max |Δdiff| {(diff - ref_diff).abs().max():.3e}, max |Δscore| {(score - ref_score).abs().max():.3e}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("S,H", [(1, 64), (7, 100), (97, 384), (3, 2560)])
def test_head_fp32(S, H, backend):
    _check(*_inputs(S, H, torch.float32), f"{backend} fp32 S={S} H={H}", backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_head_half_inputs(dtype, backend):
    """Half inputs are upcast on load and accumulated in fp32, so the fp32 oracle's tolerance holds."""
    _check(*_inputs(59, 1024, dtype), f"{backend} {dtype}", backend)


def test_triton_head_strided_hidden_and_empty():
    h, nw, w_yes, w_no = _inputs(13, 2 * 96, torch.float32)
    h_view = h[::2, ::2]  # row stride 384, column stride 2
    _check(h_view, nw[:96], w_yes[:96], w_no[:96], "strided hidden")
    score, diff = yes_no_score(h[:0], nw, w_yes, w_no, eps=EPS, backend="triton")
    assert score.shape == diff.shape == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hidden_size_zero_is_refused_by_name(backend):
    """H = 0 has no score: torch answered 0.5 for every row, cpp a C++-worded error; one ValueError now."""
    h, nw, w_yes, w_no = _inputs(3, 8, torch.float32)
    with pytest.raises(ValueError, match="hidden_last has hidden size 0; need H >= 1"):
        yes_no_score(h[:, :0], nw[:0], w_yes[:0], w_no[:0], eps=EPS, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H", [384, 2560])
def test_head_row_independent_of_batch(backend, H):
    """Bitwise: a row's score does not depend on the rows around it or their order (batch-invariant
    scores rest on it; the torch head's GEMV, h @ w, picked its kernel by S and moved rows)."""
    h, nw, w_yes, w_no = _inputs(37, H, torch.float32)
    full = yes_no_score(h, nw, w_yes, w_no, eps=EPS, backend=backend)[1]
    for rows in (slice(5, 6), slice(0, 3), slice(30, 35)):
        part = yes_no_score(h[rows], nw, w_yes, w_no, eps=EPS, backend=backend)[1]
        assert torch.equal(full[rows], part), f"rows {rows} alone {part.tolist()} vs in batch {full[rows].tolist()}"
    perm = torch.randperm(37, device=h.device)
    shuffled = yes_no_score(h[perm], nw, w_yes, w_no, eps=EPS, backend=backend)[1]
    assert torch.equal(shuffled[torch.argsort(perm)], full), "row results change with batch order"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_head_gpu_qwen3_4b(dtype):
    """GPU path at Qwen3-4B's hidden size, depth 100."""
    _check(*_inputs(100, 2560, dtype), f"GPU {dtype}")


def test_torch_head_equals_model_card_softmax():
    S, H = 13, 96
    h, nw = torch.randn(S, H) * 3, torch.rand(H) + 0.5
    wy, wn = torch.randn(H), torch.randn(H)
    s, d = yes_no_score(h, nw, wy, wn, eps=1e-6, backend="torch")
    rs, rd = yes_no_score_ref(h, nw, wy, wn, eps=1e-6)
    assert (s - rs).abs().max() <= 1e-6 and (d - rd).abs().max() <= 1e-5
    # the score is the softmax over the two full logits, as the model card computes it
    hn = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * nw
    p = torch.softmax(torch.stack([hn @ wn, hn @ wy], -1), -1)[:, 1]
    assert (s - p).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="w_yes"):
        yes_no_score(h, nw, wy[:-1], wn)
    # an epsilon that is NaN or negative would score NaN (or a wrong finite value) with no error
    for eps in (float("nan"), -1.0, float("inf"), "1e-6", None):
        with pytest.raises(ValueError, match=r"yes_no_score: eps must be a finite number >= 0, got"):
            yes_no_score(h, nw, wy, wn, eps=eps, backend="torch")
    assert torch.equal(yes_no_score(h, nw, wy, wn, eps=0, backend="torch")[0],
                       yes_no_score(h, nw, wy, wn, eps=0.0, backend="torch")[0]), "eps 0 (an int) is an epsilon"


def _ref_grads(inputs, loss_of, dtype=torch.float64):
    """Autograd through ``yes_no_score_ref``'s formula in ``dtype`` (the oracle's own code is fp32)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    h, nw, w_yes, w_no = leaves
    hn = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * nw
    diff = hn @ w_yes - hn @ w_no
    loss_of(torch.sigmoid(diff), diff).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_gradients_against_the_reference(backend):
    """A pointwise training step (BCE on logit_diff, a term on score): gradients w.r.t. every input,
    also with only some requiring grad, as autograd through the reference formula in fp64; the
    backward was torch's 'no autograd formula was registered' for the internal op."""
    torch.manual_seed(0)
    inputs = _inputs(5, 48, torch.float32)
    inputs[0] = (torch.randn(48, 5) * 3).to(DEVICE).t()  # transposed hidden states
    target = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], device=DEVICE)

    def loss_of(score, diff):
        return torch.nn.functional.binary_cross_entropy_with_logits(diff, target.to(diff.dtype)) + score.pow(2).sum()

    want = _ref_grads(inputs, loss_of)
    for which in ([0, 1, 2, 3], [0], [2, 3]):
        leaves = [t.detach().clone().requires_grad_(i in which) for i, t in enumerate(inputs)]
        loss_of(*yes_no_score(*leaves, eps=EPS, backend=backend)).backward()
        for i, (t, ref) in enumerate(zip(leaves, want)):
            if i not in which:
                assert t.grad is None
                continue
            err = (t.grad.double() - ref).abs().max().item()
            assert t.grad.dtype == t.dtype and err <= 1e-5 * (1 + ref.abs().max().item()), (backend, which, i, err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_gradients_with_inputs_made_under_inference_mode(backend):
    """Hidden states of a frozen backbone made under torch.inference_mode() (as rescore makes them)
    with the head trained, and a frozen head made there with the hidden states trained: gradients as
    autograd through the reference formula. The backward raised torch's "Inference tensors cannot be
    saved for backward" (the op saved them as given) where yes_no_score_ref trains the head."""
    torch.manual_seed(2)
    inputs = _inputs(5, 48, torch.float32)

    def loss_of(score, diff):
        return diff.pow(2).sum() + score.sum()

    want = _ref_grads(inputs, loss_of)
    for frozen in ([0], [1, 2, 3]):
        with torch.inference_mode():
            made = {i: inputs[i].clone() for i in frozen}
        leaves = [made[i] if i in made else t.detach().clone().requires_grad_() for i, t in enumerate(inputs)]
        loss_of(*yes_no_score(*leaves, eps=EPS, backend=backend)).backward()
        for i, (t, ref) in enumerate(zip(leaves, want)):
            if i in frozen:
                continue
            err = (t.grad.double() - ref).abs().max().item()
            assert err <= 1e-5 * (1 + ref.abs().max().item()), (backend, frozen, i, err)


@pytest.mark.parametrize("backend", BACKENDS)
def test_func_transforms_vmap_works_gradient_transforms_raise_naming_the_op(backend):
    """vmap equals the reference per sample; the gradient transforms (grad, jacrev, jvp, jacfwd) and
    forward-mode AD raise a RuntimeError naming yes_no_score. jvp, jacfwd and forward AD gave a
    derivative of 0 (the reference's ~2-7) with no error; grad failed deep in torch, naming no op."""
    import torch.autograd.forward_ad as fwAD
    from torch.func import grad, jacfwd, jacrev, jvp, vmap

    torch.manual_seed(3)
    h, nw, w_yes, w_no = _inputs(3, 16, torch.float32)
    hb = torch.randn(2, 3, 16, device=DEVICE)
    got = vmap(lambda x: yes_no_score(x, nw, w_yes, w_no, eps=EPS, backend=backend)[1])(hb)
    want = torch.stack([yes_no_score_ref(x, nw, w_yes, w_no, EPS)[1] for x in hb])
    assert (got - want).abs().max().item() <= 1e-5, (got, want)
    diff = lambda x: yes_no_score(x, nw, w_yes, w_no, eps=EPS, backend=backend)[1]  # noqa: E731
    transforms = {"grad": lambda: grad(lambda x: diff(x).sum())(h), "jacrev": lambda: jacrev(diff)(h),
                  "jvp": lambda: jvp(diff, (h,), (h,)), "jacfwd": lambda: jacfwd(diff)(h),
                  "grad over w_yes": lambda: grad(lambda w: yes_no_score(h, nw, w, w_no, eps=EPS,
                                                                        backend=backend)[1].sum())(w_yes)}
    for name, run in transforms.items():
        with pytest.raises(RuntimeError, match="yes_no_score: no torch.func.grad"):
            run()
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="yes_no_score: no torch.func.grad .* forward-mode AD"):
        diff(fwAD.make_dual(h, torch.ones_like(h)))
    # inputs that do not depend on what is differentiated (made inside, detached) are constants of the
    # transform: the op's value, d/da (a * sum) = sum (they were refused as the ones above)
    a0, want = torch.tensor(0.5, device=DEVICE), diff(h).sum()
    got = grad(lambda a: a * diff(h * 1.0).sum())(a0)
    assert torch.equal(got, want), f"grad of constants: {got.item()!r}, want {want.item()!r}"
    # forward mode refuses constants too (a tangent under a grad level reads None: _checks.func_transformed)
    with pytest.raises(RuntimeError, match="yes_no_score: no torch.func.grad"):
        jvp(lambda a: a * diff((h + 0 * a).detach()).sum(), (a0,), (torch.ones_like(a0),))


def test_head_gradients_in_bf16_and_opcheck():
    """bf16 inputs get bf16 gradients within bf16 rounding of the fp64 ones; opcheck with inputs
    that require grad checks the autograd registration as torch.compile traces it."""
    torch.manual_seed(1)
    inputs = _inputs(4, 32, torch.bfloat16)
    want = _ref_grads(inputs, lambda s, d: d.sum())
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    yes_no_score(*leaves, eps=EPS)[1].sum().backward()
    for t, ref in zip(leaves, want):
        assert t.grad.dtype == torch.bfloat16
        assert (t.grad.double() - ref).abs().max() <= 2 ** -7 * (1 + ref.abs().max()), (t.grad, ref)

    # the registered formula under fake tensors and AOT autograd (torch.compile's path), w.r.t. every input
    f32 = [t.float().detach().requires_grad_() for t in inputs]
    torch.library.opcheck(yes_no_score_op, (*f32, EPS, "torch"))
