"""Prefill through the prefix cache: what a reranker owns to reuse shared parts across calls.

``CacheSlot`` holds one ``PrefixCache`` (its pool allocated on first use, sized by a token
budget) and the counters a server exports; ``prefill_cached`` computes prompts starting
from their longest cached prefixes (docs/ARCHITECTURE.md, "Paged KV and the prefix cache").
"""
from __future__ import annotations

import contextlib
import numbers
import os
import threading
from typing import Hashable, Optional, Sequence

import torch

from .._validate import is_bool
from .block_pool import PoolExhausted
from .paged_cache import PagedKVCache
from .prefix_cache import PrefixCache

#: bytes of KV pages a cache may hold by device type when the caller gives no budget
#: (Qwen3-Reranker-0.6B in fp32 keeps 224 KiB per token: 1 GiB ≈ 4,680 tokens) ...
DEFAULT_CACHE_BYTES = {"cpu": 1 << 30, "cuda": 8 << 30}
#: ... and never more than this many tokens (a small model's 1 GiB would be a million tokens)
DEFAULT_CACHE_MAX_TOKENS = 65536


def kv_bytes_per_token(runner) -> int:
    """Bytes of KV pages one cached token takes: K and V, every layer, ``num_kv_heads × head_dim``."""
    a = runner.arch
    return 2 * a.num_layers * a.num_kv_heads * a.head_dim * runner.dtype.itemsize


def default_budget_tokens(runner) -> int:
    return min(DEFAULT_CACHE_MAX_TOKENS,
               DEFAULT_CACHE_BYTES.get(runner.device.type, DEFAULT_CACHE_BYTES["cpu"]) // kv_bytes_per_token(runner))


def device_memory_bytes(device: torch.device) -> Optional[int]:
    """The memory of ``device``: a GPU's total, or the host's physical memory; None where unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX host: no check
        return None


class CacheSlot:
    """A reranker's prefix cache (or its absence) and its statistics.

    enabled=False: every prefix is computed in full; the counters still count lookups and
    computed tokens so a server's metrics read the same either way.
    """

    def __init__(self, runner, enabled: bool = True, budget_tokens: Optional[int] = None):
        # numpy integers are ints, bools are not (acarerank._validate's one integer rule)
        if budget_tokens is not None and (isinstance(budget_tokens, bool)
                                          or not isinstance(budget_tokens, numbers.Integral) or budget_tokens < 0):
            raise ValueError(f"cache_budget_tokens must be a non-negative int or None, got {budget_tokens!r}")
        budget_tokens = None if budget_tokens is None else int(budget_tokens)
        if not is_bool(enabled):  # as batch_invariant / compile_layers: "false" is truthy, the cache stayed on
            raise TypeError(f"prefix_cache must be a bool, got {type(enabled).__name__} {enabled!r}")
        self.runner = runner
        self.enabled = bool(enabled)
        page = runner.block_size
        if budget_tokens is not None and self.enabled and budget_tokens < page:
            # the pool is whole pages: under one it holds nothing, and the running requests' pinned
            # shared parts are bounded by it (max_pinned_tokens: at least 1), so every request ran
            # alone, the next one waiting for the last to end (docs/serving.md, "Engine")
            raise ValueError(f"cache_budget_tokens={budget_tokens:,} (serve --cache-budget) is under one page of "
                             f"the prefix cache ({page} tokens): the cache would hold nothing and requests would run "
                             f"one at a time; give at least {page} (no cache: prefix_cache=False in the Python API; "
                             f"acarerank serve always keeps one)")
        if budget_tokens is not None and self.enabled:
            # the pool is allocated whole on first use: a budget past the device's memory failed
            # there, inside the first request's prefill (10**23 tokens: torch's 'Overflow when
            # unpacking long'), after a server had started
            per_token, total = kv_bytes_per_token(runner), device_memory_bytes(runner.device)
            if total is not None and budget_tokens * per_token > total:
                raise ValueError(f"cache_budget_tokens={budget_tokens:,} (serve --cache-budget) is "
                                 f"{budget_tokens * per_token / 2 ** 30:.4g} GiB of KV pages for this model "
                                 f"({per_token:,} bytes a token), more than the {total / 2 ** 30:.4g} GiB of "
                                 f"{runner.device.type} memory")
        budget = default_budget_tokens(runner) if budget_tokens is None else budget_tokens
        self.budget_blocks = budget // runner.block_size if self.enabled else 0
        self._cache: Optional[PrefixCache] = None
        self._lock = threading.Lock()
        self.computed_tokens = 0
        self.uncached_lookup_tokens = 0

    def get(self) -> Optional[PrefixCache]:
        """The prefix cache, its pages allocated now if this is the first use; None when off.

        Thread-safe: two first calls at once get the same cache (a second pool would take the
        budget twice over and split the pages, and the counters, between two caches)."""
        if self._cache is None and self.budget_blocks > 0:
            with self._lock:
                if self._cache is None:
                    self._cache = PrefixCache(self.runner.new_pool(self.budget_blocks))
        return self._cache

    def count(self, computed: int = 0, uncached_lookup: int = 0) -> None:
        with self._lock:
            self.computed_tokens += computed
            self.uncached_lookup_tokens += uncached_lookup

    def stats(self) -> dict:
        """lookup / hit / computed / evicted tokens (monotonic), resident / budget tokens (gauges).

        One snapshot: read under the pool's lock and the slot's, so a call on another thread is
        wholly before or after each counter's read — read one by one, a call that ran between the
        read of lookup_tokens and the others' gave hit + computed > lookup (a hit rate over 1 on a
        /metrics scrape), and a scrape that found no cache yet read the slot's counters after the
        first call had made it and counted its computed tokens (lookup 0). A call in flight has its
        lookups counted before its hits and computed tokens, so hit + computed <= lookup in every
        snapshot of pointwise calls."""
        while True:
            pc = self._cache
            # the pool's lock first, then the slot's: no method takes them in the other order
            with pc.pool.lock if pc is not None else contextlib.nullcontext(), self._lock:
                if self._cache is not pc:  # the first call made the cache meanwhile (once: it is never unset)
                    continue
                return {
                    "lookup_tokens": self.uncached_lookup_tokens + (pc.lookup_tokens if pc else 0),
                    "hit_tokens": pc.hit_tokens if pc else 0,
                    "computed_tokens": self.computed_tokens,
                    "evicted_tokens": pc.evicted_tokens if pc else 0,
                    "resident_tokens": pc.resident_tokens if pc else 0,
                    "budget_tokens": self.budget_blocks * self.runner.block_size,
                }


def _aligned_match(runner, pc: PrefixCache, salt, ids: Sequence[int]) -> list:
    """``pc.match`` (pinned blocks of the longest cached prefix, hits not counted) cut down to a
    multiple of ``runner.prefix_align`` tokens (batch-invariant mode; whole pages, so a cut of
    whole blocks): the pages past it are given back and computed again, in the same tiles as a
    prefill of the whole prefix, hence to the same bits (``Qwen3Runner.prefix_align``)."""
    matched = pc.match(salt, ids, count_hits=False)
    unit = max(1, runner.prefix_align // pc.block_size)  # align 1: all
    keep = len(matched) - len(matched) % unit
    if keep < len(matched):
        pc.pool.decref(matched[keep:])
        del matched[keep:]
    return matched


def _fits(pc: PrefixCache, lengths: Sequence[int], hits: Sequence[int], reserve_tokens: int) -> bool:
    """Whether the pages the prefixes still need (past their hits, with ``reserve_tokens`` − 1
    rows of each group's decode: a private pool's one spare row is not asked of the cache) could
    be allocated from ``pc`` now, evicting whatever eviction reaches. A prefill that cannot fit
    is computed privately from the start: tried in the cache, it ran chunk after chunk until the
    pool ran out and then computed every one of them again (docs/ARCHITECTURE.md, "Prefix cache")."""
    bs = pc.block_size
    need = sum(-(-(n + reserve_tokens - 1) // bs) - h // bs for n, h in zip(lengths, hits))
    # the free blocks first: available_blocks walks the whole tree (O(nodes), under the pool's
    # lock), and every cached prefill asks; a snapshot either way (PoolExhausted stays the net)
    return need <= pc.pool.num_free or need <= pc.available_blocks()


def prefill_cached(runner, slot: CacheSlot, prefixes: Sequence[Sequence[int]],
                   salt: Optional[Hashable] = None, chunk_tokens: Optional[int] = None,
                   reserve_tokens: int = 1) -> tuple:
    """Prefill ``prefixes`` (one group each), reusing the longest cached prefix of each.

    Returns ``(cache, hits)``: a ``PagedKVCache`` holding every group (the caller frees it;
    its pages stay pinned until then) and the tokens of each prefix served from the cache.
    Full pages computed here enter the cache. Without a usable cache (off, or no room even
    after evicting every unpinned page) the prefixes are computed in full in a private pool.
    All groups' new tokens go through ``runner.extend``: chunks of ``chunk_tokens`` per group
    (default ``runner.prefill_chunk``), packed into passes of at most that many rows. Prefixes
    whose pages (and ``reserve_tokens`` − 1 rows each) cannot fit the cache's pool even after
    evicting every unpinned page go to the private pool at once, before any pass (``_fits``). A private pool has room for ``reserve_tokens`` more
    tokens per group (a decode loop's) before it grows (``Qwen3Runner.prefill``).

    Page ownership: on any exception (an out-of-memory error at some layer, a kernel error,
    ``KeyboardInterrupt``) every page reference taken here is given back before it propagates,
    so the pool is exactly as it was (docs/ARCHITECTURE.md, "Paged KV and the prefix cache").
    """
    prefixes = [list(p) for p in prefixes]
    pc = slot.get()
    if pc is not None:
        cache = PagedKVCache(pc.pool, allocate=pc.allocate)
        hits = []
        try:
            for ids in prefixes:
                # hits are counted once they are served: on PoolExhausted below they are computed
                # again, and a counter a scraper read mid-prefill must not go back down
                matched = _aligned_match(runner, pc, salt, ids)
                try:
                    cache.add_group(matched, len(matched) * pc.block_size)
                finally:
                    pc.pool.decref(matched)  # the cache's own reference replaces the match's
                hits.append(len(matched) * pc.block_size)
            if not _fits(pc, list(map(len, prefixes)), hits, reserve_tokens):
                raise PoolExhausted("the prefixes cannot fit the prefix cache's pool")  # private, below
            runner.extend(cache, list(range(len(prefixes))), [ids[h:] for ids, h in zip(prefixes, hits)],
                          chunk_tokens)
        except PoolExhausted:
            cache.free()  # recomputed below: no hits
        except BaseException:
            cache.free()  # matched pages and the pages reserved for new rows: nothing stays pinned
            raise
        else:
            try:   # until the caller holds the cache, an interrupt here (a signal) frees it too
                for g, ids in enumerate(prefixes):
                    pc.insert(salt, ids, cache.block_tables[g])
                pc.add_hits(sum(hits))
                slot.count(computed=sum(len(ids) - h for ids, h in zip(prefixes, hits)))
            except BaseException:
                cache.free()   # the tree keeps its own references to what it took
                raise
            return cache, hits
    else:
        slot.count(uncached_lookup=sum(map(len, prefixes)))
    cache = runner.prefill(prefixes, chunk_tokens, reserve_tokens)  # a private, growable pool
    slot.count(computed=sum(map(len, prefixes)))
    return cache, [0] * len(prefixes)


class ChunkedPrefill:
    """``prefill_cached`` of one prefix, a chunk at a time (a scheduler's pass budget decides how much).

    Construction matches the longest cached prefix (its pages pinned in ``cache``, group 0);
    ``step(n)`` computes the next ``n`` tokens at most; once ``done``, the full pages enter
    the cache, exactly as ``prefill_cached`` leaves them. With no usable cache (off, or its pool
    exhausted by pinned pages mid-way) the prefix is computed from its start in a private pool.
    One ``step(len(prefix))`` runs the very passes ``prefill_cached`` runs. The caller frees ``cache``
    — also after a ``step`` that raised: its pages (pinned and reserved) are all in ``cache``, and
    a later ``step`` may retry (rows reserved and not committed are simply written again).
    ``reserve_tokens`` as in ``prefill_cached``. ``private``: skip the cache and compute the whole
    prefix in a private pool — the redo of a prefix already looked up (a selection whose decode ran
    out of the cache's pages), counted on ``slot`` as another lookup served by no cache, as
    ``prefill_cached`` counts a prefix with the cache off: counted as computed alone, it gave
    hit + computed over lookup (1,617 tokens past, docs/ARCHITECTURE.md "Prefix cache").
    """

    def __init__(self, runner, slot: CacheSlot, prefix: Sequence[int], salt: Optional[Hashable] = None,
                 reserve_tokens: int = 1, private: bool = False):
        self.runner, self.slot, self.salt = runner, slot, salt
        self.reserve_tokens = reserve_tokens
        self.prefix = [int(t) for t in prefix]
        self.pc = None if private else slot.get()
        self.hit = 0
        if self.pc is not None:
            self.cache = PagedKVCache(self.pc.pool, allocate=self.pc.allocate)
            matched = _aligned_match(runner, self.pc, salt, self.prefix)  # hits counted when done (_complete)
            try:
                self.cache.add_group(matched, len(matched) * self.pc.block_size)
            finally:
                self.pc.pool.decref(matched)  # the cache's own reference replaces the match's
            self.hit = len(matched) * self.pc.block_size
            if not _fits(self.pc, [len(self.prefix)], [self.hit], reserve_tokens):
                self.cache.free()  # computed privately from the start, as a step would after PoolExhausted
                self._private()
        else:
            slot.count(uncached_lookup=len(self.prefix))
            self._private()
        self.pos = self.hit
        self._completed = False
        if self.done:  # all of it cached: nothing left to compute
            self._complete()

    def _private(self) -> None:
        """A private pool for the whole prefix, from its start; changes nothing if the pool cannot be had."""
        bs = self.runner.block_size
        self.cache = PagedKVCache(self.runner.new_pool(-(-(len(self.prefix) + self.reserve_tokens) // bs),
                                                       growable=True))
        self.cache.add_group()
        self.pc, self.hit, self.pos = None, 0, 0

    @property
    def done(self) -> bool:
        return self.pos >= len(self.prefix)

    def step(self, max_tokens: int) -> int:
        """Compute up to ``max_tokens`` (>= 1) more prefix tokens; returns how many were computed.
        In batch-invariant mode a step that does not finish the prefix computes a multiple of
        ``runner.prefix_align`` tokens: at least that many, whatever ``max_tokens`` says."""
        # resume where the committed rows end: a step that raised may have committed some of its
        # passes (extend commits each), and pos, moved only on success, then lay behind them, so a
        # retry appended those tokens again and the tree filed their repeat under the next ones'
        # ids (a later hit read another position's K/V with no error)
        self.pos = self.cache.lengths[0]
        if self.done:   # a step that raised after its last pass committed: its end not yet done
            if not self._completed:
                self._complete()
            return 0
        rest = len(self.prefix) - self.pos
        n = min(max(1, max_tokens), rest)
        align = self.runner.prefix_align  # batch-invariant mode: passes start at its multiples
        if n < rest:
            n = min(max(align, n - n % align), rest)
        try:
            self.runner.extend(self.cache, [0], [self.prefix[self.pos:self.pos + n]])
        except PoolExhausted:
            if self.pc is None:
                raise
            # the private pool first: if it cannot be had (out of memory) the step raises with the
            # cache's pages and position as they were, and a retried step resumes from them (freed
            # first, the retry computed the next tokens at position 0 over nothing and put those
            # pages in the tree under the prefix's tokens)
            cache = self.cache
            self._private()
            cache.free()  # recomputed privately: no hits (none were counted yet)
            return self.step(max_tokens)
        self.pos = self.cache.lengths[0]
        if self.done:
            self._complete()
        return n

    def _complete(self) -> None:
        """The prefix is in ``cache``: its full pages enter the cache; its hits and computed tokens count."""
        self._completed = True
        if self.pc is not None:
            self.pc.insert(self.salt, self.prefix, self.cache.block_tables[0])
            self.pc.add_hits(self.hit)
            self.slot.count(computed=len(self.prefix) - self.hit)
        else:
            self.slot.count(computed=len(self.prefix))
