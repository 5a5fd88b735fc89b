"""Outcome and combined advantages of Adaptive Tutoring Optimization (AdaTutoRank (2026), §3.4, Appendix A).

    GRPO (Eq. 7):  A_i = (r_i − mean_g(r)) / (std_g(r) + eps)          constant over the tokens of y_i
    ATO  (Eq. 10 with Algorithm 1 line 41 / Appendix A's format mask m_i):
                   A_i,l = λ·A_i + (1 − λ)·m_i·A_ATD_i,l,    m_i = 𝟙[r_i ≠ −1]

Pure tensor functions; no autograd is needed (advantages are constants, Assumption 1).
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from ..ops._checks import check_flag


def _as_1d_float(x, name: str) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, dtype=torch.float64)
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if not (t.is_floating_point() or t.dtype in (torch.int32, torch.int64)):
        raise TypeError(f"{name} must be numeric, got {t.dtype}")
    t = t.double()
    if not torch.isfinite(t).all():
        raise ValueError(f"{name} contains NaN/inf at {(~torch.isfinite(t)).nonzero().flatten()[:5].tolist()}")
    return t


def _group_ids(group_index) -> torch.Tensor:
    """A non-tensor ``group_index`` as an int64 tensor: strings (verl keys its GRPO groups by a
    ``uid`` string per rollout, a numpy array of str) numbered by first appearance; anything
    else through torch.as_tensor (checked after). Strings were a bare 'too many dimensions
    'str'' from torch.as_tensor. One str / bytes (not one id per rollout) is a TypeError."""
    if getattr(getattr(group_index, "dtype", None), "kind", None) in ("U", "S"):
        # a numpy array of str / bytes, empty ones too (an empty batch's uids: torch.as_tensor cannot
        # read a str array, so 'can't convert np.ndarray of type numpy.str_'); its shape is kept
        # for grpo_advantage's [N] check
        return _number(group_index.ravel().tolist()).reshape(group_index.shape)
    if isinstance(group_index, (str, bytes, bytearray)):
        # one uid is not one per rollout: iterated, "q7" was two groups 'q' and '7'
        raise TypeError(f"group_index must be one id per rollout (a list, array or tensor), got a "
                        f"{type(group_index).__name__}")
    ids = group_index.tolist() if hasattr(group_index, "tolist") else list(group_index)
    if ids and any(isinstance(x, (str, bytes)) for x in ids):
        if not all(isinstance(x, (str, bytes)) for x in ids):
            raise TypeError("group_index must be all integers or all strings, got a mix")
        return _number(ids)
    # ids, not group_index: a generator is spent by list() above
    return torch.as_tensor(ids)


def _number(ids: list) -> torch.Tensor:
    """[len(ids)] int64: each distinct id numbered by its first appearance."""
    number: dict = {}
    return torch.tensor([number.setdefault(x, len(number)) for x in ids], dtype=torch.int64)


def grpo_advantage(rewards, group_index, eps: float = 1e-6, unbiased: bool = True) -> torch.Tensor:
    """Group-relative outcome advantage, Eq. 7: A_i = (r_i − mean_g r) / (std_g r + eps).

    Args:
      rewards: [N] rewards (malformed rollouts carry their −1 of Eq. 6; they take part in the
        group statistics, as Algorithm 1 line 18 standardises over all G rollouts).
      group_index: [N] query id of each rollout: integers (a tensor, list or array), or strings
        (verl's ``uid``: a list or numpy array of str); any values, rollouts sharing a value
        form one group, in any order.
      eps: added to the std (verl's default 1e-6).
      unbiased: std with Bessel's correction (÷(n−1)), as verl's ``torch.std``; False: ÷n.
    Returns: [N] fp32.
    Edge cases: a zero-variance group (all rewards equal) gets exactly 0 for every member (no
    relative signal; also exact where mean-subtraction would leave 1e-17 residues). A group of
    one rollout gets 0: there is nothing to compare it with and its unbiased std is undefined.
    (verl instead sets mean 0 and std 1 for a singleton, i.e. A = r / (1 + eps) — an absolute
    reward leaking into a relative advantage; we do not copy that.)
    """
    check_flag("grpo_advantage", "unbiased", unbiased)  # "false" is truthy: Bessel's correction with no word
    r = _as_1d_float(rewards, "rewards")
    g = group_index if isinstance(group_index, torch.Tensor) else _group_ids(group_index)
    if g.dim() != 1 or g.shape[0] != r.shape[0]:
        raise ValueError(f"group_index must be [N={r.shape[0]}], got shape {tuple(g.shape)}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if r.numel() == 0:
        return torch.zeros(0, dtype=torch.float32)
    if g.is_floating_point() or g.dtype == torch.bool:
        raise TypeError(f"group_index must be an integer tensor, got {g.dtype}")
    _, inv = torch.unique(g.to(r.device).long(), return_inverse=True)
    n_groups = int(inv.max()) + 1
    count = torch.bincount(inv, minlength=n_groups).double()
    mean = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, r) / count
    dev = r - mean[inv]
    ss = torch.zeros(n_groups, dtype=torch.float64, device=r.device).index_add_(0, inv, dev * dev)
    denom = (count - 1).clamp(min=1) if unbiased else count
    std = torch.sqrt(ss / denom)
    gmax = torch.full((n_groups,), -torch.inf, dtype=torch.float64, device=r.device).scatter_reduce_(0, inv, r, "amax")
    gmin = torch.full((n_groups,), torch.inf, dtype=torch.float64, device=r.device).scatter_reduce_(0, inv, r, "amin")
    flat = (count == 1) | (gmax == gmin)
    adv = dev / (std[inv] + eps)
    return torch.where(flat[inv], torch.zeros_like(adv), adv).float()


def _check_0_1(m: torch.Tensor, name: str, what: str) -> None:
    """ValueError naming ``name`` and its first entries other than 0 / 1 (NaN included) unless bool:
    a soft or NaN entry read as bool is 1, which neither mask means."""
    if m.dtype != torch.bool and bool(((m != 0) & (m != 1)).any()):
        flat = m.flatten().tolist()
        bad = [(tuple(divmod(i, m.shape[-1])) if m.dim() == 2 else i, v) for i, v in enumerate(flat) if v not in (0, 1)]
        raise ValueError(f"{name} must be bool or 0/1 {what}, got {len(bad)} other value(s), first (position, value) "
                         f"{bad[:5]}")


def ato_advantage(a_grpo, a_atd, format_ok, lam: float = 0.7, response_mask: Optional[torch.Tensor] = None):
    """Combined ATO advantage, Eq. 10 with the format mask of Algorithm 1 (line 41) and Appendix A:

        A_i,l = λ·A^GRPO_i + (1 − λ)·m_i·A^ATD_i,l

    The main-text Eq. 10 omits m_i; Algorithm 1 and Appendix A include it (a malformed rollout,
    r_i = −1, is supervised by the outcome advantage alone). Where m_i = 0 the ATD term is
    replaced by 0, not multiplied, so a non-finite A^ATD there cannot produce NaN.

    Args:
      a_grpo: [N] per-rollout (or [N, L] per-token) outcome advantage.
      a_atd: [N, L] per-token distillation advantage (``rescore(...).atd``).
      format_ok: [N] bool m_i (or 0/1 numbers; any other value is a ValueError).
      lam: λ in [0, 1] (paper: 0.7).
      response_mask: optional [N, L] bool (or 0/1 numbers, as ``format_ok``; any other value,
        NaN included, is a ValueError); positions outside it are set to 0.
    Returns: [N, L] fp32. Raises ValueError when a result is NaN/inf (a non-finite a_grpo, or
    a_atd where m_i = 1, inside the response mask), naming the (rollout, token) positions.
    """
    # a bool is a Real: lam=True mixed as λ = 1 (pure GRPO) with no word said
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real) or not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be a number in [0, 1], got {lam!r}")
    atd = a_atd if isinstance(a_atd, torch.Tensor) else torch.as_tensor(a_atd)
    if atd.dim() != 2:
        raise ValueError(f"a_atd must be [N, L], got shape {tuple(atd.shape)}")
    N, L = atd.shape
    grpo = a_grpo if isinstance(a_grpo, torch.Tensor) else torch.as_tensor(a_grpo)
    grpo = grpo.to(atd.device, torch.float32)
    if grpo.shape == (N,):
        grpo = grpo[:, None]
    elif grpo.shape != (N, L):
        raise ValueError(f"a_grpo must be [N={N}] or [N, L]={N, L}, got shape {tuple(grpo.shape)}")
    m = format_ok if isinstance(format_ok, torch.Tensor) else torch.as_tensor(format_ok)
    if m.shape != (N,):
        raise ValueError(f"format_ok must be [N={N}], got shape {tuple(m.shape)}")
    _check_0_1(m, "format_ok", "per rollout (m_i of Eq. 10)")
    m = m.to(atd.device).bool()
    distill = torch.where(m[:, None], atd.float(), torch.zeros((), device=atd.device))
    out = lam * grpo + (1.0 - lam) * distill
    if response_mask is not None:
        response_mask = torch.as_tensor(response_mask)  # a nested list, as every other argument may be
        if response_mask.shape != (N, L):
            raise ValueError(f"response_mask must be [N, L]={N, L}, got shape {tuple(response_mask.shape)}")
        # 0.5 or NaN was read as True (a valid token), where clipped_policy_loss refuses the same mask
        _check_0_1(response_mask, "response_mask", "per token")
        out = torch.where(response_mask.to(atd.device).bool(), out, torch.zeros((), device=atd.device))
    bad = ~torch.isfinite(out)  # [N, L]: a NaN/inf input where it is used, never a silent NaN loss
    if bool(bad.any()):
        pos = [tuple(p) for p in bad.nonzero().tolist()]
        n, l = pos[0]
        g = grpo[n, 0] if grpo.shape[1] == 1 else grpo[n, l]
        raise ValueError(f"ato_advantage: the advantage of token {l} of rollout {n} is not finite (a_grpo there is "
                         f"{g.item()}, a_atd {atd[n, l].item()}, format_ok {bool(m[n])}; {len(pos)} such positions, "
                         f"first {pos[:5]}): a non-finite input where it is used")
    return out


__all__ = ["grpo_advantage", "ato_advantage"]
