"""Groups' prefixes as block tables over a ``BlockPool`` (what the runner attends over).

A group's prefix of P_g tokens lives in ``block_tables[g]`` (ceil(P_g / block_size) block
ids, in order); token c is slot ``c % block_size`` of block ``block_tables[g][c // block_size]``.
The cache owns one pool reference per block in its tables and gives them back in ``free``.

Appending n tokens to a group writes only those n rows into its pages (``reserve`` +
``write``, or ``qk_norm_rope``'s page write into ``pages(layer)`` at the reserved slots),
whatever the prefix length: a decode step costs O(1) copies, not a re-pack of the whole cache.
A block the new rows land in that someone else also holds (the partly filled last block of a
shared prefix) is copied first (copy-on-write), so a shared block is never written.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..ops.paged_attention import PagedAttentionPlan, plan_prefix_shared_attention_paged
from .block_pool import BlockPool


class PagedKVCache:
    """Per-group block tables and lengths over a shared ``BlockPool``."""

    def __init__(self, pool: BlockPool, allocate: Optional[Callable[[int], list]] = None):
        self.pool = pool
        self.block_tables: list = []
        self.lengths: list = []
        self._allocate = allocate or pool.allocate

    @property
    def num_groups(self) -> int:
        return len(self.lengths)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def add_group(self, blocks: Sequence[int] = (), length: int = 0) -> int:
        """A new group whose prefix is the first ``length`` tokens of ``blocks`` (the cache takes
        its own reference to each); returns its index."""
        blocks = list(blocks)
        if length > len(blocks) * self.block_size or length < 0:
            raise ValueError(f"PagedKVCache: {length} tokens do not fit in {len(blocks)} blocks of {self.block_size}")
        self.pool.incref(blocks)
        self.block_tables.append(blocks)
        self.lengths.append(length)
        return len(self.lengths) - 1

    def free(self) -> None:
        """Give back every block reference (idempotent)."""
        with self.pool.lock:  # taking the tables and giving them back at once: two threads free them once
            tables, self.block_tables = self.block_tables, [[] for _ in self.block_tables]
            self.lengths = [0] * len(self.lengths)
            for t in tables:
                self.pool.decref(t)

    # -- the pass --------------------------------------------------------------------
    def plan(self, cu_seqlens: torch.Tensor, segment_group: torch.Tensor, num_heads: int, num_kv_heads: int,
             head_dim: int, dtype: torch.dtype, backend, num_tokens: int) -> PagedAttentionPlan:
        """The paged-attention plan of one packed forward (built once, used by every layer)."""
        dev = cu_seqlens.device
        width = max([len(t) for t in self.block_tables] + [1])
        # built on the host (named: a caller's torch.set_default_device / torch.device context
        # would place them, docs/api.md "Threads"), then copied to the pass's device once
        bt = torch.zeros(self.num_groups, width, dtype=torch.int32, device="cpu")
        for g, t in enumerate(self.block_tables):
            bt[g, :len(t)] = torch.tensor(t, dtype=torch.int32, device="cpu")
        return plan_prefix_shared_attention_paged(
            cu_seqlens, bt.to(dev), torch.tensor(self.lengths, dtype=torch.int32, device=dev), segment_group,
            num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=self.block_size,
            num_blocks=self.pool.num_blocks, dtype=dtype, backend=backend, validate=False, num_tokens=num_tokens)

    def reserve(self, groups: Sequence[int], counts: Sequence[int]) -> torch.Tensor:
        """Make room for ``counts[i]`` new tokens after group ``groups[i]``'s prefix; returns
        their flat slots (block·block_size + offset, int64 [Σ counts], in the given order)."""
        bs = self.block_size
        slots = []
        for g, n in zip(groups, counts):
            table, P = self.block_tables[g], self.lengths[g]
            # copy-on-write: every block of the table the new rows land in that someone else also
            # holds gets a private copy first — the partly filled last block of the prefix, and any
            # block past it the table already has (a group added with more blocks than its length
            # needs, or rows reserved and never committed): a shared block is never written
            for b in range(P // bs, min(-(-(P + n) // bs), len(table))) if n else ():
                if self.pool.refcount[table[b]] > 1:
                    fresh = self._allocate(1)[0]
                    self.pool.copy_block(table[b], fresh)
                    self.pool.decref([table[b]])
                    table[b] = fresh
            need = -(-(P + n) // bs) - len(table)
            if need > 0:
                table.extend(self._allocate(need))
            slots.extend(table[c // bs] * bs + c % bs for c in range(P, P + n))
        return torch.tensor(slots, dtype=torch.long, device="cpu")

    def pages(self, layer: int) -> tuple:
        """``(k_cache, v_cache)`` of ``layer``, ``[num_blocks, block_size, Hkv, d]``: what attention
        reads and where the new rows go (by ``write``, or by ``qk_norm_rope``'s page write)."""
        return self.pool.k[layer], self.pool.v[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new rows k, v [n, Hkv, d] of ``layer`` at ``slots`` (from ``reserve``)."""
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v.to(vc.dtype))

    def commit(self, groups: Sequence[int], counts: Sequence[int]) -> None:
        """The reserved rows are written: extend the groups' lengths."""
        for g, n in zip(groups, counts):
            self.lengths[g] += n
