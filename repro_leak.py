"""A KeyboardInterrupt (Ctrl-C in a notebook / a service's signal) that lands in PrefixCache.add_hits,
PrefixCache.insert, PagedKVCache.free, BlockPool.decref/_check_id, PrefixHandle.__init__, ... pins prefix-cache pages
for ever: the pool ends up fully pinned and identical repeated requests are never hits again.
(Modelled deterministically: the interrupt is raised from inside prefix_cache.PrefixCache.add_hits, the call
prefill_cached makes after inserting the pages and before handing the cache to acquire_prefix.)"""
import os, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, "/work/main/tests"); sys.path.insert(0, "/work/main")
import torch
from _tiny import random_qwen3
from acarerank import PointwiseReranker
from acarerank.model import prefix_cache

m = random_qwen3(seed=1, spread_yes_no=6, hidden=32, intermediate=48, layers=1, heads=2, kv_heads=1, head_dim=16)
rr = PointwiseReranker(model=m, cache_budget_tokens=512)   # 32 pages
trace = "the agent looked at step and decided to go on. " * 8  # ~110-token shared part: 7 full pages
pool = lambda: rr._cache_slot._cache.pool

orig = prefix_cache.PrefixCache.add_hits
for i in range(5):
    def boom(self, tokens):
        raise KeyboardInterrupt
    prefix_cache.PrefixCache.add_hits = boom
    try:
        rr.score(f"query {i}", ["doc a", "doc b"], trace=trace)
    except KeyboardInterrupt:
        pass
    prefix_cache.PrefixCache.add_hits = orig
    p = pool()
    print(f"after interrupt {i}: pinned pages (refcount>1) {sum(c > 1 for c in p.refcount)}, "
          f"held by nobody {sum(c == 1 for c in p.refcount) - rr._prefix_cache.resident_tokens // 16 + sum(c > 1 for c in p.refcount)}, "
          f"free {p.num_free} of {p.num_blocks}")
before = rr.cache_stats()["hit_tokens"]
for _ in range(3):
    rr.score("same query", ["doc"], trace=trace + "x")
print("hit tokens of 3 identical calls after the interrupts:", rr.cache_stats()["hit_tokens"] - before,
      "(a fresh reranker:", end=" ")
f = PointwiseReranker(model=m, cache_budget_tokens=512)
for _ in range(3):
    f.score("same query", ["doc"], trace=trace + "x")
print(f.cache_stats()["hit_tokens"], ")")
