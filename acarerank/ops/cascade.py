"""``prefix_shared_attention`` as a cascade on flash-attn (backend "flash_attn_cascade").

Two flash-attn varlen passes and one merge (FlashInfer's and vLLM's cascade shape):
  1. prefix pass: every token of group g attends, without mask, to the group's prefix —
     one varlen "sequence" per group: its tokens as queries, its prefix as keys;
  2. own pass: each segment causally over itself;
  3. ``merge_attention_states`` (CUDA kernel of acarerank._C when built) joins them by lse.

flash-attn is optional (GPU only, fp16/bf16): importing this module raises ImportError when
it is missing, which ``attention.py`` reports as a BackendError. Written against the
flash-attn 2 interface (``flash_attn_varlen_func(..., return_attn_probs=True)`` returning
``(out, softmax_lse [H, total_q], _)``; rows with no keys get lse = +inf there, mapped to −inf here).
"""
from __future__ import annotations

import torch

from flash_attn import flash_attn_varlen_func  # optional dependency: ImportError -> BackendError upstream

from ._backend import BackendError
from .merge_states import merge_attention_states


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal):
    res = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
                                 return_attn_probs=True)
    out, lse = res[0], res[1]
    if lse.dim() != 2 or lse.shape != (q.shape[1], q.shape[0]):
        raise BackendError(
            f"prefix_shared_attention: flash_attn_cascade expects flash-attn's varlen lse as [heads, total_q] "
            f"= [{q.shape[1]}, {q.shape[0]}], got {tuple(lse.shape)} (flash-attn >= 2.4 is needed)"
        )
    return out, lse.t()  # [total_q, heads] view


def prefix_shared_attention_flash_cascade(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group,
                                          scale, work=None, host_meta=None):
    """Same contract as ``prefix_shared_attention`` (inputs already checked there).

    q: [T, Hq, d]; k, v: [T, Hkv, d]; prefix_k/v: [Ptot, Hkv, d]; cu_seqlens [S+1],
    cu_prefix_lens [G+1], segment_group [S] int32. Returns out [T, Hq, d] in q's dtype.
    One host sync reads the (small) metadata to build the per-group query order, unless the
    plan's ``host_meta`` (``attention._device_to_host``) is passed. ``work`` is unused.
    """
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise BackendError(f"prefix_shared_attention: flash_attn_cascade needs float16/bfloat16, got {q.dtype}")
    T = q.shape[0]
    if host_meta is not None:
        S, G = segment_group.numel(), cu_prefix_lens.numel() - 1
        flat = host_meta.tolist()
        cs, cp, sg = flat[:S + 1], flat[S + 1:S + G + 2], flat[S + G + 2:]
    else:
        cs, cp, sg = cu_seqlens.tolist(), cu_prefix_lens.tolist(), segment_group.tolist()
    S, G = len(sg), len(cp) - 1
    if T == 0:
        return torch.zeros_like(q)

    # -- own pass: each segment causally over itself (empty segments are zero-length sequences)
    seg_lens = [cs[s + 1] - cs[s] for s in range(S)]
    o_own, lse_own = _varlen(q, k, v, cu_seqlens, cu_seqlens, max(seg_lens), max(seg_lens), scale, causal=True)

    # -- prefix pass: groups with a non-empty prefix; their tokens in group order
    rows_by_group = [[] for _ in range(G)]
    for s in range(S):
        if seg_lens[s]:
            rows_by_group[sg[s]].append((cs[s], cs[s + 1]))
    keep = [g for g in range(G) if cp[g + 1] > cp[g]]
    if not keep:
        return o_own.to(q.dtype)
    perm, cu_q, cu_k = [], [0], [0]
    for g in keep:
        for a, b in rows_by_group[g]:
            perm.extend(range(a, b))
        cu_q.append(len(perm))
        cu_k.append(cu_k[-1] + cp[g + 1] - cp[g])  # dropped groups hold no keys: packing stays contiguous
    dev = q.device
    identity = len(perm) == T and perm == list(range(T))
    perm_t = None if identity else torch.tensor(perm, dtype=torch.long, device=dev)
    q_pre = q if identity else q.index_select(0, perm_t)
    max_q = max(b - a for a, b in zip(cu_q, cu_q[1:]))
    max_k = max(b - a for a, b in zip(cu_k, cu_k[1:]))
    o_p, lse_p = _varlen(q_pre, prefix_k, prefix_v, torch.tensor(cu_q, dtype=torch.int32, device=dev),
                         torch.tensor(cu_k, dtype=torch.int32, device=dev), max(max_q, 1), max_k, scale, causal=False)
    if identity:
        o_pre, lse_pre = o_p, lse_p
    else:  # tokens of prefix-less groups: weight 0 in the merge
        o_pre = torch.zeros_like(q)
        lse_pre = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=dev)
        o_pre[perm_t] = o_p
        lse_pre[perm_t] = lse_p.float()
    # a row with no keys gets lse = +inf from flash-attn: it must weigh nothing
    lse_pre = torch.where(torch.isposinf(lse_pre), torch.full_like(lse_pre, float("-inf")), lse_pre)
    # the merge op has no flash_attn_cascade backend, so ACARERANK_BACKEND=flash_attn_cascade leaves it
    # on its device default (a preference applies only to the ops that declare the name)
    merged, _ = merge_attention_states(o_pre, lse_pre, o_own, lse_own)
    return merged.to(q.dtype)
