"""The ATO ops as a training loop uses them (docs/api.md, "Training modes"): a step from the
hidden rows on — the frozen teacher's ``topk_logprobs``, the policy's ``linear_logprob`` (with
entropy) and ``clipped_policy_loss`` — under checkpointing, autocast, views, frozen inputs,
accumulation, inference-mode constants, two thread counts and torch.compile (inductor).

The reference is the same step with ``linear_logprob_ref`` / ``topk_logprobs_ref`` (materialised
fp32 logits). Tolerances: fp32 1e-5; bf16 inputs: outputs to fp32 tolerance of the rounded
inputs; gradients within one bf16 rounding (2⁻⁸ relative) with fp32 ∂z
(ACARERANK_LINEAR_LOGPROB_FP32_GRAD=1), and with the default bf16 ∂z within 2× the error of the
same step in plain bf16 autograd, both against the fp32 reference (tests/ops/test_op_linear_logprob.py).
"""
import sys

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from acarerank.ato import clipped_policy_loss
from acarerank.ops.linear_logprob import (FP32_GRAD_ENV_VAR, INFERENCE_TENSOR, linear_logprob, linear_logprob_op,
                                          linear_logprob_ref)
from acarerank.ops.topk_logprobs import topk_logprobs, topk_logprobs_core_op, topk_logprobs_ref

pytestmark = pytest.mark.usefixtures("one_thread")

N, L, H, V, K, CHUNK = 3, 5, 24, 97, 8, 16  # V prime, several chunks and a ragged last one


def _data(dtype=torch.float32, seed=0):
    """(hidden [N·L, H], weight [V, H], teacher weight, targets [N·L], mask [N, L], advantage [N, L]).

    Dyadic hidden (multiples of 1/4) and weights (of 1/8), exact in bf16: every logit is exact
    in fp32 whatever the GEMM's summation order, so tied logits (common here, and every one with
    an expanded weight) tie in the op and the reference alike and the top-k ids must match."""
    g = torch.Generator().manual_seed(seed)
    h = ((torch.randn(N * L, H, generator=g) * 4).round() / 4).to(dtype)
    w = ((torch.randn(V, H, generator=g) * 2).round() / 8).to(dtype)
    wt = ((torch.randn(V, H, generator=g) * 2).round() / 8).to(dtype)
    tg = torch.randint(0, V, (N * L,), generator=g)
    mask = torch.ones(N, L, dtype=torch.bool)
    mask[1, 3:] = False  # a shorter rollout
    adv = torch.randn(N, L, generator=g)
    return h, w, wt, tg, mask, adv


def _step(h, w, wt, tg, mask, adv, ref=False, ent_coef=0.01):
    """Scalar loss of one step: teacher log-probs (constants) shift the advantage, the policy's
    log-probs and entropy (weight ``ent_coef``) are differentiable, logp_old sits 0.1 below
    (ratios clip at ε = 0.05)."""
    if ref:
        teacher = topk_logprobs_ref(h.detach(), wt, tg, k=K).target_logprob
        lp, ent = linear_logprob_ref(h, w, tg, return_entropy=True)
    else:
        teacher = topk_logprobs(h.detach(), wt, tg, k=K, chunk=CHUNK).target_logprob
        lp, ent = linear_logprob(h, w, tg, return_entropy=True, chunk=CHUNK)
    logp = lp.view(N, L)
    loss = clipped_policy_loss(logp, logp.detach() - 0.1, adv + 0.1 * teacher.view(N, L), mask, eps_clip=0.05)
    return loss + ent_coef * ent.mean()


def _loss_and_grads(step, h, w, *rest, need=(True, True)):
    h = h.detach().clone().requires_grad_(need[0])
    w = w.detach().clone().requires_grad_(need[1])
    loss = step(h, w, *rest)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def _close(got, want, atol, rtol, what):
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, reference {want.dtype}"
    err = (got.double() - want.double()).abs()
    bad = err > atol + rtol * want.double().abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} differ, first at {bad.nonzero()[:3].tolist()}, "
                           f"max err {err.max().item():.3e}")


def _equal(got, want, what):
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), got, want):
        assert (a is None) == (b is None), f"{what}: {name} is {a is None and 'None'} vs {b is None and 'None'}"
        if a is not None:
            assert torch.equal(a, b), f"{what}: {name} differs by {(a.double() - b.double()).abs().max():.3e}"


def _plain_bf16_logprob(h, w, tg, return_entropy=False, **_):
    """What a user writes in bf16: materialised bf16 logits, log_softmax, autograd (the yardstick)."""
    lsm = (h @ w.T).log_softmax(dim=1)
    return lsm.gather(1, tg[:, None])[:, 0].float(), (-(lsm.exp() * lsm).sum(dim=1)).float()


@pytest.mark.parametrize("mode", ["fp32", "bf16 inputs", "fp32 under bf16 autocast", "bf16 under bf16 autocast"])
def test_a_step_equals_its_reference(mode, monkeypatch):
    """Loss in fp32, gradients in the inputs' dtype, under autocast too (the ops keep fp32 math
    there), within the per-dtype rule of the materialised reference on the same inputs: one
    rounding with fp32 ∂z; the default bf16 ∂z within 2× plain bf16 autograd's error."""
    dtype = torch.bfloat16 if mode.startswith("bf16") else torch.float32
    h, w, wt, tg, mask, adv = _data(dtype)
    # the reference in fp32 on the same (rounded) inputs, outside autocast
    want = _loss_and_grads(lambda *a: _step(*a, ref=True), h.float(), w.float(), wt.float(), tg, mask, adv)
    monkeypatch.setenv(FP32_GRAD_ENV_VAR, "1")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in mode):
        got = _loss_and_grads(_step, h, w, wt, tg, mask, adv)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == dtype, (mode, [t.dtype for t in got])
    rel = 2.0 ** -8 if dtype == torch.bfloat16 else 1e-5
    _close(got[0], want[0], 1e-5, 1e-5, f"{mode}: loss")
    _close(got[1], want[1].to(dtype), 1e-6, rel, f"{mode}: grad hidden")
    _close(got[2], want[2].to(dtype), 1e-6, rel, f"{mode}: grad weight")
    if dtype != torch.bfloat16:
        return
    monkeypatch.setenv(FP32_GRAD_ENV_VAR, "0")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled="autocast" in mode):
        got = _loss_and_grads(_step, h, w, wt, tg, mask, adv)
    monkeypatch.setattr(sys.modules[__name__], "linear_logprob", _plain_bf16_logprob)
    plain = _loss_and_grads(_step, h, w, wt, tg, mask, adv)
    _close(got[0], want[0], 1e-5, 1e-5, f"{mode}, bf16 ∂z: loss")
    for name, a, p, r in zip(("grad hidden", "grad weight"), got[1:], plain[1:], want[1:]):
        e, ep = (a.double() - r.double()).abs(), (p.double() - r.double()).abs()
        for what, ours_err, plain_err in (("max", e.max(), ep.max()), ("norm", e.norm(), ep.norm())):
            assert ours_err <= 2 * plain_err, (f"{mode}, bf16 ∂z: {name} {what} error {ours_err:.3e} > 2× plain "
                                               f"bf16 autograd's {plain_err:.3e}")


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_checkpointed_step_gives_the_same_loss_and_gradients(use_reentrant):
    """torch.utils.checkpoint recomputes the forward in the backward: bit for bit the same."""
    data = _data()
    plain = _loss_and_grads(_step, *data)
    ckpt = _loss_and_grads(lambda *a: checkpoint(_step, *a, use_reentrant=use_reentrant), *data)
    _equal(ckpt, plain, f"checkpoint(use_reentrant={use_reentrant})")


VIEWS = {
    "transposed": lambda t: t.T.contiguous().T,             # hidden rows out of an [H, T] buffer
    "sliced": lambda t: torch.cat([t, t], 1)[:, ::2],        # every other column
    "expanded": lambda t: t[:1].expand_as(t),                # one row repeated, stride 0
}


@pytest.mark.parametrize("which", ["hidden", "weight", "targets"])
@pytest.mark.parametrize("view", sorted(VIEWS))
def test_inputs_that_are_views(view, which):
    h, w, wt, tg, mask, adv = _data()
    if which == "targets":
        tg = tg[:, None].expand(-1, 2)[:, 0] if view != "expanded" else tg[:1].expand_as(tg)
    elif which == "hidden":
        h = VIEWS[view](h)
    else:
        w, wt = VIEWS[view](w), VIEWS[view](wt)
    got = _loss_and_grads(_step, h, w, wt, tg, mask, adv)
    want = _loss_and_grads(lambda *a: _step(*a, ref=True), h.contiguous(), w.contiguous(), wt.contiguous(),
                           tg.contiguous(), mask, adv)
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), got, want):
        _close(a, b, 1e-5, 1e-5, f"{view} {which}: {name}")


def test_frozen_inputs_retain_graph_and_accumulation():
    """A frozen weight or frozen hidden gets no gradient and the other the full one; a second
    backward over a retained graph adds the same gradient again; micro-batches of rows
    accumulate to the whole batch's gradient."""
    h, w, wt, tg, mask, adv = _data()
    full = _loss_and_grads(_step, h, w, wt, tg, mask, adv)
    for need in ((True, False), (False, True)):
        got = _loss_and_grads(_step, h, w, wt, tg, mask, adv, need=need)
        _equal(got, tuple(g if n else None for g, n in zip(full, (True, *need))), f"requires_grad {need}")
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = _step(hh, ww, wt, tg, mask, adv)
    loss.backward(retain_graph=True)
    loss.backward()
    _close(hh.grad, 2 * full[1], 0, 0, "retain_graph: grad hidden")
    _close(ww.grad, 2 * full[2], 0, 0, "retain_graph: grad weight")
    # micro-batches: the policy's sum of log-probs, rows split in two
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    for rows in (slice(0, 6), slice(6, None)):
        linear_logprob(hh[rows], ww, tg[rows], chunk=CHUNK).sum().backward()
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    linear_logprob(h1, w1, tg, chunk=CHUNK).sum().backward()
    _close(hh.grad, h1.grad, 1e-6, 1e-6, "accumulated grad hidden")
    _close(ww.grad, w1.grad, 1e-6, 1e-5, "accumulated grad weight")


def test_constants_made_under_inference_mode_train_like_plain_ones():
    """Rollout token ids, masks and advantages made under torch.inference_mode() (a sampler, a
    scoring pass) are constants of the step: its loss and gradients are the plain tensors'.
    linear_logprob saved the targets and clipped_policy_loss the mask (through torch.where) as
    given, and autograd refuses to save an inference tensor: a RuntimeError naming neither."""
    h, w, wt, tg, mask, adv = _data()
    want = _loss_and_grads(_step, h, w, wt, tg, mask, adv)
    with torch.inference_mode():
        tg_i, mask_i, adv_i = tg.clone(), mask.clone(), adv.clone()
    assert tg_i.is_inference() and mask_i.is_inference()
    _equal(_loss_and_grads(_step, h, w, wt, tg_i, mask_i, adv_i), want, "inference-mode constants")


@pytest.mark.parametrize("which", ["hidden", "weight"])
def test_an_inference_hidden_or_weight_is_a_named_error(which):
    """hidden and weight are saved for the backward (either's gradient needs the other): an
    inference tensor there is a ValueError naming the op and the argument when a backward is
    recorded, and fine when none is (no_grad, nothing requiring grad)."""
    h, w, _, tg, _, _ = _data()
    with torch.inference_mode():
        frozen = (h if which == "hidden" else w).clone()
    h, w = (frozen, w.requires_grad_()) if which == "hidden" else (h.requires_grad_(), frozen)
    with pytest.raises(ValueError, match=rf"linear_logprob: {which} is an inference tensor") as e:
        linear_logprob(h, w, tg)
    assert str(e.value) == INFERENCE_TENSOR.format(name=which)
    with torch.no_grad():
        _close(linear_logprob(h, w, tg), linear_logprob_ref(h, w, tg), 1e-5, 1e-5, "no_grad")


def test_the_step_repeats_bit_for_bit_and_across_thread_counts():
    """docs/api.md, "Training modes": the same step twice is bitwise; at 1 and 2 threads it is
    bitwise on the CPUs measured (fp32 and bf16), asserted here to fp32 rounding (1e-6), since
    the BLAS may split a GEMM's sums by thread count elsewhere."""
    before = torch.get_num_threads()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            data = _data(dtype, seed=3)
            torch.set_num_threads(1)
            one = _loss_and_grads(_step, *data)
            _equal(_loss_and_grads(_step, *data), one, f"{dtype}: the same step twice")
            torch.set_num_threads(2)
            two = _loss_and_grads(_step, *data)
            for name, a, b in zip(("loss", "grad hidden", "grad weight"), two, one):
                _close(a, b, 1e-6, 1e-6, f"{dtype}: 2 threads against 1, {name}")
    finally:
        torch.set_num_threads(before)


def test_the_step_compiles_with_inductor_in_one_graph():
    """torch.compile (CPU inductor, fullgraph=True) of the whole step, teacher included: eager's
    loss and gradients to fp32 rounding (inductor may fuse the loss's elementwise math)."""
    torch._dynamo.reset()
    data = _data(seed=5)
    got = _loss_and_grads(torch.compile(_step, fullgraph=True), *data)
    want = _loss_and_grads(_step, *data)
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), got, want):
        _close(a, b, 1e-6, 1e-6, f"inductor: {name}")


@pytest.mark.parametrize("T,Hs,Vs,k", [(0, 3, 5, 2), (1, 7, 59, 59), (13, 5, 97, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_kernels_agree_with_the_real_ops_on_odd_shapes(T, Hs, Vs, k, dtype):
    """opcheck (schema, register_fake's shapes/dtypes/strides against the real outputs, autograd
    registration) on empty, single-row, k = V and k = 1 cases with strided inputs."""
    g = torch.Generator().manual_seed(T + Vs)
    h = torch.randn(Hs, T, generator=g).to(dtype).T                  # transposed
    w = torch.randn(Vs, 2 * Hs, generator=g).to(dtype)[:, ::2]     # sliced
    tg = torch.randint(0, Vs, (T,), generator=g)
    torch.library.opcheck(topk_logprobs_core_op, (h, w, tg, k, 3, 0.9, "torch", False))
    torch.library.opcheck(linear_logprob_op, (h.clone().requires_grad_(), w.clone().requires_grad_(), tg, 0.9, 3,
                                              True))


def test_padding_and_bad_values_as_a_training_loop_meets_them():
    """cross_entropy's ignore_index=-100 padding is a ValueError that says what to do instead;
    a batch without valid tokens is a zero loss with zero gradients; temperature 0 or negative
    and NaN/inf hidden states are ValueErrors naming the op, never a NaN loss."""
    h, w, wt, tg, mask, adv = _data()
    pad = tg.clone()
    pad[7:] = -100
    for op in (lambda t: linear_logprob(h, w, t), lambda t: topk_logprobs(h, wt, t, k=K)):
        with pytest.raises(ValueError, match="target id -100 is out of range .*there is no ignore_index"):
            op(pad)
    none = torch.zeros_like(mask)
    loss, gh, gw = _loss_and_grads(lambda *a: _step(*a, ent_coef=0.0), h, w, wt, tg, none, adv)
    assert loss.item() == 0.0 and not gh.any() and not gw.any(), "an all-padding batch"
    ops = (("linear_logprob", linear_logprob), ("topk_logprobs", lambda *a, **kw: topk_logprobs(*a, k=K, **kw)))
    for tau in (0.0, -1.0):
        for name, op in ops:
            with pytest.raises(ValueError, match=f"{name}: temperature must be a finite number > 0"):
                op(h, w, tg, temperature=tau)
    for bad in (float("nan"), float("inf")):
        hb = h.clone()
        hb[4, 2] = bad
        for name, op in ops:
            with pytest.raises(ValueError, match=rf"{name}: non-finite logits .* in rows \[4\]"):
                op(hb.requires_grad_(), w, tg)


def test_a_step_on_meta_tensors_gives_the_real_shapes_and_dtypes():
    """Meta tensors (shape planning, a model built on "meta"): the teacher's topk_logprobs, the
    policy's linear_logprob, the pointwise yes_no_score and the loss give the CPU call's shapes
    and dtypes, backward included; topk_logprobs and yes_no_score were a BackendError ('no
    backend runs on meta') where linear_logprob and the loss ran."""
    from acarerank.ops import yes_no_score

    def step(device):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(7, H, generator=g).to(device).requires_grad_()
        w = torch.randn(V, H, generator=g).to(device).requires_grad_()
        tg = torch.randint(0, V, (7,), generator=g).to(device)
        teacher = topk_logprobs(h.detach(), w.detach(), tg, k=K, chunk=CHUNK)
        lp, ent = linear_logprob(h, w, tg, return_entropy=True, chunk=CHUNK)
        score, diff = yes_no_score(h, torch.ones(H, device=device), w[0], w[1])
        mask = torch.ones(1, 7, dtype=torch.bool, device=device)
        loss = clipped_policy_loss(lp[None], teacher.target_logprob[None], ent.detach()[None], mask) + diff.sum()
        loss.backward()
        return [*teacher, lp, ent, score, diff, loss, h.grad, w.grad]

    for real, meta in zip(step("cpu"), step("meta")):
        assert meta.device.type == "meta" and (meta.shape, meta.dtype) == (real.shape, real.dtype)
