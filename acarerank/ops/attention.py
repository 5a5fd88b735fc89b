"""Grouped prefix-shared attention: the one primitive of DESIGN.md §3.

Groups each own a prefix already in the KV cache; segments of a group attend to all of
their group's prefix (no mask) and causally to their own earlier tokens, never to other
segments. RoPE is applied by the caller with the positions of the unshared sequence
(a segment of group g starts at position P_g).

    out[t] = softmax(scale · q[t] · [prefix_k[g]; k[s_0..t]]ᵀ) · [prefix_v[g]; v[s_0..t]]

Backends: "torch" (below), "triton" (kernels/prefix_shared_attention.py), and the ones
registered by other modules. ``prefix_shared_attention_ref`` is the plain oracle.
"""
from __future__ import annotations

import math
import numbers
from typing import Optional

import torch

from . import _backend

# Rows of the prefix score matrix computed at once in the torch backend: bounds the
# temporary [Hkv, rows, P] fp32 block to ~64 MB whatever the depth.
_TORCH_SCORE_BUDGET = 1 << 24


def _check_inputs(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, validate_values: bool):
    """Raise ValueError/TypeError naming the problem; return (S, G)."""
    for name, t in (("q", q), ("k", k), ("v", v), ("prefix_k", prefix_k), ("prefix_v", prefix_v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"prefix_shared_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"prefix_shared_attention: {name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"prefix_shared_attention: {name} dtype {t.dtype} is not float32/float16/bfloat16")
        if t.dtype != q.dtype:
            raise TypeError(f"prefix_shared_attention: {name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"prefix_shared_attention: {name} is on {t.device}, q is on {q.device}")
    T, Hq, d = q.shape
    if k.shape != v.shape or k.shape[0] != T or k.shape[2] != d:
        raise ValueError(f"prefix_shared_attention: k {tuple(k.shape)} / v {tuple(v.shape)} must be [{T}, Hkv, {d}] like q {tuple(q.shape)}")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"prefix_shared_attention: query heads {Hq} are not a multiple of kv heads {Hkv}")
    if prefix_k.shape != prefix_v.shape or prefix_k.shape[1:] != (Hkv, d):
        raise ValueError(
            f"prefix_shared_attention: prefix_k {tuple(prefix_k.shape)} / prefix_v {tuple(prefix_v.shape)} must be [Ptot, {Hkv}, {d}]"
        )
    for name, t in (("cu_seqlens", cu_seqlens), ("cu_prefix_lens", cu_prefix_lens), ("segment_group", segment_group)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"prefix_shared_attention: {name} must be a 1-D int32 tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"prefix_shared_attention: {name} is on {t.device}, q is on {q.device}")
    S = cu_seqlens.numel() - 1
    G = cu_prefix_lens.numel() - 1
    if S < 0 or G < 0:
        raise ValueError("prefix_shared_attention: cu_seqlens and cu_prefix_lens need at least one entry (0)")
    if segment_group.numel() != S:
        raise ValueError(f"prefix_shared_attention: segment_group has {segment_group.numel()} entries for {S} segments")
    if validate_values:
        cs = cu_seqlens.tolist()
        cp = cu_prefix_lens.tolist()
        if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
            raise ValueError(f"prefix_shared_attention: cu_seqlens must start at 0, be non-decreasing and end at T={T}")
        if cp[0] != 0 or cp[-1] != prefix_k.shape[0] or any(b < a for a, b in zip(cp, cp[1:])):
            raise ValueError(
                f"prefix_shared_attention: cu_prefix_lens must start at 0, be non-decreasing and end at Ptot={prefix_k.shape[0]}"
            )
        if S and (int(segment_group.min()) < 0 or int(segment_group.max()) >= G):
            raise ValueError(f"prefix_shared_attention: segment_group values must lie in [0, {G})")
    return S, G


def check_softmax_scale(softmax_scale, d: int) -> float:
    """``softmax_scale`` as a float (None: 1/sqrt(d)); ValueError unless it is finite and > 0.

    A scale ≤ 0 inverts or flattens the attention (and made the fused CPU kernel return NaN
    where plain softmax is finite); NaN/inf make every output NaN. Neither is a usable scale.
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"prefix_shared_attention: softmax_scale must be a float or None, got "
                        f"{type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"prefix_shared_attention: softmax_scale must be finite and > 0, got {softmax_scale!r}")
    return float(softmax_scale)


def prefix_shared_attention_ref(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, softmax_scale=None):
    """Oracle: for each segment, plain causal attention over cat(prefix_g, own) in fp32.

    Non-finite inputs propagate as plain softmax attention does: a NaN in q[t, h] makes
    out[t, h] NaN; a NaN key or value makes NaN every row that sees it. Every backend agrees.
    """
    T, Hq, d = q.shape
    r = Hq // k.shape[1]
    scale = check_softmax_scale(softmax_scale, d)
    out = torch.zeros_like(q)
    cs, cp, sg = cu_seqlens.tolist(), cu_prefix_lens.tolist(), segment_group.tolist()
    for s in range(len(sg)):
        a, b = cs[s], cs[s + 1]
        if b == a:
            continue
        g = sg[s]
        P = cp[g + 1] - cp[g]
        keys = torch.cat([prefix_k[cp[g]:cp[g + 1]], k[a:b]]).float().repeat_interleave(r, dim=1)  # [P+L, Hq, d]
        vals = torch.cat([prefix_v[cp[g]:cp[g + 1]], v[a:b]]).float().repeat_interleave(r, dim=1)
        qs = q[a:b].float()
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale  # [Hq, L, P+L]
        L = b - a
        visible = torch.ones(L, P + L, dtype=torch.bool, device=q.device)
        visible[:, P:] = torch.tril(torch.ones(L, L, dtype=torch.bool, device=q.device))
        scores = scores.masked_fill(~visible, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vals).to(q.dtype)
    return out


# torch's fused CPU flash-attention kernel returns the log-sum-exp we need for the merge;
# it is ~2x faster than bmm + softmax on 2 cores (blocked, no [M, N] score matrix).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _partial_attention(qh, kh, vh, scale: float, causal: bool):
    """Normalised attention of one block and its log-sum-exp, fp32.

    qh [B, H, M, d], kh/vh [B, H, N, d] (any strides, stride 0 included) ->
    (o [B, H, M, d], lse [B, H, M]) with lse = log Σ_j exp(scale·q·k_j) and
    o = Σ_j exp(scale·q·k_j − lse)·v_j; ``causal`` aligns row i with key i (M == N).
    """
    if _FLASH_CPU is not None and qh.device.type == "cpu":
        return _FLASH_CPU(qh, kh, vh, 0.0, causal, scale=scale)
    s = torch.matmul(qh, kh.transpose(-1, -2)).mul_(scale)
    if causal:
        M = s.shape[-1]
        s.masked_fill_(torch.ones(M, M, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(s.sub_(lse[..., None]).exp_(), vh), lse


def _prefix_part(qf, pk, pv, scale):
    """All of a group's query rows against its prefix: qf [Tg, Hq, d], pk/pv [P, Hkv, d] -> (o [Tg, Hq, d], lse [Tg, Hq]).

    GQA is folded into the rows ([Tg, Hkv, r, d] -> [Hkv, Tg·r, d]) so every kv head's
    prefix tile serves its r query heads in one GEMM and K/V are never repeated.
    """
    Tg, Hq, d = qf.shape
    Hkv, P = pk.shape[1], pk.shape[0]
    r = Hq // Hkv
    qh = qf.view(Tg, Hkv, r, d).permute(1, 0, 2, 3).reshape(Hkv, Tg * r, d)
    # strided views, no copy: both paths read them as they are (a copy of the whole prefix
    # per layer per call cost 2x the attention itself for one-token decode segments)
    kh = pk.float().transpose(0, 1)
    vh = pv.float().transpose(0, 1)
    if _FLASH_CPU is not None and qf.device.type == "cpu":
        step = Tg * r  # the fused kernel is blocked internally: no score matrix to bound
    else:
        step = max(r, (_TORCH_SCORE_BUDGET // max(1, Hkv * P)) // r * r)
    parts = [_partial_attention(qh[None, :, i:i + step], kh[None], vh[None], scale, causal=False)
             for i in range(0, Tg * r, step)]
    o = torch.cat([p[0][0] for p in parts], dim=1) if len(parts) > 1 else parts[0][0][0]
    lse = torch.cat([p[1][0] for p in parts], dim=1) if len(parts) > 1 else parts[0][1][0]
    return (o.view(Hkv, Tg, r, d).permute(1, 0, 2, 3).reshape(Tg, Hq, d),
            lse.view(Hkv, Tg, r).permute(1, 0, 2).reshape(Tg, Hq))


def _torch_backend(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, scale):
    """CPU production path (and the reference-grade path on other devices).

    Per group: every query row of every segment meets the prefix in one large fused call
    (``_prefix_part``); each segment's causal self-part is a small call of its own; the two
    partial softmaxes are merged by their log-sum-exps:
        lse = logaddexp(lse_p, lse_o);  out = o_p·e^(lse_p − lse) + o_o·e^(lse_o − lse).
    Inputs are computed in fp32 whatever their dtype.
    """
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    r = Hq // Hkv
    out = torch.empty_like(q)
    cs, cp, sg = cu_seqlens.tolist(), cu_prefix_lens.tolist(), segment_group.tolist()

    # Segments by group, keeping packing order; a group's segments are usually contiguous.
    by_group: dict[int, list[int]] = {}
    for s, g in enumerate(sg):
        if cs[s + 1] > cs[s]:
            by_group.setdefault(g, []).append(s)

    for g, segs in by_group.items():
        contiguous = all(cs[a + 1] == cs[b] for a, b in zip(segs, segs[1:]))
        rows = None if contiguous else torch.cat([torch.arange(cs[s], cs[s + 1], device=q.device) for s in segs])
        t0, t1 = cs[segs[0]], cs[segs[-1] + 1]
        qf = (q[rows] if rows is not None else q[t0:t1]).float()
        Tg = qf.shape[0]

        # -- own (causal) part, one segment at a time: batch = kv head, heads = its r query
        # heads, K/V broadcast to them with stride 0 (no copy, no repeat)
        o_o = qf.new_empty(Tg, Hq, d)
        lse_o = qf.new_empty(Tg, Hq)
        off = 0
        for s in segs:
            a, b = cs[s], cs[s + 1]
            L = b - a
            qs = qf[off:off + L].view(L, Hkv, r, d).permute(1, 2, 0, 3)         # [Hkv, r, L, d]
            ks = k[a:b].float().permute(1, 0, 2)[:, None].expand(Hkv, r, L, d)
            vs = v[a:b].float().permute(1, 0, 2)[:, None].expand(Hkv, r, L, d)
            o, lse = _partial_attention(qs, ks, vs, scale, causal=True)
            o_o[off:off + L] = o.permute(2, 0, 1, 3).reshape(L, Hq, d)
            lse_o[off:off + L] = lse.permute(2, 0, 1).reshape(L, Hq)
            off += L

        # -- prefix part and log-sum-exp merge
        if cp[g + 1] > cp[g]:
            o_p, lse_p = _prefix_part(qf, prefix_k[cp[g]:cp[g + 1]], prefix_v[cp[g]:cp[g + 1]], scale)
            lse = torch.logaddexp(lse_p, lse_o)
            res = o_p * (lse_p - lse).exp_()[..., None] + o_o * (lse_o - lse).exp_()[..., None]
        else:
            res = o_o
        # torch's fused CPU kernel drops a NaN query (its row max ignores NaN) and returns a finite
        # row; the reference's softmax gives NaN there. Put it back: a NaN in q[t, h] makes out[t, h] NaN.
        q_nan = torch.isnan(qf).any(-1)                                            # [Tg, Hq]
        res = res.masked_fill(q_nan[..., None], float("nan"))
        if rows is not None:
            out[rows] = res.to(q.dtype)
        else:
            out[t0:t1] = res.to(q.dtype)
    return out


def _load_torch():
    return _torch_backend


def _load_triton():
    try:
        from acarerank.kernels.prefix_shared_attention import prefix_shared_attention_triton
    except ImportError as e:  # triton missing, or the kernel module not built in
        raise _backend.BackendError(f"prefix_shared_attention: triton backend unavailable: {e}") from e
    return prefix_shared_attention_triton


def _load_flash_attn_cascade():
    try:
        from .cascade import prefix_shared_attention_flash_cascade
    except ImportError as e:  # flash-attn is optional and GPU-only
        raise _backend.BackendError(f"prefix_shared_attention: flash_attn_cascade backend unavailable: {e}") from e
    return prefix_shared_attention_flash_cascade


#: backend name -> loader returning the implementation
IMPLEMENTATIONS = {"torch": _load_torch, "triton": _load_triton, "flash_attn_cascade": _load_flash_attn_cascade}


def prefix_shared_attention(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group,
                            softmax_scale: Optional[float] = None, backend: Optional[str] = None,
                            validate: bool = True):
    """Causal attention of packed segments over their group's shared prefix.

    Args:
      q: [T, Hq, d]; k, v: [T, Hkv, d] — packed segments, RoPE applied; Hq % Hkv == 0.
      cu_seqlens: [S+1] int32 — segment s is rows cu_seqlens[s]:cu_seqlens[s+1] (may be empty).
      prefix_k, prefix_v: [Ptot, Hkv, d] — all groups' prefixes packed.
      cu_prefix_lens: [G+1] int32 — group g's prefix is rows cu_prefix_lens[g]:cu_prefix_lens[g+1] (may be empty).
      segment_group: [S] int32 — the group of each segment.
      softmax_scale: default 1/sqrt(d).
      backend: see ``acarerank.ops._backend``; None = environment / device default.
      validate: check metadata values (one host sync); the runner validates once per batch.

    Returns: out [T, Hq, d] in q's dtype; softmax accumulated in fp32.

    The backend is resolved once here; the work runs inside the custom op
    ``torch.ops.acarerank.prefix_shared_attention`` (``_library``), opaque to torch.compile.
    """
    _check_inputs(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, validate)
    # resolve() imports the implementation now, so an unusable backend fails here, by name
    name, _ = _backend.resolve("prefix_shared_attention", IMPLEMENTATIONS, backend, q.device)
    _backend.check_runs_on(name, q.device, "prefix_shared_attention")
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    from ._library import prefix_shared_attention_op  # registered custom op (torch.compile-opaque)

    return prefix_shared_attention_op(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group,
                                      float(scale), name)
