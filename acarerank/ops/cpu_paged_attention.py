"""The "torch" backend's CPU path of ``prefix_shared_attention_paged`` (the fallback where the
native kernel, ``cpu_attention``, is not built): the prefix read from its pages in place.

Per group g (query rows Tg of its segments, prefix of P_g tokens in pages):

  prefix part  every query row of the group against the whole prefix in one fused call
               (torch's blocked CPU flash kernel, GQA folded into rows: kv head h serves its r
               query heads as r·Tg rows). The prefix K/V are *views of the page pool*: when
               the group's blocks are consecutive ids b0..b0+n−1 (what a prefill allocates) the
               prefix is ``pages[b0:b0+n]`` flattened to [n·block_size, Hkv, d] and cut to
               P_g rows — no copy. Otherwise (blocks scattered by the prefix cache's reuse and
               eviction, or a pool whose block stride is not block_size rows) the group's rows
               are gathered once: at these shapes one gather (P·Hkv·d values) moves less
               memory than a log-sum-exp merge per extra run of pages (Tg·Hq·d values, ×3).
  own part     each segment causally over its own rows (one small fused call per segment).
  merge        by log-sum-exp:  out = o_pre·e^(lse_pre − lse) + o_own·e^(lse_own − lse),
               lse = logaddexp(lse_pre, lse_own).

Everything is laid out [Hkv, r, Tg, d] (q copied into it once): the prefix call reads it as
[Hkv, r·Tg, d] rows, each segment's own call as a [Hkv, r, L, d] slice, the merge runs on
contiguous tensors, and one strided copy writes the output rows. Inputs are computed in fp32
whatever their dtype. docs/ARCHITECTURE.md, "The one primitive".
"""
from __future__ import annotations

from typing import Optional

import torch

from .attention import _FLASH_CPU, _group_rows, _host_lists, _partial_attention, check_host_lists, flash_cpu


def available(q: torch.Tensor) -> bool:
    """This path needs torch's fused CPU flash kernel (it returns the log-sum-exp)."""
    return q.device.type == "cpu" and _FLASH_CPU is not None


SCATTERED = -2  # ``first_blocks`` entry of a group whose blocks are not consecutive ids


def first_blocks(block_table: torch.Tensor, prefix_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """int64 [G] on the host: group g's first block id when its used blocks are consecutive ids
    (one run of pages), ``SCATTERED`` when not, -1 for an empty prefix (nothing to read)."""
    bt, pl = block_table.cpu().tolist(), prefix_lens.cpu().tolist()
    out = []
    for row, n in zip(bt, pl):
        nb = -(-n // block_size)
        if nb == 0:
            out.append(-1)
            continue
        ids = row[:nb]
        out.append(ids[0] if ids == list(range(ids[0], ids[0] + nb)) else SCATTERED)
    return torch.tensor(out, dtype=torch.int64, device="cpu")


def _prefix_view(cache: torch.Tensor, first_block: int, length: int, block_size: int) -> Optional[torch.Tensor]:
    """[length, Hkv, d] view of ``length`` rows starting at ``first_block``, or None when the
    pool's strides cannot express it as one view (block stride != block_size · row stride)."""
    nb = -(-length // block_size)
    pages = cache[first_block:first_block + nb]
    if pages.stride(0) != block_size * pages.stride(1):
        return None
    return pages.as_strided((nb * block_size, *pages.shape[2:]), (pages.stride(1), *pages.stride()[2:]))[:length]


def _merge(o_a, lse_a, o_b, lse_b):
    """Two normalised partial softmaxes over disjoint key sets -> the one over their union:
    o_a·e^(lse_a − lse) + o_b·e^(lse_b − lse), the packed torch backend's merge (``torch.lerp``
    computes o_b − (o_b − o_a)·(1 − w) for w ≥ 0.5: an infinite o gave inf − inf = NaN where the
    reference gives ±inf)."""
    lse = torch.logaddexp(lse_a, lse_b)
    return o_a * torch.exp(lse_a - lse)[..., None] + o_b * torch.exp(lse_b - lse)[..., None], lse


def paged_attention_cpu(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, scale,
                        *, runs: torch.Tensor, blk: torch.Tensor, slot: torch.Tensor, host_meta: torch.Tensor):
    """out [T, Hq, d] (q's dtype) of the paged op; ``runs`` from ``first_blocks``, ``blk``/``slot``
    the gather indices of every prefix row (read for groups whose blocks are not one run)."""
    T, Hq, d = q.shape
    Hkv = k.shape[1]
    r = Hq // Hkv
    bs = k_cache.shape[1]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the op's fake says
    cs, cp, sg = _host_lists(host_meta, segment_group.numel(), cu_prefix_lens.numel() - 1)
    check_host_lists(cs, cp, sg, T, None, "prefix_shared_attention_paged")
    first = runs.tolist()

    for g, segs, rows, t0, t1 in _group_rows(cs, sg, q.device):
        qg = q[rows] if rows is not None else q[t0:t1]
        Tg = qg.shape[0]
        qh = qg.float().reshape(Tg, Hkv, r, d).permute(1, 2, 0, 3).contiguous()   # [Hkv, r, Tg, d]

        # -- own (causal) part, one segment at a time, into [Hkv, r, Tg, d]
        o_own = qh.new_empty(Hkv, r, Tg, d)
        lse_own = qh.new_empty(Hkv, r, Tg)
        off = 0
        for s in segs:
            a, b = cs[s], cs[s + 1]
            L = b - a
            ks = k[a:b].float().permute(1, 0, 2)[:, None].expand(Hkv, r, L, d)  # stride 0 over r: no copy
            vs = v[a:b].float().permute(1, 0, 2)[:, None].expand(Hkv, r, L, d)
            o, lse = _partial_attention(qh[:, :, off:off + L], ks, vs, scale, causal=True)
            o_own[:, :, off:off + L] = o
            lse_own[:, :, off:off + L] = lse
            off += L

        # -- prefix part, from the pages in place when they are one run
        P = cp[g + 1] - cp[g]
        if P:
            pk = pv = None
            if first[g] >= 0:
                pk = _prefix_view(k_cache, first[g], P, bs)
                pv = _prefix_view(v_cache, first[g], P, bs)
            if pk is None or pv is None:
                idx = slice(cp[g], cp[g + 1])
                pk, pv = k_cache[blk[idx], slot[idx]], v_cache[blk[idx], slot[idx]]
            o, lse = flash_cpu(qh.view(1, Hkv, r * Tg, d), pk.float().transpose(0, 1)[None],
                               pv.float().transpose(0, 1)[None], scale, causal=False)
            o_pre, lse_pre = o.view(Hkv, r, Tg, d), lse.view(Hkv, r, Tg)
            res = _merge(o_own, lse_own, o_pre, lse_pre)[0]
        else:
            res = o_own
        # the fused kernel drops a NaN query (its row max ignores NaN) and returns a finite row;
        # the reference's softmax gives NaN there: a NaN in q[t, h] makes out[t, h] NaN
        q_nan = torch.isnan(qh).any(-1)                                               # [Hkv, r, Tg]
        if not P:
            # no prefix: a row whose own scores are all −inf is 0/0 in plain softmax (o_own holds
            # 0, flash_cpu's rule); with one, _merge makes it NaN (e^(−inf − (−inf)) = NaN)
            q_nan |= torch.isneginf(lse_own)
        if bool(q_nan.any()):
            res = res.masked_fill(q_nan[..., None], float("nan"))
        res = res.permute(2, 0, 1, 3)                                                 # [Tg, Hkv, r, d] view
        if rows is not None:
            out[rows] = res.reshape(Tg, Hq, d).to(q.dtype)
        else:
            out[t0:t1].view(Tg, Hkv, r, d).copy_(res)
    return out
