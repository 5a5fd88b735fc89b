"""Grouped prefix-shared attention: the one primitive (docs/ARCHITECTURE.md, "The one primitive").

Groups each own a prefix already in the KV cache; segments of a group attend to all of
their group's prefix (no mask) and causally to their own earlier tokens, never to other
segments. RoPE is applied by the caller with the positions of the unshared sequence
(a segment of group g starts at position P_g).

    out[t] = softmax(scale · q[t] · [prefix_k[g]; k[s_0..t]]ᵀ) · [prefix_v[g]; v[s_0..t]]

Backends (declared in ``OP``): "native" (the CPU default where acarerank._cpu is built:
cpu_attention.py, the same kernel as the paged op's), "torch" (below), "triton" (acarerank/kernels/prefix_shared_attention.py),
"flash_attn_cascade" (cascade.py). ``prefix_shared_attention_ref`` is the plain oracle.

Plan / run (FlashInfer's split): ``plan_prefix_shared_attention`` turns the batch metadata
into an ``AttentionPlan`` once per packed forward — the backend's choice and what it needs
beyond the metadata (the Triton work list; a host copy of the metadata for the torch and
cascade backends) — and every layer's ``prefix_shared_attention(..., plan=plan)`` reuses it.

Host<->device syncs per forward on CUDA (the runner builds one plan per forward):
  plan: 0 for "triton" (the work list is built by device ops), 1 for "torch" and
        "flash_attn_cascade" (one copy of the metadata to the host), +1 with validate=True;
  run:  0 per layer for "torch" and "triton" (flash_attn_cascade: its own per-call syncs).
Every host read of device metadata goes through ``_device_to_host`` (counted in the tests).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Optional

import torch

from . import _backend
from . import cpu_attention as _native_attn
from ._checks import as_fp32, inference_only, positive_in_fp32

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
    if Hq == 0 or Hkv == 0 or d == 0:
        # zero heads made the native kernel divide by the GQA ratio Hq / Hkv = 0 (SIGFPE)
        raise ValueError(f"prefix_shared_attention: q {tuple(q.shape)} and k {tuple(k.shape)} need at least one "
                         f"head and head_dim >= 1")
    if Hq % Hkv != 0:
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
        check_host_lists(*_host_lists(_device_to_host(cu_seqlens, cu_prefix_lens, segment_group), S, G), T,
                         prefix_k.shape[0])
    return S, G


def check_host_lists(cs: list, cp: list, sg: list, T: int, prefix_rows: Optional[int],
                     op: str = "prefix_shared_attention") -> None:
    """ValueError unless cu_seqlens ``cs`` starts at 0, is non-decreasing and ends at ``T``,
    cu_prefix_lens ``cp`` starts at 0, is non-decreasing (and ends at ``prefix_rows`` if given),
    and every segment_group value in ``sg`` names one of the ``len(cp) - 1`` groups.

    The torch backends run it on their host copy even with validate=False (O(S + G) on lists
    they hold anyway): they index Python lists with these values, where a negative group read
    another group's prefix, a negative prefix length reached torch's flash kernel with no keys
    (SIGFPE), and a cu_seqlens ending before T left rows of uninitialised memory."""
    G = len(cp) - 1
    if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
        raise ValueError(f"{op}: cu_seqlens must start at 0, be non-decreasing and end at T={T}")
    if cp[0] != 0 or (prefix_rows is not None and cp[-1] != prefix_rows) or any(b < a for a, b in zip(cp, cp[1:])):
        raise ValueError(f"{op}: cu_prefix_lens must start at 0, be non-decreasing"
                         + (f" and end at Ptot={prefix_rows}" if prefix_rows is not None else ""))
    if sg and (min(sg) < 0 or max(sg) >= G):
        raise ValueError(f"{op}: segment_group values must lie in [0, {G})")


def check_softmax_scale(softmax_scale, d: int, op: str = "prefix_shared_attention") -> float:
    """``softmax_scale`` as a float (None: 1/sqrt(d)); ValueError unless it is finite and > 0 as
    the fp32 number every backend computes with.

    A scale ≤ 0 inverts or flattens the attention (and made the fused CPU kernel return NaN
    where plain softmax is finite); NaN/inf make every output NaN. Neither is a usable scale.
    A float finite in double but beyond fp32 (1e39: inf in the kernels) or below its smallest
    subnormal (1e-50: 0) gave NaN rows on the native and torch backends, with no error.
    """
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"{op}: softmax_scale must be a float or None, got "
                        f"{type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"{op}: softmax_scale must be finite and > 0, got {softmax_scale!r}")
    if not positive_in_fp32(softmax_scale):
        raise ValueError(f"{op}: softmax_scale must be finite and > 0 in float32 (the kernels' precision), got "
                         f"{softmax_scale!r}, which is {as_fp32(float(softmax_scale))!r} in float32")
    return float(softmax_scale)


def prefix_shared_attention_ref(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, softmax_scale=None):
    """Oracle: for each segment, plain causal attention over cat(prefix_g, own) in fp32.

    Non-finite inputs propagate as plain softmax attention does: a NaN in q[t, h] makes
    out[t, h] NaN; a NaN key or value makes NaN every row that sees it, and only those (a key
    hidden by the causal mask weighs exactly 0, never 0·inf). The CPU backends agree; Triton
    multiplies a hidden key's weight 0 by its value, so a non-finite value also reaches the rows
    before it in its tile there: more NaN rows, never fewer.
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
        out[a:b] = _weighted_values(scores.softmax(-1), vals, visible).to(q.dtype)
    return out


def _weighted_values(w, vals, visible):
    """Σ_k w[h, q, k] · vals[k, h] over the keys each row sees: w [Hq, L, K] (0 where hidden),
    vals [K, Hq, d], visible [L, K] -> [L, Hq, d]. A non-finite value reaches only the rows that
    see it: one einsum over the finite values, then the non-finite ones added where visible
    (in one einsum, a hidden key's weight 0 times inf made the rows before it NaN)."""
    finite = torch.isfinite(vals)
    out = torch.einsum("hqk,khd->qhd", w, vals.where(finite, 0))
    if not finite.all():
        out = out + _nonfinite_part(w, visible, vals.where(~finite, 0).permute(1, 0, 2)).permute(1, 0, 2)
    return out


def _nonfinite_part(w, seen, v):
    """Σ_j w[..., m, j] · v[..., j, :] over the keys j that row m sees, for v whose entries are each
    0, ±inf or NaN (a block's non-finite values, the rest zeroed), as IEEE arithmetic sums those
    products: NaN where a seen NaN, a seen inf of weight 0, or seen infs of both signs meet, else
    ±inf where a seen inf is, else 0. w [..., M, J] (finite, >= 0; a NaN row is NaN elsewhere),
    seen [M, J] bool, v [..., J, d] -> [..., M, d] fp32. By counts — matmuls of 0/1 matrices, exact
    below 2²⁴ keys — never the [..., M, J, d] products (~9 GB for one 1,024-token segment of the
    0.6B shape, where an fp16 overflow makes every key inf)."""
    seen_pos = (seen & (w > 0)).float()
    seen_zero = (seen & (w == 0)).float()
    plus, minus, nan = (v == math.inf).float(), (v == -math.inf).float(), v.isnan().float()
    n_plus, n_minus = seen_pos @ plus, seen_pos @ minus
    n_nan = (seen_pos + seen_zero) @ nan + seen_zero @ (plus + minus)
    out = torch.zeros_like(n_plus).masked_fill_(n_plus > 0, math.inf).masked_fill_(n_minus > 0, -math.inf)
    return out.masked_fill_((n_nan > 0) | ((n_plus > 0) & (n_minus > 0)), math.nan)


# torch's fused CPU flash-attention kernel returns the log-sum-exp we need for the merge;
# it is ~2x faster than bmm + softmax on 2 cores (blocked, no [M, N] score matrix).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flash_cpu(qh, kh, vh, scale: float, causal: bool):
    """``_FLASH_CPU`` on [B, H, M, d] / [B, H, N, d] inputs of any strides: (o, lse).

    The private aten kernel reads head_dim at unit stride whatever the tensor's stride there
    (torch 2.13: a transposed K gives a wrong result, no error; the public SDPA checks it before
    calling), so an input whose last dim is not unit-stride is copied once first.

    A row whose every visible score is −inf (a ±inf in q or k, or a q·k past fp32's range)
    comes back with lse = −inf and o = 0 (FlashAttention's rule: those keys weigh nothing in a
    merge). The kernel itself ends such a row with max 0 and sum 1, i.e. lse = 0 and o = 0, and
    the log-sum-exp merge then gave its keys the weight of one score 0: a wrong finite row, no
    error. lse = 0 exactly is the kernel's mark of it, so only those rows are redone
    (``_plain_rows``; a genuine lse of exactly 0, rare, is recomputed to the same value).
    """
    qh, kh, vh = (t if t.stride(-1) == 1 else t.contiguous() for t in (qh, kh, vh))
    o, lse = _FLASH_CPU(qh, kh, vh, 0.0, causal, scale=scale)[:2]
    if int(lse.count_nonzero()) < lse.numel():  # one reduction, ~1-2 µs; a CPU tensor: no device sync
        _plain_rows(qh, kh, vh, scale, causal, o, lse, lse == 0)
    return o, lse


def _plain_rows(qh, kh, vh, scale: float, causal: bool, o, lse, rows):
    """Overwrite o[b, h, m] and lse[b, h, m] where ``rows`` [B, H, M] is True by plain
    matmul + logsumexp in fp32, with FlashAttention's rule for a row without a score above −inf:
    lse = −inf, o = 0. At most ``_TORCH_SCORE_BUDGET`` scores at once."""
    N = kh.shape[-2]
    step = max(1, _TORCH_SCORE_BUDGET // max(1, N))
    for b, h in rows.any(-1).nonzero().tolist():
        ms = rows[b, h].nonzero()[:, 0]
        kt, vb = kh[b, h].float().transpose(0, 1), vh[b, h].float()
        for i in range(0, ms.numel(), step):
            m = ms[i:i + step]
            s = (qh[b, h, m].float() @ kt).mul_(scale)                                   # [n, N]
            if causal:  # row m sees keys 0..m (M == N)
                s.masked_fill_(torch.arange(N, device=s.device)[None, :] > m[:, None], float("-inf"))
            l = torch.logsumexp(s, dim=-1)
            out = (s - l[:, None]).exp_() @ vb                                         # NaN where l = −inf
            o[b, h, m] = out.masked_fill_(torch.isneginf(l)[:, None], 0.0).to(o.dtype)
            lse[b, h, m] = l.to(lse.dtype)


def _partial_attention(qh, kh, vh, scale: float, causal: bool):
    """Normalised attention of one block and its log-sum-exp, fp32.

    qh [B, H, M, d], kh/vh [B, H, N, d] (any strides, stride 0 included) ->
    (o [B, H, M, d], lse [B, H, M]) with lse = log Σ_j exp(scale·q·k_j) and
    o = Σ_j exp(scale·q·k_j − lse)·v_j; ``causal`` aligns row i with key i (M == N).
    A row with no score above −inf: lse = −inf and o = 0 (FlashAttention's rule), so a
    log-sum-exp merge gives it weight e^(−inf − lse) · 0 = 0, not NaN · 0.
    """
    if causal and vh.device.type == "cpu" and not bool(torch.isfinite(vh).all()):
        return _causal_nonfinite_values(qh, kh, vh, scale)
    if _FLASH_CPU is not None and qh.device.type == "cpu":
        return flash_cpu(qh, kh, vh, scale, causal)
    s = torch.matmul(qh, kh.transpose(-1, -2)).mul_(scale)
    if causal:
        M = s.shape[-1]
        s.masked_fill_(torch.ones(M, M, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.matmul(s.sub_(lse[..., None]).exp_(), vh)      # −inf − (−inf): NaN on such a row
    # unconditionally: an .any() would be a device sync per call off the CPU; O(M·d) beside the GEMMs
    return o.masked_fill_(torch.isneginf(lse)[..., None], 0.0), lse


def _causal_nonfinite_values(qh, kh, vh, scale: float):
    """``_partial_attention(causal=True)`` where vh holds a ±inf or NaN: the finite values as usual,
    then each non-finite one added to the rows that see it (row m sees keys ≤ m), with the weight
    exp(scale·q·k − lse) of the finite pass. Both fused kernels weigh a key hidden from a row by 0
    and multiply: 0·inf made NaN the rows before a non-finite value, which plain attention leaves
    finite (the native kernel never reads a hidden key)."""
    finite = torch.isfinite(vh)
    o, lse = _partial_attention(qh, kh, vh.where(finite, 0), scale, causal=True)
    keys = (~finite).any(-1).flatten(0, -2).any(0).nonzero()[:, 0]                 # keys with a non-finite value
    M = qh.shape[-2]
    w = torch.matmul(qh.float(), kh[..., keys, :].float().transpose(-1, -2)).mul_(scale).sub_(lse[..., None]).exp_()
    w = w.masked_fill_(torch.isneginf(lse)[..., None], 0.0)                         # a row with no score: o = 0
    seen = torch.arange(M, device=qh.device)[:, None] >= keys[None, :]               # [M, J]
    part = _nonfinite_part(w, seen, vh[..., keys, :].where(~finite[..., keys, :], 0).float())
    return o + part.to(o.dtype), lse


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


def _torch_backend(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, scale, work=None,
                   host_meta=None):
    """The reference-grade path (the CPU fallback where acarerank._cpu is not built, and other devices).

    Per group: every query row of every segment meets the prefix in one large fused call
    (``_prefix_part``); each segment's causal self-part is a small call of its own; the two
    partial softmaxes are merged by their log-sum-exps:
        lse = logaddexp(lse_p, lse_o);  out = o_p·e^(lse_p − lse) + o_o·e^(lse_o − lse).
    Inputs are computed in fp32 whatever their dtype (the "native" backend is the fast bf16 path).
    ``host_meta``: the plan's host copy of the metadata (else it is read from the device here:
    one sync per call).
    """
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    r = Hq // Hkv
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the op's fake says
    if host_meta is None:
        host_meta = _device_to_host(cu_seqlens, cu_prefix_lens, segment_group)
    cs, cp, sg = _host_lists(host_meta, segment_group.numel(), cu_prefix_lens.numel() - 1)
    check_host_lists(cs, cp, sg, T, prefix_k.shape[0])

    for g, segs, rows, t0, t1 in _group_rows(cs, sg, q.device):
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
            pk, pv = prefix_k[cp[g]:cp[g + 1]], prefix_v[cp[g]:cp[g + 1]]
            o_p, lse_p = _prefix_part(qf, pk, pv, scale)
            lse = torch.logaddexp(lse_p, lse_o)
            res = o_p * (lse_p - lse).exp_()[..., None] + o_o * (lse_o - lse).exp_()[..., None]
        else:
            res = o_o
        # torch's fused CPU kernel drops a NaN query (its row max ignores NaN) and returns a finite
        # row; the reference's softmax gives NaN there. Put it back: a NaN in q[t, h] makes out[t, h] NaN.
        q_nan = torch.isnan(qf).any(-1)                                            # [Tg, Hq]
        if cp[g + 1] == cp[g]:
            # no prefix: a row whose own scores are all −inf is 0/0 in plain softmax (o_o holds 0);
            # with one, the merge makes it NaN (e^(−inf − logaddexp(−inf, −inf)) = NaN)
            q_nan |= torch.isneginf(lse_o)
        res = res.masked_fill(q_nan[..., None], float("nan"))
        if rows is not None:
            out[rows] = res.to(q.dtype)
        else:
            out[t0:t1] = res.to(q.dtype)
    return out


OP = _backend.OpDecl(
    "prefix_shared_attention", aliases=("attention",),
    backends={"torch": _backend.Backend(lambda: _torch_backend),
              "native": _native_attn.packed_backend(),
              "triton": _backend.lazy_backend("prefix_shared_attention", "triton",
                                              "acarerank.kernels.prefix_shared_attention",
                                              "prefix_shared_attention_triton"),
              # flash-attn is optional and GPU-only
              "flash_attn_cascade": _backend.lazy_backend("prefix_shared_attention", "flash_attn_cascade",
                                                          "acarerank.ops.cascade",
                                                          "prefix_shared_attention_flash_cascade", ("cuda",))},
    # CPU: the native kernel (cpu_attention.py) where acarerank._cpu is built, else torch's fused
    # flash kernel per group (both beat the Triton interpreter by orders of magnitude)
    defaults={"cpu": ("native", "torch"), "cuda": ("triton", "torch")},
)


# ---------------------------------------------------------------- plan
def _device_to_host(cu_seqlens, cu_prefix_lens, segment_group) -> torch.Tensor:
    """The metadata as one int32 CPU tensor [S+1 + G+1 + S]: ONE device->host copy (a sync on CUDA)."""
    return torch.cat([cu_seqlens, cu_prefix_lens, segment_group]).cpu()


def _host_lists(host_meta: torch.Tensor, S: int, G: int):
    """(cu_seqlens, cu_prefix_lens, segment_group) as Python lists from ``_device_to_host``'s tensor."""
    flat = host_meta.tolist()
    return flat[:S + 1], flat[S + 1:S + G + 2], flat[S + G + 2:]


def _group_rows(cs: list, sg: list, device):
    """Each group's non-empty segments, in packing order: yields (group, segments, rows, t0, t1) —
    rows None when the segments are contiguous (then they are q[t0:t1]), else the [T_g] row ids
    (int64 on ``device``) of the packed tensors they hold. cs: cu_seqlens, sg: segment_group, as lists."""
    by_group: dict[int, list[int]] = {}
    for s, g in enumerate(sg):
        if cs[s + 1] > cs[s]:
            by_group.setdefault(g, []).append(s)
    for g, segs in by_group.items():
        contiguous = all(cs[a + 1] == cs[b] for a, b in zip(segs, segs[1:]))
        rows = None if contiguous else torch.cat([torch.arange(cs[s], cs[s + 1], device=device) for s in segs])
        yield g, segs, rows, cs[segs[0]], cs[segs[-1] + 1]


@dataclass
class AttentionPlan:
    """What every layer of one packed forward shares (built by ``plan_prefix_shared_attention``).

    cu_seqlens [S+1], cu_prefix_lens [G+1], segment_group [S]: int32 on the device.
    num_tokens T, num_q_heads Hq, num_kv_heads Hkv, head_dim d, dtype: the q/k/v every layer
      passes (checked per call: a plan is only valid for those shapes).
    backend: the resolved backend name.
    work: "triton": the [W, 2] int32 work list (segment, first row), heaviest block first.
    host_meta: "torch" / "flash_attn_cascade": the metadata on the host (``_device_to_host``).
    prefix_rows: cu_prefix_lens[-1], the rows prefix_k and prefix_v must have, where the plan read
      the metadata on the host (validated, or host_meta); None where it did not (checked per call:
      the "torch" backend sliced a shorter prefix_k short, a wrong output with no error).
    A paged-KV variant adds its block table here (one more field, read by its backend).
    """
    cu_seqlens: torch.Tensor
    cu_prefix_lens: torch.Tensor
    segment_group: torch.Tensor
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    backend: str
    work: Optional[torch.Tensor] = None
    host_meta: Optional[torch.Tensor] = None
    prefix_rows: Optional[int] = None


def plan_prefix_shared_attention(cu_seqlens, cu_prefix_lens, segment_group, *, num_tokens: int, num_q_heads: int,
                                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, backend=None,
                                 validate: bool = True) -> AttentionPlan:
    """Build the plan of one packed batch (module docstring: what it holds, how many syncs).

    cu_seqlens [S+1], cu_prefix_lens [G+1], segment_group [S]: int32, one device, as
    ``prefix_shared_attention`` takes them. ``backend``: a name, a per-op mapping or None.
    validate: check the metadata values (one more host sync).
    """
    for name, t in (("cu_seqlens", cu_seqlens), ("cu_prefix_lens", cu_prefix_lens), ("segment_group", segment_group)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"plan_prefix_shared_attention: {name} must be a 1-D int32 tensor")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"plan_prefix_shared_attention: query heads {num_q_heads} are not a multiple of "
                         f"kv heads {num_kv_heads}")
    device = cu_seqlens.device
    name = _native_attn.resolve(OP, backend, device, int(head_dim))
    plan = AttentionPlan(cu_seqlens, cu_prefix_lens, segment_group, int(num_tokens), int(num_q_heads),
                         int(num_kv_heads), int(head_dim), dtype, name)
    if validate:
        S, G = segment_group.numel(), cu_prefix_lens.numel() - 1
        if cu_seqlens.numel() != S + 1 or G < 0:
            raise ValueError("plan_prefix_shared_attention: cu_seqlens needs S+1 entries for segment_group's S")
        cs, cp, sgl = _host_lists(_device_to_host(cu_seqlens, cu_prefix_lens, segment_group), S, G)
        check_host_lists(cs, cp, sgl, int(num_tokens), None, "plan_prefix_shared_attention")
        plan.prefix_rows = cp[-1]
    if name == "triton":
        from acarerank.kernels.prefix_shared_attention import plan_work

        plan.work = plan_work(cu_seqlens, cu_prefix_lens, segment_group, total_tokens=plan.num_tokens,
                              num_q_heads=plan.num_q_heads, num_kv_heads=plan.num_kv_heads, head_dim=plan.head_dim,
                              dtype=dtype, device=device)
    else:
        plan.host_meta = _device_to_host(cu_seqlens, cu_prefix_lens, segment_group)
        if cu_prefix_lens.numel():
            plan.prefix_rows = int(plan.host_meta[cu_seqlens.numel() + cu_prefix_lens.numel() - 1])
    return plan


# ---------------------------------------------------------------- registered op
@torch.library.custom_op("acarerank::prefix_shared_attention", mutates_args=())
def prefix_shared_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               prefix_k: torch.Tensor, prefix_v: torch.Tensor, cu_prefix_lens: torch.Tensor,
                               segment_group: torch.Tensor, softmax_scale: float, backend: str,
                               work: Optional[torch.Tensor] = None,
                               host_meta: Optional[torch.Tensor] = None, tiles_only: bool = False) -> torch.Tensor:
    """The registered op (torch.compile-opaque); ``backend`` resolved; work / host_meta from a plan or None.

    The output is contiguous whatever q's strides, on every backend, as the fake says (the native
    kernel writes a new contiguous tensor; a fake that followed a head-major q's strides failed
    torch.compile's stride assertion).
    """
    fn = OP.impl(backend)
    native = {"tiles_only": True} if tiles_only and backend == "native" else {}  # the others have no such switch
    return fn(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, softmax_scale,
              work=work, host_meta=host_meta, **native).contiguous()


@prefix_shared_attention_op.register_fake
def _(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, softmax_scale, backend, work=None,
      host_meta=None, tiles_only=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def prefix_shared_attention(q, k, v, cu_seqlens=None, prefix_k=None, prefix_v=None, cu_prefix_lens=None,
                            segment_group=None, softmax_scale: Optional[float] = None, backend=None,
                            validate: bool = True, plan: Optional[AttentionPlan] = None, tiles_only: bool = False):
    """Causal attention of packed segments over their group's shared prefix.

    Args:
      q: [T, Hq, d]; k, v: [T, Hkv, d] — packed segments, RoPE applied; Hq % Hkv == 0.
      cu_seqlens: [S+1] int32 — segment s is rows cu_seqlens[s]:cu_seqlens[s+1] (may be empty).
      prefix_k, prefix_v: [Ptot, Hkv, d] — all groups' prefixes packed.
      cu_prefix_lens: [G+1] int32 — group g's prefix is rows cu_prefix_lens[g]:cu_prefix_lens[g+1] (may be empty).
      segment_group: [S] int32 — the group of each segment.
      softmax_scale: default 1/sqrt(d).
      backend: a name, a per-op mapping or None (``acarerank.ops._backend``).
      validate: check metadata values (one host sync); ignored with a plan (checked when planned).
      plan: an ``AttentionPlan`` of this batch: the metadata arguments may then be None, and
        ``backend`` must be None (the plan's backend runs). No host sync and no per-call
        metadata work (module docstring).
      tiles_only: "native" only: every group on the kernel's tile path, never its direct path
        (``cpu_attention``), so a row's bits do not depend on how many rows its group has in the
        call (batch-invariant mode). The other backends ignore it: Triton's rows are so already,
        "torch" and "flash_attn_cascade" claim no invariance.

    Returns: out [T, Hq, d], contiguous, in q's dtype; softmax accumulated in fp32.

    The work runs inside the custom op ``torch.ops.acarerank.prefix_shared_attention``,
    opaque to torch.compile.
    """
    if plan is not None:
        if backend is not None:
            raise ValueError("prefix_shared_attention: pass backend= to plan_prefix_shared_attention, not with plan=")
        cu_seqlens = plan.cu_seqlens if cu_seqlens is None else cu_seqlens
        cu_prefix_lens = plan.cu_prefix_lens if cu_prefix_lens is None else cu_prefix_lens
        segment_group = plan.segment_group if segment_group is None else segment_group
        if (cu_seqlens is not plan.cu_seqlens or cu_prefix_lens is not plan.cu_prefix_lens
                or segment_group is not plan.segment_group):
            raise ValueError("prefix_shared_attention: metadata tensors differ from the plan's; build a new plan")
        want = (plan.num_tokens, plan.num_q_heads, plan.head_dim, plan.num_kv_heads, plan.dtype)
        got = (q.shape[0], q.shape[1], q.shape[2] if q.dim() == 3 else -1, k.shape[1] if k.dim() == 3 else -1, q.dtype)
        if got != want:
            raise ValueError(f"prefix_shared_attention: q/k (T, Hq, d, Hkv, dtype) = {got} but the plan was built "
                             f"for {want}")
        for name, t in (("prefix_k", prefix_k), ("prefix_v", prefix_v)):
            if plan.prefix_rows is not None and isinstance(t, torch.Tensor) and t.dim() >= 1 \
                    and t.shape[0] != plan.prefix_rows:
                raise ValueError(f"prefix_shared_attention: cu_prefix_lens ends at {plan.prefix_rows} but {name} has "
                                 f"{t.shape[0]} rows")
        validate = False
    _check_inputs(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, validate)
    if plan is not None:
        name, work, host_meta = plan.backend, plan.work, plan.host_meta
    else:
        name, work, host_meta = _native_attn.resolve(OP, backend, q.device, q.shape[-1]), None, None
    scale = check_softmax_scale(softmax_scale, q.shape[-1])
    return inference_only("prefix_shared_attention", "prefix_shared_attention_ref", (q, k, v, prefix_k, prefix_v),
                          lambda: prefix_shared_attention_op(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens,
                                                             segment_group, float(scale), name, work, host_meta,
                                                             bool(tiles_only)))
