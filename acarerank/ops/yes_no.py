"""Fused yes/no scoring head (Qwen3-Reranker): two logits, never the 151,669-wide vector.

    h̄ = h / sqrt(mean(h²) + eps) · norm_weight                (final RMSNorm, fp32)
    logit_diff = h̄ · (w_yes − w_no)                          (= logit_yes − logit_no)
    score = softmax([logit_no, logit_yes])[1] = sigmoid(logit_diff)

Backends: "torch" (below), "triton" (acarerank/kernels/yes_no_head.py), "cpp"/"cuda" (csrc/yes_no.cuh);
declared in ``OP`` below.
"""
from __future__ import annotations

import torch

from . import _backend
from ._backend import META_TOO
from ._checks import check_eps, check_float_tensors, refuse_func_transforms

NO_FUNC_TRANSFORM = ("yes_no_score: no torch.func.grad / jvp / jacrev / hessian and no forward-mode AD — its "
                     "derivative is a registered reverse-mode formula that these transforms cannot call (a jvp came "
                     "out 0); differentiate it with torch.autograd (loss.backward(), torch.autograd.grad), or use "
                     "yes_no_score_ref, plain PyTorch that every transform takes")


def _check_inputs(hidden_last, norm_weight, w_yes, w_no):
    check_float_tensors("yes_no_score", ("hidden_last", hidden_last), ("norm_weight", norm_weight), ("w_yes", w_yes),
                        ("w_no", w_no))
    if hidden_last.dim() != 2:
        raise ValueError(f"yes_no_score: hidden_last must be [S, H], got shape {tuple(hidden_last.shape)}")
    H = hidden_last.shape[1]
    if H == 0:  # no hidden state to score: every backend would answer something different (0.5, an error)
        raise ValueError("yes_no_score: hidden_last has hidden size 0; need H >= 1")
    for name, t in (("norm_weight", norm_weight), ("w_yes", w_yes), ("w_no", w_no)):
        if t.shape != (H,):
            raise ValueError(f"yes_no_score: {name} must be [{H}], got shape {tuple(t.shape)}")


def yes_no_score_ref(hidden_last, norm_weight, w_yes, w_no, eps: float):
    """Oracle in fp32: RMSNorm, the two full logits, log-softmax over [no, yes]."""
    h = hidden_last.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    logits = torch.stack([h @ w_no.float(), h @ w_yes.float()], dim=-1)
    return logits.log_softmax(-1)[:, 1].exp(), logits[:, 1] - logits[:, 0]


def _torch_backend(hidden_last, norm_weight, w_yes, w_no, eps):
    h = hidden_last.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    w = norm_weight.float() * (w_yes.float() - w_no.float())  # fold the norm weight into the difference
    # a row's own multiply-and-sum, not h @ w: the GEMV's kernel is picked by S, so a row's bits moved
    # with the rows beside it (S 1 vs 5 differ in ~half the rows) and batch-invariant scores with them
    diff = (h * w).sum(-1)
    return torch.sigmoid(diff), diff


OP = _backend.OpDecl(
    "yes_no_score", aliases=("yes_no", "head"),
    backends={"torch": _backend.Backend(lambda: _torch_backend, META_TOO),
              "triton": _backend.lazy_backend("yes_no_score", "triton", "acarerank.kernels.yes_no_head",
                                              "yes_no_score_triton"),
              "cpp": _backend.lazy_backend("yes_no_score", "cpp", "acarerank.ops._cpp", "yes_no_score_cpp", ("cpu",)),
              "cuda": _backend.lazy_backend("yes_no_score", "cuda", "acarerank.ops._cpp", "yes_no_score_cuda", ("cuda",),
                                            needs_cuda_build=True)},
    # CPU: torch (one fp32 multiply-and-sum; the C++ twin is no faster at S <= 100); CUDA: the Triton kernel
    defaults={"cpu": ("torch",), "cuda": ("triton", "cuda", "torch"), "meta": ("torch",)},
)


@torch.library.custom_op("acarerank::yes_no_score", mutates_args=())
def yes_no_score_op(hidden_last: torch.Tensor, norm_weight: torch.Tensor, w_yes: torch.Tensor, w_no: torch.Tensor,
                    eps: float, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered op (torch.compile-opaque); ``backend`` is already resolved."""
    return OP.impl(backend)(hidden_last, norm_weight, w_yes, w_no, eps)


@yes_no_score_op.register_fake
def _(hidden_last, norm_weight, w_yes, w_no, eps, backend):
    S = hidden_last.shape[0]
    return (hidden_last.new_empty(S, dtype=torch.float32), hidden_last.new_empty(S, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    hidden_last, norm_weight, w_yes, w_no, eps, _backend_name = inputs
    # an inference tensor (hidden states of a frozen backbone run under torch.inference_mode(), as
    # rescore runs it) is copied, not saved: autograd refuses to save one, and the backward failed
    # with torch's "Inference tensors cannot be saved" where yes_no_score_ref trains. [S, H] and [H]
    saved = [t.clone() if t.is_inference() else t for t in (hidden_last, norm_weight, w_yes, w_no)]
    ctx.save_for_backward(*saved, output[0])
    ctx.eps = eps


def _backward(ctx, g_score, g_diff):
    """First derivatives of both outputs, in fp32 as the forward, each cast to its input's dtype.

    With g = ∂L/∂diff + ∂L/∂score · s(1 − s), n = h·r, r = 1/sqrt(mean(h²) + eps), u = γ ⊙ (w_yes − w_no):
        ∂L/∂h = r · (g·u − n · mean(g·u ⊙ n))        (RMSNorm's backward, per row)
        ∂L/∂γ = (Σ_s g·n) ⊙ (w_yes − w_no),   ∂L/∂w_yes = (Σ_s g·n) ⊙ γ = −∂L/∂w_no
    """
    hidden_last, norm_weight, w_yes, w_no, score = ctx.saved_tensors
    g = torch.zeros_like(score)
    if g_diff is not None:
        g = g + g_diff.float()
    if g_score is not None:
        g = g + g_score.float() * score * (1.0 - score)
    h = hidden_last.float()
    r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ctx.eps)  # [S, 1]
    n = h * r
    gamma, d = norm_weight.float(), w_yes.float() - w_no.float()
    need = ctx.needs_input_grad
    grad_h = grad_gamma = grad_yes = grad_no = None
    if need[0]:
        dn = g[:, None] * (gamma * d)  # [S, H]
        grad_h = (r * (dn - n * (dn * n).mean(-1, keepdim=True))).to(hidden_last.dtype)
    if need[1] or need[2] or need[3]:
        du = (g[:, None] * n).sum(0)  # [H]: ∂L/∂u
        grad_gamma = (du * d).to(norm_weight.dtype) if need[1] else None
        grad_yes = (du * gamma).to(w_yes.dtype) if need[2] else None
        grad_no = (-(du * gamma)).to(w_no.dtype) if need[3] else None
    return grad_h, grad_gamma, grad_yes, grad_no, None, None


# a pointwise training loop backpropagates a BCE on logit_diff into the hidden states (and the head):
# without a formula the backward was torch's "no autograd formula was registered" for the internal op
yes_no_score_op.register_autograd(_backward, setup_context=_setup_context)


def yes_no_score(hidden_last, norm_weight, w_yes, w_no, eps: float = 1e-6, backend=None):
    """Relevance from the last hidden state of each segment.

    Args:
      hidden_last: [S, H] hidden states *before* the final RMSNorm (any float dtype).
      norm_weight: [H] final RMSNorm weight; w_yes, w_no: [H] rows 9693 / 2152 of lm_head.
      eps: RMSNorm epsilon (config.rms_norm_eps), a finite number >= 0 (else ValueError).
      backend: a name, a per-op mapping or None (``acarerank.ops._backend``).
    Returns: (score [S] fp32 in [0, 1], logit_diff [S] fp32 = logit_yes − logit_no).
      A row whose squares overflow fp32 (|h| beyond ~1.8e19 / sqrt(H)) scores 0.5 (or NaN) on the
      torch, Triton and CUDA backends (as transformers' RMSNorm) and its exact value on cpp (double sums);
      the rerankers never pass one (acarerank.model.numerics).

    Differentiable (first derivatives, every backend: one fp32 formula, ``_backward``) in
    ``hidden_last``, ``norm_weight``, ``w_yes`` and ``w_no``; gradients come back in each input's dtype.
    By torch.autograd only: a torch.func gradient transform or a forward-mode tangent on an input is
    a RuntimeError (``NO_FUNC_TRANSFORM``; a jvp was silently 0).

    The backend is resolved once here; the work runs inside the custom op
    ``torch.ops.acarerank.yes_no_score``, opaque to torch.compile.
    """
    _check_inputs(hidden_last, norm_weight, w_yes, w_no)
    refuse_func_transforms(NO_FUNC_TRANSFORM, hidden_last, norm_weight, w_yes, w_no)
    check_eps("yes_no_score", eps)
    name = OP.resolve(backend, hidden_last.device)
    return yes_no_score_op(hidden_last, norm_weight, w_yes, w_no, float(eps), name)
