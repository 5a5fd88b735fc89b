"""``prefix_shared_attention`` as a cascade on FlashAttention-2 (backend "flash_attn_cascade").

Two FlashAttention-2 varlen passes and one merge (FlashInfer's and vLLM's cascade shape):
  1. prefix pass: every token of group g attends, without mask, to the group's prefix —
     one varlen "sequence" per group: its tokens as queries, its prefix as keys;
  2. own pass: each segment causally over itself;
  3. ``merge_attention_states`` (CUDA kernel of acarerank._C when built) joins them by lse.

Plan / run split (FlashInfer's ``plan``/``run``; how a serving stack runs a cascade): the
index work — which query rows go to which group's prefix, the cumulative lengths of both
passes, the largest lengths — depends only on the batch metadata, so ``plan_flash_cascade``
does it once per packed batch (one device→host copy of the metadata: the only host sync)
and ``run_flash_cascade`` does device work only (no sync, no host→device copy), so every
layer of a forward reuses one plan. ``prefix_shared_attention_flash_cascade`` = plan + run,
for the one-call API.

The varlen kernel: flash-attn's ``flash_attn_varlen_func`` when the package is installed,
else PyTorch's own build of the same FlashAttention-2 kernel
(``torch.ops.aten._flash_attention_forward``, CUDA builds of PyTorch); ``VARLEN_KERNEL``
names the one in use. Neither (a CPU-only PyTorch without flash-attn): importing this
module raises ImportError, which ``attention.py`` reports as a BackendError. Both return
``(out, softmax_lse [H, total_q])``; rows with no keys get lse = +inf there, mapped to −inf here.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from ._backend import BackendError
from .merge_states import merge_attention_states


def _find_varlen_kernel():
    """(name, fn(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal) -> (out, lse [H, total_q]))."""
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        flash_attn_varlen_func = None
    if flash_attn_varlen_func is not None:
        def fa(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, block_table=None):
            kw = {} if block_table is None else {"block_table": block_table}  # paged K/V (flash-attn >= 2.5)
            res = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                         return_attn_probs=True, **kw)
            return res[0], res[1]
        return f"flash-attn {getattr(flash_attn, '__version__', '?')}", fa
    aten = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if aten is not None and torch.cuda.is_available():
        def torch_fa2(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, block_table=None):
            if block_table is not None:
                raise BackendError("prefix_shared_attention_paged: flash_attn_cascade reads pages through "
                                   "flash-attn's block_table; PyTorch's FlashAttention-2 build has none "
                                   "(pip install flash-attn)")
            res = aten(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
            return res[0], res[1]
        return f"torch {torch.__version__} FlashAttention-2 (aten._flash_attention_forward)", torch_fa2
    raise ImportError("flash_attn_cascade needs flash-attn (pip install flash-attn) or a CUDA build of PyTorch "
                      "with its FlashAttention-2 kernel")


VARLEN_KERNEL, _varlen_kernel = _find_varlen_kernel()  # ImportError here -> BackendError upstream


def varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, block_table=None):
    """One FlashAttention-2 varlen call (``VARLEN_KERNEL``): q [Tq, Hq, d], k/v [Tk, Hkv, d], cu_q/cu_k
    [N+1] int32 on q's device -> (out [Tq, Hq, d], lse [Tq, Hq] fp32 view; +inf for rows without keys)."""
    kw = {} if block_table is None else {"block_table": block_table}
    out, lse = _varlen_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, **kw)
    if lse.dim() != 2 or lse.shape != (q.shape[1], q.shape[0]):
        raise BackendError(
            f"prefix_shared_attention: flash_attn_cascade expects the varlen lse as [heads, total_q] "
            f"= [{q.shape[1]}, {q.shape[0]}], got {tuple(lse.shape)} from {VARLEN_KERNEL} (flash-attn >= 2.4 is needed)"
        )
    return out, lse.t()  # [total_q, heads] view


@dataclass(frozen=True)
class CascadePlan:
    """Index tensors of one packed batch for ``run_flash_cascade`` (device tensors, Python ints).

    num_tokens T; cu_seqlens [S+1] int32 and max_seg: the own pass. Prefix pass (None / 0 when
    no group has a prefix): perm [T'] int64, the query rows in group order (None when it is
    the identity and T' = T); cu_q / cu_k [G'+1] int32 over the G' groups with a prefix;
    max_q, max_k their largest lengths.
    """
    num_tokens: int
    cu_seqlens: torch.Tensor
    max_seg: int
    perm: Optional[torch.Tensor]
    cu_q: Optional[torch.Tensor]
    cu_k: Optional[torch.Tensor]
    max_q: int
    max_k: int

    @property
    def has_prefix_pass(self) -> bool:
        return self.cu_q is not None


def plan_flash_cascade(cu_seqlens: torch.Tensor, cu_prefix_lens: torch.Tensor, segment_group: torch.Tensor,
                       num_tokens: int, host_meta: Optional[torch.Tensor] = None) -> CascadePlan:
    """Build the cascade's indices once per batch (metadata as in ``prefix_shared_attention``).

    One device→host copy of the three metadata tensors — none when ``host_meta`` (their host
    copy, ``cat([cu_seqlens, cu_prefix_lens, segment_group])`` as ``AttentionPlan.host_meta``
    holds it) is given; the index arithmetic is vectorised on the host and the results go to
    the device once (int32 / int64, contiguous).
    """
    dev = cu_seqlens.device
    S, G = segment_group.numel(), cu_prefix_lens.numel() - 1
    if host_meta is None:
        host_meta = torch.cat([cu_seqlens, cu_prefix_lens, segment_group]).cpu()
    host = host_meta.to(torch.int64)
    cs, cp, sg = torch.split(host, [S + 1, G + 1, S])
    seg_len = cs[1:] - cs[:-1]
    pre_len = cp[1:] - cp[:-1]
    max_seg = int(seg_len.max()) if S else 0
    keep_group = pre_len > 0
    if not bool(keep_group.any()) or S == 0:
        return CascadePlan(num_tokens, cu_seqlens, max_seg, None, None, None, 0, 0)
    # segments whose rows meet a prefix, in group order (stable: packing order within a group)
    seg_keep = (seg_len > 0) & keep_group[sg]
    segs = torch.nonzero(seg_keep).flatten()
    segs = segs[torch.argsort(sg[segs], stable=True)]
    lens = seg_len[segs]
    starts = cs[:-1][segs]
    n = int(lens.sum())
    # perm[j] = starts[i] + (j − first row of segment i in the permuted order)
    first = torch.cumsum(lens, 0) - lens
    perm = torch.repeat_interleave(starts - first, lens) + torch.arange(n, device=host.device)
    identity = n == num_tokens and bool(torch.equal(perm, torch.arange(num_tokens, device=host.device)))
    # per kept group: its query rows (possibly 0) and its prefix keys; dropped groups hold no keys
    rows_per_group = torch.zeros(pre_len.numel(), dtype=torch.int64, device=host.device).index_add_(0, sg[segs], lens)
    q_counts, k_counts = rows_per_group[keep_group], pre_len[keep_group]
    zero = torch.zeros(1, dtype=torch.int64, device=host.device)
    cu_q = torch.cat([zero, torch.cumsum(q_counts, 0)]).to(dev, torch.int32)
    cu_k = torch.cat([zero, torch.cumsum(k_counts, 0)]).to(dev, torch.int32)
    return CascadePlan(num_tokens, cu_seqlens, max_seg, None if identity else perm.to(dev), cu_q, cu_k,
                       max(int(q_counts.max()), 1), int(k_counts.max()))


def run_flash_cascade(plan: CascadePlan, q, k, v, prefix_k, prefix_v, scale: float,
                      block_table: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The cascade on a plan from ``plan_flash_cascade``: device work only, no host sync.

    q: [T, Hq, d]; k, v: [T, Hkv, d]; prefix_k/v: [Ptot, Hkv, d], fp16/bf16 CUDA tensors — or,
    with ``block_table`` ([G', max_blocks] int32, one row per group with a prefix, in order),
    pages [num_blocks, block_size, Hkv, d] read through flash-attn's own block table.
    Returns out [T, Hq, d] in q's dtype.
    """
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendError(f"prefix_shared_attention: flash_attn_cascade needs float16/bfloat16, got {q.dtype}")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"prefix_shared_attention: the cascade plan is for {plan.num_tokens} tokens, q has {q.shape[0]}")
    if plan.num_tokens == 0:
        return torch.zeros_like(q)
    # -- own pass: each segment causally over itself (empty segments are zero-length sequences)
    o_own, lse_own = varlen_attention(q, k, v, plan.cu_seqlens, plan.cu_seqlens, plan.max_seg, plan.max_seg, scale,
                             causal=True)
    if not plan.has_prefix_pass:
        return o_own.to(q.dtype)
    # -- prefix pass: the rows of groups with a prefix, in group order
    q_pre = q if plan.perm is None else q.index_select(0, plan.perm)
    o_p, lse_p = varlen_attention(q_pre, prefix_k, prefix_v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, scale,
                                  causal=False, block_table=block_table)
    if plan.perm is None:
        o_pre, lse_pre = o_p, lse_p
    else:  # tokens of prefix-less groups (and empty rows): weight 0 in the merge
        o_pre = torch.zeros_like(q)
        lse_pre = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        o_pre[plan.perm] = o_p
        lse_pre[plan.perm] = lse_p.float()
    # a row with no keys gets lse = +inf from FlashAttention-2: it must weigh nothing
    lse_pre = torch.where(torch.isposinf(lse_pre), torch.full_like(lse_pre, float("-inf")), lse_pre)
    # the merge op has no flash_attn_cascade backend, so ACARERANK_BACKEND=flash_attn_cascade leaves it
    # on its device default (a preference applies only to the ops that declare the name)
    merged, _ = merge_attention_states(o_pre, lse_pre, o_own, lse_own, validate=False)  # +inf mapped above
    return merged.to(q.dtype)


# The last plan built from an ``AttentionPlan``'s host metadata: every layer of one forward
# passes the same ``host_meta`` tensor, so the cascade's indices are built (and copied to the
# device) at the first layer only.
_last_plan: tuple = (None, None)


def prefix_shared_attention_flash_cascade(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group,
                                          scale, work=None, host_meta=None):
    """Same contract as ``prefix_shared_attention`` (inputs already checked there): plan, then run.

    q: [T, Hq, d]; k, v: [T, Hkv, d]; prefix_k/v: [Ptot, Hkv, d]; cu_seqlens [S+1],
    cu_prefix_lens [G+1], segment_group [S] int32. Returns out [T, Hq, d] in q's dtype.
    Without ``host_meta``: one host sync (the plan) per call. With the ``AttentionPlan``'s
    ``host_meta``: no sync, and the cascade plan is reused while the same ``host_meta`` comes
    back (every layer of one forward). ``work`` is unused.
    """
    global _last_plan
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendError(f"prefix_shared_attention: flash_attn_cascade needs float16/bfloat16, got {q.dtype}")
    if host_meta is None:
        plan = plan_flash_cascade(cu_seqlens, cu_prefix_lens, segment_group, q.shape[0])
    else:
        ref, plan = _last_plan
        if ref is None or ref() is not host_meta or plan.num_tokens != q.shape[0] \
                or plan.cu_seqlens is not cu_seqlens:
            plan = plan_flash_cascade(cu_seqlens, cu_prefix_lens, segment_group, q.shape[0], host_meta=host_meta)
            _last_plan = (weakref.ref(host_meta), plan)
    return run_flash_cascade(plan, q, k, v, prefix_k, prefix_v, scale)


def prefix_shared_attention_paged_flash_cascade(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens,
                                                segment_group, scale, host_meta=None):
    """``prefix_shared_attention_paged`` on flash-attn: the prefix pass reads the pages through
    flash-attn's own ``block_table`` (one row per group with a prefix), nothing is gathered.

    k_cache/v_cache: [num_blocks, block_size, Hkv, d]; block_table [G, max_blocks] int32;
    cu_prefix_lens [G+1] (cumulative prefix lengths); host_meta: the paged plan's host copy of
    (cu_seqlens, cu_prefix_lens, segment_group). flash-attn 2 takes page sizes that are
    multiples of 256 only: other block sizes are a BackendError.
    """
    if k_cache.shape[1] % 256:
        raise BackendError(f"prefix_shared_attention_paged: flash_attn_cascade needs block_size a multiple of 256 "
                           f"(flash-attn 2's paged KV), got {k_cache.shape[1]}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendError(f"prefix_shared_attention_paged: flash_attn_cascade needs float16/bfloat16, got {q.dtype}")
    plan = plan_flash_cascade(cu_seqlens, cu_prefix_lens, segment_group, q.shape[0], host_meta=host_meta)
    if not plan.has_prefix_pass:
        return run_flash_cascade(plan, q, k, v, k_cache, v_cache, scale)
    S, G = segment_group.numel(), cu_prefix_lens.numel() - 1
    host = host_meta if host_meta is not None else torch.cat([cu_seqlens, cu_prefix_lens, segment_group]).cpu()
    cp = host.to(torch.int64)[S + 1:S + G + 2]
    keep = torch.nonzero(cp[1:] > cp[:-1]).flatten().to(block_table.device)  # the groups of the prefix pass
    return run_flash_cascade(plan, q, k, v, k_cache, v_cache, scale,
                             block_table=block_table.index_select(0, keep).contiguous())
