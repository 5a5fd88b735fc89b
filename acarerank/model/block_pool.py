"""KV pages and their reference counts: the storage every paged cache draws from.

Per layer ``k[i]``, ``v[i]``: ``[num_blocks, block_size, Hkv, d]`` (vLLM's layout; the paged
attention op reads them through a block table). A block is free when nobody holds it; each
holder (a running sequence, a handle, the prefix tree) owns one reference and gives it back
with ``decref``. The block is reused only when the count drops to zero, so a block that
someone still reads is never handed out again.

A fixed pool (``growable=False``) never allocates after construction: its size is the memory
budget. A growable pool (a runner's private scratch for one call) doubles its pages when it
runs out, copying them once (amortised O(1) per appended token, block ids stay valid).

Thread safety: every method takes ``lock`` (re-entrant), which the prefix cache shares.
"""
from __future__ import annotations

import numbers
import threading
from typing import Iterable

import torch


class PoolExhausted(RuntimeError):
    """A fixed pool has fewer free blocks than asked for (after any eviction)."""


class BlockPool:
    """Fixed-size KV pages for every layer plus a free list and per-block reference counts."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, growable: bool = False):
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"BlockPool: num_blocks must be >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
        self.block_size = block_size
        self.growable = growable
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # empty, not zeros: a slot is read only after it was written (block tables cover written
        # rows only), and untouched pages of a large budget then cost no physical memory on CPU
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.refcount = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self.lock = threading.RLock()

    @property
    def num_blocks(self) -> int:
        return len(self.refcount)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def bytes(self) -> int:
        """Memory of all pages (K and V, every layer)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def allocate(self, n: int) -> list:
        """``n`` free block ids, each with reference count 1 (owned by the caller)."""
        with self.lock:
            if n > len(self._free):
                if not self.growable:
                    raise PoolExhausted(f"BlockPool: {n} blocks asked, {len(self._free)} free of {self.num_blocks}")
                self._grow(max(n - len(self._free), self.num_blocks))
            ids = [self._free.pop() for _ in range(n)]
            for b in ids:
                self.refcount[b] = 1
            return ids

    def _check_id(self, b) -> None:
        # refcount[-1] is the last block: a negative id would pin (and a block table then read)
        # another request's page without a word
        if isinstance(b, bool) or not isinstance(b, numbers.Integral) or not 0 <= b < len(self.refcount):
            raise ValueError(f"BlockPool: block id {b!r} is not a block of this pool (ids are ints in "
                             f"[0, {len(self.refcount)}))")

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference to each id (each a held block of this pool: ValueError if out of
        range, so every block table built over the pool only holds ids its pages have)."""
        with self.lock:
            ids = list(ids)
            for b in ids:
                self._check_id(b)
            for b in ids:
                if self.refcount[b] <= 0:
                    raise RuntimeError(f"BlockPool: incref of free block {b}")
                self.refcount[b] += 1

    def decref(self, ids: Iterable[int]) -> None:
        """Give back one reference per id; a block whose count reaches 0 is free again."""
        with self.lock:
            ids = list(ids)
            for b in ids:
                self._check_id(b)
            freed = []
            for b in ids:
                if self.refcount[b] <= 0:
                    raise RuntimeError(f"BlockPool: decref of free block {b} (double release)")
                self.refcount[b] -= 1
                if self.refcount[b] == 0:
                    freed.append(b)
            # allocate() pops from the end: a block table given back whole comes out again in its
            # own order, so a run of consecutive ids stays one run (paged attention reads a run
            # of pages in place on CPU, and gathers scattered ones)
            self._free.extend(reversed(freed))

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one page of every layer (copy-on-write of a shared, partly filled block)."""
        for t in self.k + self.v:
            t[dst].copy_(t[src])

    def _grow(self, extra: int) -> None:
        old = self.num_blocks
        extra = max(extra, 1)
        self.k = [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for t in self.k]
        self.v = [torch.cat([t, t.new_zeros(extra, *t.shape[1:])]) for t in self.v]
        self.refcount.extend([0] * extra)
        self._free = list(range(old + extra - 1, old - 1, -1)) + self._free
