"""Prefix cache across calls: a radix tree over token ids at block granularity.

SGLang's RadixAttention keeps a radix tree whose nodes own KV; vLLM chains hashes of full
blocks. Here every node is one *full* block of ``block_size`` token ids (its edge label)
under its parent, so a root-to-node path spells a cached prefix and the node's block holds
that stretch of K/V. One root per ``cache_salt``: nothing is shared across salts. A root
exists only while its tree holds a page: ``insert`` creates it with its first node and
``evict`` drops it with its last, so distinct salts leave no state behind once their pages
are gone (the number of roots never exceeds the number of cached pages).

    root(salt) ─[t0..t15]─ n1 ─[t16..t31]─ n2 ─ ...        (one block id per node)
                              └─[other 16 tokens]─ n3      (a sibling context / sub-query)

References (``BlockPool.refcount``): the tree holds one per node; every handle that matched
or computed a prefix holds one per block it uses. A node is *evictable* when it is a leaf
and the tree's is the only reference (nobody is reading it); ``evict`` drops the least
recently used evictable leaves first (LRU; a parent becomes a leaf, hence a candidate, once
its children are gone). Memory is the pool's, fixed at construction: it never exceeds the
budget whatever the traffic.

Statistics (monotonic counters): tokens looked up, tokens hit (served from the tree),
tokens evicted; the caller adds computed tokens. Thread-safe: every method holds the pool's lock.
"""
from __future__ import annotations

import hashlib
import heapq
import itertools
from typing import Hashable, Optional, Sequence

from .block_pool import BlockPool, PoolExhausted


#: a str salt longer than this is kept as its SHA-256 digest (``_root_key``)
SALT_KEY_CHARS = 64


def _root_key(salt: Optional[Hashable]) -> Optional[Hashable]:
    """The tree's key for ``salt``: the salt itself, or for a str over ``SALT_KEY_CHARS`` characters
    its SHA-256 digest. A root lives as long as its pages, so a salt kept as given held its string
    for that long: 1,024 distinct 5 MB salts (the Python API does not cap their length; the
    server caps them at ``--max-salt-chars``) held ~5 GB after the calls returned. Distinct salts
    stay apart (a digest collision is not a practical event)."""
    if isinstance(salt, str) and len(salt) > SALT_KEY_CHARS:
        return ("sha256", hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest())
    return salt


class _Node:
    __slots__ = ("key", "block", "parent", "children", "last_access")

    def __init__(self, key, block, parent):
        self.key = key
        self.block = block
        self.parent = parent
        self.children: dict = {}
        self.last_access = 0


class PrefixCache:
    """Block-granular radix tree of cached prefixes over a ``BlockPool``."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self._roots: dict = {}
        self._clock = itertools.count(1)
        self.lookup_tokens = 0
        self.hit_tokens = 0
        self.evicted_tokens = 0
        self._num_nodes = 0

    # -- queries ----------------------------------------------------------------------
    def _keys(self, tokens: Sequence[int]):
        bs = self.block_size
        return [tuple(tokens[i:i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]

    def match(self, salt: Optional[Hashable], tokens: Sequence[int], count_hits: bool = True) -> list:
        """Block ids of the longest cached prefix of ``tokens`` (full blocks only), pinned.

        Each returned block gets one reference the caller must give back (``pool.decref``).
        Counts ``len(tokens)`` looked up and the matched tokens as hits; ``count_hits=False``
        leaves the hits to ``add_hits``, for a caller that may still compute them itself (a
        prefill whose pool runs out): hit_tokens is monotonic, never taken back.
        """
        with self.pool.lock:
            now = next(self._clock)
            node = self._roots.get(_root_key(salt))
            blocks = []
            if node is not None:
                for key in self._keys(tokens):
                    node = node.children.get(key)
                    if node is None:
                        break
                    node.last_access = now
                    blocks.append(node.block)
            self.pool.incref(blocks)
            self.lookup_tokens += len(tokens)
            if count_hits:
                self.hit_tokens += len(blocks) * self.block_size
            return blocks

    def add_hits(self, tokens: int) -> None:
        """Count ``tokens`` served from the tree (matched with ``count_hits=False``, then used)."""
        with self.pool.lock:
            self.hit_tokens += tokens

    def insert(self, salt: Optional[Hashable], tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Record that ``blocks[i]`` holds the K/V of ``tokens``' i-th full block; returns nodes added.

        A new node takes one reference to the caller's block. Where the tree already holds another
        block under the same path (a batch-invariant match is cut down to ``prefix_align`` and the
        pages past the cut computed again; or two calls computed one prefix at once), the node
        adopts the caller's block when the tree held the only reference to its own: that copy is
        freed now. Kept, it sat above the caller's pinned pages, an interior node eviction never
        reaches while they are pinned, and ``available_blocks`` had counted it as free: a setwise
        decode ran out of pages and computed its 1,617-token prompt again. A block someone else
        still reads stays (the caller's copy stays the caller's). The two copies hold the same
        K/V: in batch-invariant mode to the bit (docs/ARCHITECTURE.md, "Prefix cache").
        """
        keys = self._keys(tokens)
        if len(blocks) < len(keys):
            keys = keys[:len(blocks)]
        if not keys:  # no full block: a root without pages would outlive every eviction
            return 0
        with self.pool.lock:
            now = next(self._clock)
            key = _root_key(salt)
            node = self._roots.get(key)
            if node is None:
                node = self._roots[key] = _Node(key, None, None)  # a root's key is its salt's
            added = 0
            for key, b in zip(keys, blocks):
                child = node.children.get(key)
                if child is None:
                    self.pool.incref([b])
                    child = node.children[key] = _Node(key, b, node)
                    added += 1
                elif child.block != b and self.pool.refcount[child.block] == 1:
                    self.pool.incref([b])
                    self.pool.decref([child.block])  # the tree's only reference: the duplicate is freed
                    child.block = b
                child.last_access = now
                node = child
            self._num_nodes += added
            return added

    # -- memory -------------------------------------------------------------------------
    def _evictable_leaves(self):
        stack = list(self._roots.values())
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n.block is not None and self.pool.refcount[n.block] == 1:
                yield n

    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks, least recently used unreferenced leaves first."""
        if num_blocks <= 0:
            return 0
        with self.pool.lock:
            heap = [(n.last_access, id(n), n) for n in self._evictable_leaves()]
            heapq.heapify(heap)
            freed = 0
            while heap and freed < num_blocks:
                _, _, n = heapq.heappop(heap)
                parent = n.parent
                del parent.children[n.key]
                self.pool.decref([n.block])
                self._num_nodes -= 1
                freed += 1
                if parent.children:
                    continue
                if parent.parent is None:  # the salt's last page went: drop its root too
                    del self._roots[parent.key]
                elif self.pool.refcount[parent.block] == 1:
                    heapq.heappush(heap, (parent.last_access, id(parent), parent))
            self.evicted_tokens += freed * self.block_size
            return freed

    def available_blocks(self) -> int:
        """Blocks ``allocate`` could hand out now: the free ones and every cached block that
        eviction would reach (a node the tree alone holds, under which nothing is pinned).
        O(nodes); a caller uses it to skip a prefill that cannot fit before computing any of it."""
        with self.pool.lock:
            reclaimable = 0
            # post-order over (node, children done?): a node is reclaimable when the tree holds its
            # only reference and every child is (a pinned page below keeps its ancestors)
            ok = {}
            stack = [(r, False) for r in self._roots.values()]
            while stack:
                n, seen = stack.pop()
                if not seen:
                    stack.append((n, True))
                    stack.extend((c, False) for c in n.children.values())
                    continue
                good = all(ok.pop(id(c)) for c in n.children.values())
                if n.block is not None:
                    good = good and self.pool.refcount[n.block] == 1
                    reclaimable += good
                ok[id(n)] = good
            return self.pool.num_free + reclaimable

    def allocate(self, n: int) -> list:
        """``n`` fresh blocks (reference count 1), evicting LRU leaves if the pool is short."""
        with self.pool.lock:
            short = n - self.pool.num_free
            if short > 0:
                self.evict(short)
            if n > self.pool.num_free:
                raise PoolExhausted(f"prefix cache: {n} blocks needed, {self.pool.num_free} free after evicting "
                                    f"every unpinned cached block (pool of {self.pool.num_blocks})")
            return self.pool.allocate(n)

    @property
    def num_trees(self) -> int:
        """Salts with at least one cached page (a root exists only while its tree holds one)."""
        return len(self._roots)

    @property
    def resident_tokens(self) -> int:
        """Tokens whose K/V the tree holds."""
        return self._num_nodes * self.block_size

    def paths(self) -> dict:
        """{(salt, (key, key, ...)): block} of every node (tests and debugging)."""
        out = {}
        with self.pool.lock:
            stack = [(salt, (), r) for salt, r in self._roots.items()]
            while stack:
                salt, path, n = stack.pop()
                for key, c in n.children.items():
                    out[(salt, path + (key,))] = c.block
                    stack.append((salt, path + (key,), c))
        return out
