"""``prefix_shared_attention_paged``: the shared-prefix primitive with the prefix in pages.

Same contract as ``prefix_shared_attention`` (docs/ARCHITECTURE.md, "The one primitive"), but
each group's prefix K/V live in fixed-size blocks of a page pool, vLLM's layout:

    k_cache, v_cache: [num_blocks, block_size, Hkv, d]    (block_size a power of two, 16..256)
    block_table:      [G, max_blocks] int32               (row g: group g's prefix blocks in order)
    prefix_lens:      [G] int32                           (P_g; token c of group g is in block
                                                           block_table[g, c // block_size], slot c % block_size)

    out[t] = softmax(scale · q[t] · [K_g; k[s_0..t]]ᵀ) · [V_g; v[s_0..t]],  K_g = pages of g in order

Plan once, run per layer (FlashInfer's plan/run): ``plan_prefix_shared_attention_paged``
validates the metadata and builds what the backend needs — the work list (Triton) or the
gather indices (torch) — once per packed forward; every layer then calls
``prefix_shared_attention_paged(..., plan=plan)`` and pays for no metadata work.

Backends (declared in ``OP``, chosen as for every op: docs/ARCHITECTURE.md, "Backend rules"):
  "native" the CPU default where acarerank._cpu is built (``cpu_attention``): one kernel call per
           layer for every group and segment, the prefix read from the pages through the block
           table, one fp32 online softmax over prefix then own keys (no merge)
  "torch"  the reference/fallback; on CPU (``cpu_paged_attention``): the prefix read from its pages in place when the
           group's blocks are one run of ids (else one gather of its rows), every query row
           of the group against it in one fused call, log-sum-exp merge with the causal own
           part; equal to the packed op within fp32 rounding (tested ≤ 1e-6). Elsewhere: the
           prefix rows gathered (one indexed read of the used pages) into the packed torch path
  "triton" one pass; the block id of every key column is read from the table inside the
           kernel, nothing is gathered; bitwise equal to the packed Triton kernel
  "flash_attn_cascade"  flash-attn's varlen prefix pass with its ``block_table`` (flash-attn
           2 needs page sizes that are multiples of 256) + own pass + lse merge; GPU only
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import _backend
from . import attention as _attention
from . import cpu_attention as _native_attn
from . import cpu_paged_attention as _cpu_paged
from ._checks import inference_only
from .attention import _check_inputs as _check_packed_inputs

MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 16, 256


@dataclass
class PagedAttentionPlan:
    """Per-batch metadata of a paged call, built once and reused by every layer.

    cu_seqlens [S+1], segment_group [S], block_table [G, max_blocks], cu_prefix_lens [G+1]:
    int32 on the device. num_q_heads, num_kv_heads, head_dim, dtype: the q and pages every layer
    passes (checked per call, as ``AttentionPlan``'s: the Triton work list is built for them).
    backend: the resolved backend name. aux: the backend's index
    tensors — torch: (block index, slot index) of every prefix row, packed group after group
    ([Ptot] int64 each), the metadata's host copy, and each group's first block when its
    blocks are one run ([G] int64 on the host, ``cpu_paged_attention.first_blocks``); triton: (work list [W, 2] int32,);
    flash_attn_cascade: (the metadata's host copy,).
    """
    cu_seqlens: torch.Tensor
    segment_group: torch.Tensor
    block_table: torch.Tensor
    prefix_lens: torch.Tensor
    cu_prefix_lens: torch.Tensor
    block_size: int
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    backend: str
    aux: tuple


def _int32_tensor(name, t, dim, device):
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim:
        got = f"{t.dtype} {t.dim()}-D" if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"prefix_shared_attention_paged: {name} must be a {dim}-D int32 tensor, got {got}")
    if t.device != device:
        raise ValueError(f"prefix_shared_attention_paged: {name} is on {t.device}, q is on {device}")


def check_block_size(block_size) -> int:
    """block_size must be a power of two in [16, 256] (the page sizes the kernels are tuned for)."""
    if (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < MIN_BLOCK_SIZE
            or block_size > MAX_BLOCK_SIZE or block_size & (block_size - 1)):
        raise ValueError(f"prefix_shared_attention_paged: block_size must be a power of two from {MIN_BLOCK_SIZE} "
                         f"to {MAX_BLOCK_SIZE}, got {block_size!r}")
    return block_size


def _check_cache(q, k, k_cache, v_cache):
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"prefix_shared_attention_paged: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"prefix_shared_attention_paged: {name} must be [num_blocks, block_size, Hkv, d], "
                             f"got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"prefix_shared_attention_paged: {name} dtype {t.dtype} differs from q dtype {q.dtype}")
        if t.device != q.device:
            raise ValueError(f"prefix_shared_attention_paged: {name} is on {t.device}, q is on {q.device}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"prefix_shared_attention_paged: k_cache {tuple(k_cache.shape)} and v_cache "
                         f"{tuple(v_cache.shape)} differ")
    if k_cache.shape[2:] != k.shape[1:]:
        raise ValueError(f"prefix_shared_attention_paged: cache pages hold [Hkv, d] = {tuple(k_cache.shape[2:])}, "
                         f"k rows are {tuple(k.shape[1:])}")
    check_block_size(k_cache.shape[1])


def _check_tables(block_table, prefix_lens, block_size, num_blocks, device, validate_values):
    _int32_tensor("block_table", block_table, 2, device)
    _int32_tensor("prefix_lens", prefix_lens, 1, device)
    G = block_table.shape[0]
    if prefix_lens.numel() != G:
        raise ValueError(f"prefix_shared_attention_paged: prefix_lens has {prefix_lens.numel()} entries for "
                         f"{G} block-table rows")
    if G == 0:
        return
    if not validate_values:
        # A block id out of range reads another page (a negative one wraps around in torch's
        # indexing) and gives a wrong answer with no error — the worst outcome — so a table on
        # the host is checked even here: O(blocks), no device sync. On a GPU validate=False
        # trusts the table (no sync, docs/input-safety.md); the package's own callers only pass
        # ids their BlockPool checked on the host when the pages were taken.
        if block_table.device.type == "cpu":
            _check_block_ids(block_table, prefix_lens.clamp(min=0), block_size, num_blocks, device)
        return
    pl = prefix_lens.tolist()
    cap = block_table.shape[1] * block_size
    for g, n in enumerate(pl):
        if n < 0:
            raise ValueError(f"prefix_shared_attention_paged: prefix_lens[{g}] = {n} is negative")
        if n > cap:
            raise ValueError(f"prefix_shared_attention_paged: prefix_lens[{g}] = {n} is longer than its "
                             f"{block_table.shape[1]} blocks of {block_size} tokens")
    _check_block_ids(block_table, prefix_lens, block_size, num_blocks, device)


def _check_block_ids(block_table, prefix_lens, block_size, num_blocks, device):
    """Every block id a group reads (its first ceil(P_g / block_size) entries) in [0, num_blocks)."""
    used = torch.arange(block_table.shape[1], device=device)[None, :] < \
        ((prefix_lens.long() + block_size - 1) // block_size)[:, None]
    ids = block_table[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        bad = ids[(ids < 0) | (ids >= num_blocks)][0].item()
        raise ValueError(f"prefix_shared_attention_paged: block id {bad} in block_table is out of range "
                         f"[0, {num_blocks})")


def plan_prefix_shared_attention_paged(cu_seqlens, block_table, prefix_lens, segment_group, *, num_heads: int,
                                       num_kv_heads: int, head_dim: int, block_size: int, num_blocks: int,
                                       dtype: torch.dtype, backend=None, validate: bool = True,
                                       num_tokens: Optional[int] = None) -> PagedAttentionPlan:
    """Check the metadata and build the backend's index tensors once per batch.

    Args: as ``prefix_shared_attention_paged``; num_heads/num_kv_heads/head_dim/dtype describe
    q and the pages (the Triton work list depends on the GQA ratio and the tile size);
    validate: read the metadata values on the host (one sync) and check them; when False, a
    block table on the CPU still has its used ids range-checked (O(blocks), no sync);
    num_tokens: T = cu_seqlens[-1] when the caller knows it (else read: one sync on CUDA).

    Host<->device syncs on CUDA (validate=False, num_tokens given): "triton" none; "torch" and
    "flash_attn_cascade" one (the metadata's host copy, ``attention._device_to_host``).
    """
    device = cu_seqlens.device
    check_block_size(block_size)
    _int32_tensor("cu_seqlens", cu_seqlens, 1, device)
    _int32_tensor("segment_group", segment_group, 1, device)
    _check_tables(block_table, prefix_lens, block_size, num_blocks, device, validate)
    if num_kv_heads <= 0 or num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"prefix_shared_attention_paged: query heads {num_heads} are not a multiple of kv heads "
                         f"{num_kv_heads}")
    name = _native_attn.resolve(OP, backend, device, int(head_dim))
    G = block_table.shape[0]
    cu_pre = torch.zeros(G + 1, dtype=torch.int32, device=device)
    if G:
        cu_pre[1:] = torch.cumsum(prefix_lens, 0)
    T = num_tokens if num_tokens is not None else (int(cu_seqlens[-1]) if cu_seqlens.numel() else 0)
    if validate:
        S = segment_group.numel()
        if cu_seqlens.numel() != S + 1:
            raise ValueError(f"prefix_shared_attention_paged: cu_seqlens has {cu_seqlens.numel()} entries for "
                             f"{S} segments")
        cs, sg = cu_seqlens.tolist(), segment_group.tolist()
        if cs[0] != 0 or cs[-1] != T or any(b < a for a, b in zip(cs, cs[1:])):
            raise ValueError(f"prefix_shared_attention_paged: cu_seqlens must start at 0, be non-decreasing and "
                             f"end at T={T}")
        if S and (min(sg) < 0 or max(sg) >= G):
            raise ValueError(f"prefix_shared_attention_paged: segment_group values must lie in [0, {G})")
    if name == "torch":
        host_meta = _attention._device_to_host(cu_seqlens, cu_pre, segment_group)
        ptot = int(host_meta[segment_group.numel() + 1 + G])  # cu_pre[-1], already on the host
        runs = (_cpu_paged.first_blocks(block_table, prefix_lens, block_size) if device.type == "cpu"
                else torch.empty(0, dtype=torch.int64))  # no second device->host copy off the CPU
        aux = (*_gather_index(block_table, prefix_lens, cu_pre, block_size, ptot), host_meta, runs)
    elif name == "triton":
        from acarerank.kernels.prefix_shared_attention import plan_work

        aux = (plan_work(cu_seqlens, cu_pre, segment_group, total_tokens=T, num_q_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device),)
    elif name == "native":
        aux = ()  # the kernel reads the (host) metadata itself: a few hundred integers per layer
    else:
        aux = (_attention._device_to_host(cu_seqlens, cu_pre, segment_group),)
    return PagedAttentionPlan(cu_seqlens, segment_group, block_table, prefix_lens, cu_pre, block_size, T,
                              int(num_heads), int(num_kv_heads), int(head_dim), dtype, name, aux)


def _gather_index(block_table, prefix_lens, cu_pre, block_size, Ptot: int):
    """(block, slot) int64 [Ptot] of every prefix row, group after group (device ops only)."""
    dev = block_table.device
    G = block_table.shape[0]
    g_of = torch.repeat_interleave(torch.arange(G, device=dev), prefix_lens.long(), output_size=Ptot)
    col = torch.arange(Ptot, device=dev) - cu_pre[:-1].long()[g_of]
    blk = block_table.long()[g_of, col // block_size]
    return blk, col % block_size


def _torch_backend(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, aux, scale):
    from .attention import _torch_backend as packed

    blk, slot, host_meta, runs = aux
    if _cpu_paged.available(q):  # CPU: the prefix read from its pages in place (cpu_paged_attention.py)
        return _cpu_paged.paged_attention_cpu(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens,
                                              segment_group, scale, runs=runs, blk=blk, slot=slot,
                                              host_meta=host_meta)
    # elsewhere: advanced indexing reads only the used pages, whatever the cache's strides
    return packed(q, k, v, cu_seqlens, k_cache[blk, slot], v_cache[blk, slot], cu_prefix_lens, segment_group, scale,
                  host_meta=host_meta)


def _triton_backend(kernel):
    """The op's calling convention over ``prefix_shared_attention_paged_triton`` (aux: the work list)."""
    def run(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, aux, scale):
        # the kernel steps one block id per int32 along a row: a column-strided table (a slice of a
        # wider one) is copied once, as the other backends take any strides ([G, blocks]: small)
        if block_table.dim() == 2 and block_table.shape[1] > 1 and block_table.stride(1) != 1:
            block_table = block_table.contiguous()
        return kernel(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, scale,
                      work=aux[0])
    return run


def _flash_backend(cascade):
    """The op's calling convention over ``prefix_shared_attention_paged_flash_cascade`` (aux: host metadata)."""
    def run(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, aux, scale):
        return cascade(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, scale,
                       host_meta=aux[0])
    return run


OP = _backend.OpDecl(
    "prefix_shared_attention_paged", aliases=("paged_attention",),
    backends={"torch": _backend.Backend(lambda: _torch_backend),
              "native": _native_attn.paged_backend(),
              "triton": _backend.lazy_backend("prefix_shared_attention_paged", "triton",
                                              "acarerank.kernels.prefix_shared_attention",
                                              "prefix_shared_attention_paged_triton", wrap=_triton_backend),
              # flash-attn is optional and GPU-only
              "flash_attn_cascade": _backend.lazy_backend("prefix_shared_attention_paged", "flash_attn_cascade",
                                                          "acarerank.ops.cascade",
                                                          "prefix_shared_attention_paged_flash_cascade", ("cuda",),
                                                          wrap=_flash_backend)},
    # as the packed op: the native CPU kernel where acarerank._cpu is built, else torch; the
    # one-pass Triton kernel on GPU
    defaults={"cpu": ("native", "torch"), "cuda": ("triton", "torch")},
)


@torch.library.custom_op("acarerank::prefix_shared_attention_paged", mutates_args=())
def prefix_shared_attention_paged_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                     k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                                     cu_prefix_lens: torch.Tensor, segment_group: torch.Tensor,
                                     aux: list[torch.Tensor], softmax_scale: float, backend: str,
                                     tiles_only: bool = False) -> torch.Tensor:
    """Registered form (opaque to torch.compile); ``aux`` = the plan's index tensors. The output is
    contiguous on every backend, as the fake says (``attention.prefix_shared_attention_op``)."""
    fn = OP.impl(backend)
    native = {"tiles_only": True} if tiles_only and backend == "native" else {}  # the others have no such switch
    return fn(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, tuple(aux),
              softmax_scale, **native).contiguous()


@prefix_shared_attention_paged_op.register_fake
def _(q, k, v, cu_seqlens, k_cache, v_cache, block_table, cu_prefix_lens, segment_group, aux, softmax_scale,
      backend, tiles_only=False):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def prefix_shared_attention_paged(q, k, v, cu_seqlens, k_cache, v_cache, block_table, prefix_lens, segment_group,
                                  softmax_scale: Optional[float] = None, backend: Optional[str] = None, *,
                                  plan: Optional[PagedAttentionPlan] = None, validate: bool = True,
                                  tiles_only: bool = False):
    """Causal attention of packed segments over their group's prefix, read from pages.

    Args:
      q: [T, Hq, d]; k, v: [T, Hkv, d] — the segments' own rows, packed, RoPE applied.
      cu_seqlens: [S+1] int32; segment_group: [S] int32 — as in ``prefix_shared_attention``.
      k_cache, v_cache: [num_blocks, block_size, Hkv, d], q's dtype and device, any strides.
      block_table: [G, max_blocks] int32 — group g's prefix blocks in order (entries past
        ceil(P_g / block_size) are never read).
      prefix_lens: [G] int32 — P_g (may be 0; may end mid-block).
      softmax_scale: default 1/sqrt(d). backend: None = environment / device default.
      plan: from ``plan_prefix_shared_attention_paged`` for this batch's metadata (built here
        when None); ``backend`` must then be None (the plan's backend runs), and cu_seqlens,
        block_table, prefix_lens, segment_group must be the tensors the plan was built from.
      validate: check shapes/dtypes (always cheap) and, without a plan, the metadata values.
        Block ids are range-checked without a plan even when False if the table is on the CPU
        (no sync; an id out of range would read another page); on a GPU, False trusts them.
      tiles_only: "native" only: no group on the kernel's direct path, as
        ``prefix_shared_attention``'s (the runner's batch-invariant mode); the others ignore it.

    Returns: out [T, Hq, d], contiguous, in q's dtype; softmax accumulated in fp32.
    """
    T, Hq, d = q.shape if isinstance(q, torch.Tensor) and q.dim() == 3 else (0, 0, 0)
    if validate:
        G = block_table.shape[0] if isinstance(block_table, torch.Tensor) and block_table.dim() == 2 else 0
        empty = q.new_empty(0, *k.shape[1:]) if isinstance(k, torch.Tensor) and k.dim() == 3 else k
        _check_packed_inputs(q, k, v, cu_seqlens, empty, empty, torch.zeros(G + 1, dtype=torch.int32, device=q.device),
                             segment_group, plan is None)
        _check_cache(q, k, k_cache, v_cache)
    if plan is not None:
        if backend is not None:
            raise ValueError("prefix_shared_attention_paged: pass backend= to plan_prefix_shared_attention_paged, "
                             "not with plan=")
        # the plan's tables are what run (and what its index tensors were built from): other
        # tables passed beside it were silently ignored, so they must be the plan's own
        if (cu_seqlens is not plan.cu_seqlens or block_table is not plan.block_table
                or prefix_lens is not plan.prefix_lens or segment_group is not plan.segment_group):
            raise ValueError("prefix_shared_attention_paged: cu_seqlens/block_table/prefix_lens/segment_group differ "
                             "from the plan's; build a new plan (or pass the plan's own tensors)")
        want = (plan.num_tokens, plan.num_q_heads, plan.head_dim, plan.num_kv_heads, plan.dtype)
        got = (q.shape[0], Hq, d, k.shape[1] if k.dim() == 3 else -1, q.dtype)
        if got != want:
            raise ValueError(f"prefix_shared_attention_paged: q/k (T, Hq, d, Hkv, dtype) = {got} but the plan was "
                             f"built for {want}")
        if k_cache.shape[1] != plan.block_size:
            raise ValueError(f"prefix_shared_attention_paged: pages of {k_cache.shape[1]} tokens but the plan was "
                             f"built for {plan.block_size}")
    else:
        plan = plan_prefix_shared_attention_paged(
            cu_seqlens, block_table, prefix_lens, segment_group, num_heads=Hq, num_kv_heads=k.shape[1], head_dim=d,
            block_size=k_cache.shape[1], num_blocks=k_cache.shape[0], dtype=q.dtype, backend=backend,
            validate=validate, num_tokens=T)
    # as the packed op: a scale <= 0 or NaN gave NaN rows on the torch backend, with no error
    scale = _attention.check_softmax_scale(softmax_scale, d, "prefix_shared_attention_paged")
    return inference_only("prefix_shared_attention_paged", "prefix_shared_attention_paged_ref",
                          (q, k, v, k_cache, v_cache),
                          lambda: prefix_shared_attention_paged_op(q, k, v, plan.cu_seqlens, k_cache, v_cache,
                                                                   plan.block_table, plan.cu_prefix_lens,
                                                                   plan.segment_group, list(plan.aux), float(scale),
                                                                   plan.backend, bool(tiles_only)))


def prefix_shared_attention_paged_ref(q, k, v, cu_seqlens, k_cache, v_cache, block_table, prefix_lens, segment_group,
                                      softmax_scale=None):
    """Oracle: gather each group's prefix from its pages in plain Python, then the packed oracle."""
    from .attention import prefix_shared_attention_ref

    bs = k_cache.shape[1]
    pks, pvs, cu = [], [], [0]
    for g, n in enumerate(prefix_lens.tolist()):
        for c in range(n):
            b = int(block_table[g, c // bs])
            pks.append(k_cache[b, c % bs])
            pvs.append(v_cache[b, c % bs])
        cu.append(cu[-1] + n)
    empty = k_cache.new_empty(0, *k_cache.shape[2:])
    pk = torch.stack(pks) if pks else empty
    pv = torch.stack(pvs) if pvs else empty
    return prefix_shared_attention_ref(q, k, v, cu_seqlens, pk, pv, torch.tensor(cu, dtype=torch.int32,
                                                                                   device=q.device),
                                       segment_group, softmax_scale)
