"""Clipped policy objective of ATO (AdaTutoRank (2026), Eq. 11–12; no KL term, §3.4 / Appendix A).

    ρ_i,l = exp(log π_θ(y_i,l | ·) − log π_old(y_i,l | ·))                        (Eq. 12)
    ℓ_i,l = −min(ρ_i,l · A_i,l, clip(ρ_i,l, 1 − ε, 1 + ε) · A_i,l)                 (Eq. 11)

aggregated over the valid tokens with one of verl's ``loss_agg_mode`` names (M = mask, 0/1: verl
multiplies by its mask, so a fractional one weights tokens there; here it is refused, ``agg_loss``):

    "token-mean"               Σ ℓ·M / Σ M                       (over the whole batch)
    "seq-mean-token-sum"       mean_i Σ_l ℓ·M
    "seq-mean-token-mean"      mean_i (Σ_l ℓ·M / Σ_l M)
    "seq-mean-token-sum-norm"  Σ ℓ·M / L      (Dr. GRPO; L = ``norm_length``, else the padded
                                              length mask.shape[-1])

verl pads every response to the rollout's fixed response length, so its L is a constant; ``rescore``
pads to the batch's longest rollout, so without ``norm_length`` the divisor (and the gradient's
scale) changes from batch to batch: pass the response budget (``max_new_tokens``) as verl does.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from ..ops._checks import check_flag, check_float_tensors

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # as verl: exp(±20) keeps ρ finite; no gradient flows through a clamped ratio


def agg_loss(loss_mat: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
             norm_length: Optional[int] = None, *, validate: bool = True) -> torch.Tensor:
    """Scalar from [N, L] per-token losses (formulas in the module docstring).

    ``norm_length``: the constant L of "seq-mean-token-sum-norm" (≥ the padded length; None: the
    padded length); given with another mode it is a ValueError, never ignored.

    ``loss_mat``: [N, L] floating point. ``mask``: [N, L] like ``loss_mat``, bool or 0/1 (integer
    or floating), read as bool (nonzero = valid) in numerator and denominator alike. Denominators
    are clamped to ≥ 1, so a batch or a sequence without valid tokens contributes 0 — an empty
    batch (N = 0) or padded length (L = 0) included (verl divides by Σ M + 1e-8 in token-mean,
    and yields NaN for an empty sequence in seq-mean-token-mean); otherwise the values equal verl's.
    ``loss_mat`` at a masked token is never read: padding may hold anything, NaN included.

    ``validate``: refuse (ValueError naming the first bad [i, l]) a NaN/inf in ``loss_mat`` at a
    valid token (NaN gave a NaN loss with no error, ±inf an infinite one), a NaN/inf in a
    non-bool ``mask`` anywhere, and a ``mask`` entry other than 0 or 1 (0.5: verl's ``agg_loss``
    multiplies by the mask, a weight, where this one counts a whole token, so a loss ported with
    a fractional mask differed from verl's without a word). One pass over the [N, L] inputs and,
    on a GPU, one host sync per call; it runs under torch.compile too (``agg_loss_valid``), not
    while a CUDA graph is captured. False: no check, no sync.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    for name, t in (("loss_mat", loss_mat), ("mask", mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"agg_loss: {name} must be a tensor, got {type(t).__name__}")
    # equal shapes, not broadcastable ones: a [L] mask against [N, L] losses divided the sum of
    # N·L terms by L tokens (token-mean N times too large), with no error
    if loss_mat.dim() != 2 or mask.shape != loss_mat.shape:
        raise ValueError(f"agg_loss: loss_mat and mask must both be [N, L]; got {tuple(loss_mat.shape)} and "
                         f"{tuple(mask.shape)}")
    if not loss_mat.is_floating_point():  # an int64 one failed inside mean() for the seq-mean modes
        raise TypeError(f"agg_loss: loss_mat must be floating point, got {loss_mat.dtype}")
    if mask.device != loss_mat.device:
        raise ValueError(f"agg_loss: mask is on {mask.device}, loss_mat is on {loss_mat.device}")
    check_flag("agg_loss", "validate", validate)
    N, L = loss_mat.shape
    norm = _norm_length(norm_length, agg, L)
    valid = agg_loss_valid(loss_mat.detach(), mask, bool(validate))
    m = valid.to(loss_mat.dtype)  # counts the tokens the numerator sums (a 0.5 entry once counted 1 there, 0.5 here)
    per_tok = torch.where(valid, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    if agg == "token-mean":
        return per_tok.sum() / m.sum().clamp(min=1)
    seq_sum = per_tok.sum(dim=-1)
    # over max(N, 1) sequences / max(L, 1) positions: mean() of no sequence, or a sum over L = 0,
    # was 0/0 = NaN
    if agg == "seq-mean-token-sum":
        return seq_sum.sum() / max(N, 1)
    if agg == "seq-mean-token-mean":
        return (seq_sum / m.sum(dim=-1).clamp(min=1)).sum() / max(N, 1)
    return seq_sum.sum() / max(norm, 1)


def _checked_mask(op: str, mask: torch.Tensor, validate: bool, named, why: str) -> torch.Tensor:
    """[N, L] bool: ``mask`` read as bool (nonzero = valid), always a new contiguous tensor (torch.where
    saves its condition for the backward, and autograd refuses to save an inference tensor, e.g. a
    mask made under torch.inference_mode(), which ``mask.bool()`` returned unchanged).

    With ``validate``, a ValueError naming ``op`` and the first bad entry of, in this order: a
    non-bool ``mask``'s NaN/inf (anywhere: it is neither valid nor padding), its entries other
    than 0 or 1 (verl's agg_loss weights by them: ``agg_loss``), then each ``(name, tensor)`` of
    ``named``'s NaN/inf at a valid token (``why`` says what it does to the loss). One
    elementwise pass and, on a GPU, one host sync (none while a CUDA graph is captured, where a
    sync is an error, and none with ``validate=False``).
    """
    valid = torch.empty(mask.shape, dtype=torch.bool, device=mask.device)
    valid.copy_(mask)  # nonzero (NaN included) -> True
    capturing = valid.is_cuda and torch.cuda.is_current_stream_capturing()
    if not validate or not valid.numel() or capturing:
        return valid
    checks = []  # (name, tensor, bad [N, L] bool, where, why it is refused)
    if mask.dtype != torch.bool:
        if mask.is_floating_point():
            checks.append(("mask", mask, ~torch.isfinite(mask), "",
                           "A NaN/inf mask entry is neither valid nor padding"))
        checks.append(("mask", mask, valid & (mask != 1), "", "A mask entry must be 0 or 1: acarerank reads a mask as "
                       "bool (a whole token in numerator and denominator), unlike verl's agg_loss, which multiplies "
                       "by it as a weight; fold weights into the per-token loss instead"))
    checks += [(name, t, valid & ~torch.isfinite(t), " at a valid token (mask nonzero there)",
                f"{why}; padding may hold anything") for name, t in named]
    found = torch.stack([c[2].any() for c in checks]).tolist()  # the one host sync
    for (name, t, bad, where, reason), hit in zip(checks, found):
        if hit:
            pos = bad.nonzero()
            i, j = pos[0].tolist()
            raise ValueError(f"{op}: {name}[{i}, {j}] is {t[i, j].item()}{where}; {pos.shape[0]} such position(s), "
                             f"first {[tuple(p) for p in pos[:5].tolist()]}. {reason}")
    return valid


@torch.library.custom_op("acarerank::policy_loss_valid", mutates_args=())
def policy_loss_valid(logp: torch.Tensor, logp_old: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
                      validate: bool) -> torch.Tensor:
    """[N, L] bool: ``mask`` read as bool, checked (``_checked_mask``) with ``logp_old``,
    ``advantage`` and ``logp`` at its valid tokens.

    A registered op so that the check, which reads the data, runs on the real tensors in eager
    and compiled code alike (as ``topk_logprobs``' range check does): in the loss's Python body it
    was a data-dependent branch, an error under torch.compile(fullgraph=True). Its output is the
    mask the loss uses, so no compiler drops it. Cost: one elementwise pass over the four [N, L]
    tensors and, on a GPU, one host sync (none with ``validate=False``).
    """
    return _checked_mask("clipped_policy_loss", mask, validate,
                         (("logp_old", logp_old), ("advantage", advantage), ("logp", logp)),
                         "A NaN/inf there makes the loss NaN or silently wrong (the ratio is clamped)")


@policy_loss_valid.register_fake
def _(logp, logp_old, advantage, mask, validate):
    return mask.new_empty(mask.shape, dtype=torch.bool)


@torch.library.custom_op("acarerank::agg_loss_valid", mutates_args=())
def agg_loss_valid(loss_mat: torch.Tensor, mask: torch.Tensor, validate: bool) -> torch.Tensor:
    """[N, L] bool: ``mask`` read as bool, checked (``_checked_mask``) with ``loss_mat`` at its
    valid tokens; a registered op for ``policy_loss_valid``'s reasons. Cost: one elementwise pass
    over the two [N, L] tensors and, on a GPU, one host sync (none with ``validate=False``)."""
    return _checked_mask("agg_loss", mask, validate, (("loss_mat", loss_mat),),
                         "A NaN/inf there makes the loss NaN or infinite")


@agg_loss_valid.register_fake
def _(loss_mat, mask, validate):
    return mask.new_empty(mask.shape, dtype=torch.bool)


def _norm_length(norm_length, agg: str, padded: int) -> int:
    """``norm_length`` checked (module docstring), or the padded length when it is None."""
    if norm_length is None:
        return padded
    if agg != "seq-mean-token-sum-norm":
        raise ValueError(f"norm_length is the divisor of agg='seq-mean-token-sum-norm' only; agg={agg!r} does "
                         f"not use it")
    if isinstance(norm_length, bool) or not isinstance(norm_length, numbers.Integral) or norm_length < 1:
        raise ValueError(f"norm_length must be a positive int, got {norm_length!r}")
    if norm_length < padded:
        raise ValueError(f"norm_length {norm_length} is shorter than the padded length {padded}: the rollouts are "
                         f"longer than the response budget it stands for")
    return int(norm_length)


def clipped_policy_loss(logp, logp_old, advantage, mask, eps_clip: float = 0.2, agg: str = "token-mean",
                        norm_length: Optional[int] = None, *, validate: bool = True):
    """PPO-clip loss of Eq. 11 on the ATO advantage (Eq. 10); differentiable in ``logp``.

    Args:
      logp: [N, L] floating-point log π_θ of the sampled tokens (requires grad; e.g. ``linear_logprob``);
        the ratio and the loss are computed in its dtype (an integer one is a TypeError).
      logp_old: [N, L] log π_old of the same tokens (``rescore(...).logp_old``), a constant.
      advantage: [N, L] A^ATO (``ato_advantage``), a constant.
      mask: [N, L] bool (or 0/1, integer or floating), valid response tokens.
      eps_clip: ε (ratio clipped to [1 − ε, 1 + ε]).
      agg: one of AGG_MODES (verl's names).
      norm_length: the constant divisor of "seq-mean-token-sum-norm" (``agg_loss``; the response
        budget, as verl's fixed response length), else None.
      validate: refuse (ValueError naming the tensor and its first bad [i, l]) a NaN/inf in
        ``logp_old``, ``advantage`` or ``logp`` at a valid token, or in a floating-point ``mask``
        anywhere: NaN gave a NaN loss with no error, and ±inf a finite, wrong one (the log-ratio
        is clamped to ±20); and a ``mask`` entry other than 0 or 1 (``agg_loss``). One pass over
        the [N, L] inputs and, on a GPU, one host sync per call; it runs under torch.compile too
        (``policy_loss_valid``), not while a CUDA graph is captured. False: no check, no sync.
    Returns: scalar loss (dtype of logp). At logp == logp_old its gradient is −A·M/ΣM for
    "token-mean" (Lemma 1: the clip is inactive at the snapshot).
    Masked positions are excluded before the exponential, so padding with any values
    (even ±inf) cannot produce NaN. ``logp_old``, ``advantage`` and ``mask`` may be inference
    tensors (made under ``torch.inference_mode()``). ``logp_old`` and ``advantage`` must be
    floating point (TypeError) and every input on ``logp``'s device (ValueError).
    """
    if isinstance(eps_clip, bool) or not isinstance(eps_clip, numbers.Real) or not eps_clip > 0:
        raise ValueError(f"eps_clip must be a number > 0, got {eps_clip!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    named = (("logp", logp), ("logp_old", logp_old), ("advantage", advantage), ("mask", mask))
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"clipped_policy_loss: {name} must be a tensor, got {type(t).__name__}")
    shapes = {name: tuple(t.shape) for name, t in named}
    # compared, not hashed into a set: hashing torch.compile(dynamic=True)'s symbolic sizes
    # specialised N and L, a recompile for each new (N, L) and an error at the 9th (fullgraph=True)
    if any(s != shapes["logp"] for s in shapes.values()) or logp.dim() != 2:
        raise ValueError(f"logp, logp_old, advantage and mask must all be [N, L]; got {shapes}")
    # the math runs in logp's dtype: an int64 logp truncated logp_old to integers (a loss, no
    # error); an integer logp_old or advantage (token ids passed by mistake) was cast silently
    check_float_tensors("clipped_policy_loss", ("logp", logp), ("logp_old", logp_old), ("advantage", advantage))
    if mask.device != logp.device:
        raise ValueError(f"clipped_policy_loss: mask is on {mask.device}, logp is on {logp.device}")
    check_flag("clipped_policy_loss", "validate", validate)
    _norm_length(norm_length, agg, logp.shape[-1])  # before any work: a bad one is the caller's error
    valid = policy_loss_valid(logp.detach(), logp_old.detach(), advantage.detach(), mask, bool(validate))
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    log_ratio = torch.where(valid, logp - logp_old.detach().to(logp.dtype), zero)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = torch.where(valid, advantage.detach().to(logp.dtype), zero)
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip) * adv
    loss_mat = -torch.minimum(unclipped, clipped)
    # valid is checked above: a second check would be a second pass and host sync
    return agg_loss(loss_mat, valid, agg, norm_length, validate=False)


__all__ = ["AGG_MODES", "agg_loss", "clipped_policy_loss"]
