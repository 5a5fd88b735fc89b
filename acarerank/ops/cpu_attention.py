"""The "native" backend of both prefix-shared attention ops: one CPU kernel for the whole batch.

``torch.ops.acarerank.prefix_shared_attention_cpu`` (``csrc/cpu/prefix_attention.cpp``) does every
group and segment of one layer in one call:

    out[t] = softmax(scale · q[t] · [K_g; k[s_0..t]]ᵀ) · [V_g; v[s_0..t]]

  * the prefix K_g/V_g read in place — from pages through the block table (the paged op) or from
    the packed prefix rows (the packed op: ``block_table=None``) — packed once per (kv head, key
    tile) and reused by every query row of the group: all its segments × the r query heads of the
    kv head are the rows of one GEMM;
  * each segment's own causal part in the same pass, continuing the same fp32 online softmax
    (no second pass, no log-sum-exp merge), in per-thread scratch: never a [rows, keys] tensor,
    never an fp32 copy of q/K/V beyond one tile;
  * GEMMs on 256-key tiles: bf16 on VNNI-packed tiles where the CPU multiplies bf16 natively —
    ``at::native::cpublas::brgemm`` where ``cpublas::could_pack(kBFloat16)`` (AMX), the kernel's
    own vdpbf16ps tiles where the CPU has AVX512_BF16 but no AMX (``csrc/cpu/gemm_bf16_avx512.h``)
    — else fp32 brgemm (fp32 inputs as they are; bf16/fp16 tiles converted to fp32 as they are
    packed: without AVX-512 cpublas' own bf16 fallback is a reference loop, ~0.3 GFLOP/s, and its
    VNNI form raises). ``_native.bf16_attention_path()`` names the path this CPU takes
    (``ACARERANK_CPU_BF16_PATH`` overrides it, docs/cpu.md);
  * work split with ``at::parallel_for`` over (group, kv head, row block), dealt to threads by
    cost (rows × keys);
  * output in q's dtype. A NaN in q[t, h] makes out[t, h] NaN, as the reference's softmax;
  * a group whose rows (tokens × gqa) are one block of at most ``DIRECT_ROWS`` (a decode step's)
    takes the direct path instead (K/V read where they lie, no packed tile: faster, other bits),
    unless the call passes ``tiles_only=True`` (the runner's batch-invariant mode): a row's bits
    then never depend on how many rows its group has in the call (docs/cpu.md).

Inputs the kernel takes as they are: any strides except on head_dim (a head_dim stride ≠ 1 is
copied once here), any head_dim up to 512 (``resolve``: past it the CPU default is "torch"), GQA
ratios, empty prefixes/segments, scattered blocks. docs/ARCHITECTURE.md, "Native CPU kernels".
"""
from __future__ import annotations

import torch

from ._backend import Backend, OpDecl
from ._native_backend import head_dim_limit, native_backend, native_kernel, resolve_within_limits

KERNEL = "prefix_shared_attention_cpu"


def _fake(q, k, v, cu_seqlens, prefix_k, prefix_v, block_table, cu_prefix_lens, segment_group, scale,
          tiles_only=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def kernel():
    """``torch.ops.acarerank.prefix_shared_attention_cpu`` with its fake registered; BackendError
    (with ``_native.why_unavailable()``'s line) where acarerank._cpu is not usable."""
    return native_kernel(KERNEL, _fake)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _packed(fn):
    """The packed op's calling convention (``attention.OP``)."""
    def run(q, k, v, cu_seqlens, prefix_k, prefix_v, cu_prefix_lens, segment_group, scale, work=None,
            host_meta=None, tiles_only=False):
        return fn(*map(_unit_last, (q, k, v)), cu_seqlens, _unit_last(prefix_k), _unit_last(prefix_v), None,
                  cu_prefix_lens, segment_group, float(scale), bool(tiles_only))
    return run


def _paged(fn):
    """The paged op's calling convention (``paged_attention.OP``; its plan has no aux for it)."""
    def run(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, aux, scale,
            tiles_only=False):
        return fn(*map(_unit_last, (q, k, v)), cu_seqlens, _unit_last(k_cache), _unit_last(v_cache), block_table,
                  cu_prefix_lens, segment_group, float(scale), bool(tiles_only))
    return run


#: keys per tile of the native kernel (``kTileKeys`` in csrc/cpu/attn_tiles.h; acarerank._cpu's
#: ``tile_keys()``, which the tests hold this to)
TILE_KEYS = 512
#: a group whose rows (tokens × gqa) are one row block of at most this many takes the direct path
#: (``kDirectRows`` in csrc/cpu/attn_direct_avx512.h; ACARERANK_CPU_DIRECT_ROWS may only lower it)
DIRECT_ROWS = 16


def aligned_prefix_tokens() -> int:
    """Q: a token's output is bitwise the same whether the prefix before its segment ends at any
    multiple of Q tokens — a prefix-cache hit of k·Q tokens, an earlier prefill chunk, or none
    (the whole sequence one segment) — as long as its group takes the tile path
    (``direct_path_tokens``).

    The tile path runs one fp32 online softmax per row over the prefix's keys in tiles of
    ``TILE_KEYS`` from the prefix's first key, then over its own keys in tiles of ``TILE_KEYS``
    from its segment's first key, continuing the same running max and sum (no merge step): with
    the prefix a multiple of ``TILE_KEYS`` the tiles, the softmax order and every tile's column
    count are those of one pass over the whole sequence. A row's place in its row block does not
    change its bits (each row's dots and sums are its own), so unlike the Triton kernel's no
    factor of gqa enters. The runner's batch-invariant mode starts every prefill pass at a
    multiple of it (``Qwen3Runner.prefix_align``) and passes ``tiles_only=True``.
    """
    return TILE_KEYS


def direct_path_tokens(gqa: int) -> int:
    """The most tokens a group's only segment may have and still take the kernel's direct path
    (decode-like blocks: keys in 64-key steps from the K/V rows as they lie, base-2 exp, P not
    rounded to bf16; csrc/cpu/attn_direct_avx512.h) — other bits than the tile path's (fp32
    ~1e-6, bf16 ~1e-2 in the attention output), so the same token computed in a group of more rows
    gets other bits. ``tiles_only=True`` (the runner's batch-invariant mode) never takes it."""
    return DIRECT_ROWS // gqa


#: the largest head_dim the Triton attention kernels take (``_MAX_HEAD_DIM`` in
#: acarerank/kernels/prefix_shared_attention.py: its register tiles)
TRITON_MAX_HEAD_DIM = 256


def resolve(decl: OpDecl, backend, device: torch.device, head_dim: int) -> str:
    """``decl.resolve(backend, device)`` for a call with heads of ``head_dim``: past a kernel's
    limit (native 512, triton 256) the device default walks on to "torch" (a d-320 model on CUDA,
    whose default is triton, raised the kernel's ValueError from inside the call), and that
    backend asked for by name is a ``BackendLimitError`` naming the limit, before any work."""
    triton = None if head_dim <= TRITON_MAX_HEAD_DIM else f"takes head_dim up to {TRITON_MAX_HEAD_DIM}, got {head_dim}"
    return resolve_within_limits(decl, backend, device, {"native": head_dim_limit(head_dim), "triton": triton})


def packed_backend() -> Backend:
    """The "native" backend of ``prefix_shared_attention`` (CPU tensors)."""
    return native_backend("prefix_shared_attention", KERNEL, _fake, wrap=_packed)


def paged_backend() -> Backend:
    """The "native" backend of ``prefix_shared_attention_paged`` (CPU tensors)."""
    return native_backend("prefix_shared_attention_paged", KERNEL, _fake, wrap=_paged)
