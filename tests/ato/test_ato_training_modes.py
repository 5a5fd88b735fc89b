"""The ATO ops as a training loop uses them (docs/api.md, "Training modes"): a step from the
hidden rows on — the frozen teacher's ``topk_logprobs``, the policy's ``linear_logprob`` (with
entropy) and ``clipped_policy_loss`` — under checkpointing, autocast, views, frozen inputs,
accumulation, inference-mode constants, two thread counts and torch.compile (inductor).

The reference is the same step with ``linear_logprob_ref`` / ``topk_logprobs_ref`` (materialised
fp32 logits). Tolerances: fp32 1e-5; bf16 inputs: outputs to fp32 tolerance of the rounded
inputs, gradients within one bf16 rounding (2⁻⁸ relative; tests/ops/test_op_linear_logprob.py).
"""
import pytest
import torch

from acarerank.ato import clipped_policy_loss
from acarerank.ops.linear_logprob import INFERENCE_TENSOR, linear_logprob, linear_logprob_ref
from acarerank.ops.topk_logprobs import topk_logprobs, topk_logprobs_ref

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
