"""Prefix cache across calls: radix tree vs a brute-force model, thread safety, and scores
that never depend on what was cached (agent sessions, sub-queries, eviction, salts)."""
import dataclasses
import random
import threading

import pytest
import torch
from _hypothesis import given, HealthCheck, settings, st  # hypothesis, or skips where absent

from acarerank import PointwiseReranker, ScoreRequest
from acarerank.model import BlockPool, PoolExhausted, PrefixCache

from test_pointwise import random_reranker_model


# -- the tree against a brute-force model -------------------------------------------------
class BruteForce:
    """The cache as a flat dict {(salt, path of block keys): (block, last access)} with the
    policy written out naively: match = longest stored path; evict = among stored paths with
    no stored extension and no pin, the least recently touched; memory = a free count."""

    def __init__(self, num_blocks, bs):
        self.bs, self.entries, self.pins, self.free, self.clock = bs, {}, {}, num_blocks, 0

    def keys(self, tokens):
        return [tuple(tokens[i:i + self.bs]) for i in range(0, len(tokens) - self.bs + 1, self.bs)]

    def match(self, salt, tokens):
        self.clock += 1
        out, path = [], ()
        for key in self.keys(tokens):
            path += (key,)
            if (salt, path) not in self.entries:
                break
            b, _ = self.entries[(salt, path)]
            self.entries[(salt, path)] = (b, self.clock)
            out.append(path)
        return out

    def evict(self, n):
        for _ in range(n):
            leaves = [(t, p) for p, (b, t) in self.entries.items()
                      if self.pins.get(p, 0) == 0 and not any(q[0] == p[0] and q[1][:-1] == p[1] for q in self.entries)]
            if not leaves:
                return
            _, p = min(leaves)
            del self.entries[p]
            self.free += 1


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.one_of(
    st.tuples(st.just("acquire"), st.sampled_from([None, "a"]), st.lists(st.integers(0, 1), max_size=9)),
    st.tuples(st.just("release"), st.integers(0, 7), st.just(None))), max_size=30))
def test_radix_tree_matches_brute_force(ops):
    bs, nblocks = 2, 6
    pool = BlockPool(1, nblocks, bs, 1, 1, torch.float32, "cpu")
    tree, model = PrefixCache(pool), BruteForce(nblocks, bs)
    held = []  # (blocks we own a reference to, model paths we pin, model-private blocks)
    for op, a, b in ops:
        if op == "release":
            if held:
                blocks, paths, private = held.pop(a % len(held))
                pool.decref(blocks)
                for p in paths:
                    model.pins[p] -= 1
                model.free += private
        else:
            salt, tokens = a, b
            matched = tree.match(salt, tokens)
            mpaths = model.match(salt, tokens)
            assert len(matched) == len(mpaths), (tokens, matched, mpaths)
            assert [pool.k[0][blk].sum() for blk in matched] == [float(hash((salt,) + p) % 997) for p in mpaths]
            for p in mpaths:
                model.pins[(salt, p)] = model.pins.get((salt, p), 0) + 1
            need = len(model.keys(tokens)) - len(matched)
            if need > model.free:
                model.evict(need - model.free)
            try:
                new = tree.allocate(need)
            except PoolExhausted:
                assert need > model.free, "tree refused an allocation the model could serve"
                pool.decref(matched)
                for p in mpaths:
                    model.pins[(salt, p)] -= 1
                continue
            assert need <= model.free, "tree allocated past the model's free blocks"
            model.free -= need
            keys = model.keys(tokens)
            paths = [tuple(keys[:i + 1]) for i in range(len(keys))]
            for blk, p in zip(new, paths[len(matched):]):
                pool.k[0][blk].fill_(float(hash((salt,) + p) % 997) / bs)  # content = f(path)
            tree.insert(salt, tokens, matched + new)
            model.clock += 1
            for p in paths:
                owner = model.entries.get((salt, p), (None,))[0]
                model.entries[(salt, p)] = (owner if owner is not None else "x", model.clock)
                model.pins[(salt, p)] = model.pins.get((salt, p), 0) + (p not in mpaths)
            held.append((matched + new, [(salt, p) for p in paths], 0))
        # same cached paths, same free count, every pinned block still allocated
        assert set(tree.paths()) == set(model.entries), (set(tree.paths()) ^ set(model.entries))
        assert tree.num_trees == len({salt for salt, _ in model.entries}), "a salt without pages kept its tree"
        assert pool.num_free == model.free
        assert all(pool.refcount[x] > 0 for blocks, _, _ in held for x in blocks)


def test_concurrent_use_never_frees_a_block_in_use():
    """Threads match, allocate (evicting), write a path-derived value into their pages, insert,
    re-check their pages and release: a page in use is never handed to anyone else."""
    bs, pool = 2, BlockPool(1, 24, 2, 1, 1, torch.float32, "cpu")
    tree, errors = PrefixCache(pool), []

    def worker(seed):
        rnd = random.Random(seed)
        for _ in range(300):
            tokens = [rnd.randint(0, 2) for _ in range(rnd.randint(0, 10))]
            matched = tree.match(None, tokens)
            need = len(tokens) // bs - len(matched)
            try:
                new = tree.allocate(need)
            except PoolExhausted:
                pool.decref(matched)
                continue
            blocks = matched + new
            for i, blk in enumerate(new, start=len(matched)):
                pool.k[0][blk].fill_(float(hash(tuple(tokens[:(i + 1) * bs])) % 991))
            tree.insert(None, tokens, blocks)
            for i, blk in enumerate(blocks):
                if pool.k[0][blk][0, 0, 0].item() != float(hash(tuple(tokens[:(i + 1) * bs])) % 991):
                    errors.append((tokens, i, blk))
            pool.decref(blocks)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, f"pages changed while in use: {errors[:3]}"
    assert all(pool.refcount[b] == 1 for b in tree.paths().values()), "only the tree may hold pages at rest"


def test_distinct_salts_leave_no_trees_behind():
    """10,000 distinct salts (a hostile client's): a salt's tree goes with its last page, one
    that never cached a full block never gets one, so the trees never outnumber the pages and
    return to one when a single salt takes the whole pool."""
    bs, nblocks = 4, 32
    pool = BlockPool(1, nblocks, bs, 1, 1, torch.float32, "cpu")
    tree, rnd = PrefixCache(pool), random.Random(0)
    for i in range(10_000):
        salt = f"tenant-{i}-" + "x" * rnd.randint(0, 64)
        tokens = [rnd.randint(0, 9) for _ in range(rnd.randint(0, 3 * bs))]  # 0..3 full blocks
        matched = tree.match(salt, tokens)
        new = tree.allocate(len(tokens) // bs - len(matched))
        tree.insert(salt, tokens, matched + new)
        pool.decref(matched + new)  # the request is done: release
        assert tree.num_trees <= tree.resident_tokens // bs <= nblocks, (i, tree.num_trees)
    assert tree.num_trees > 1
    tokens = list(range(nblocks * bs))
    tree.insert(None, tokens, tree.allocate(nblocks))  # evicts every other salt's pages
    assert tree.num_trees == 1 and set(s for s, _ in tree.paths()) == {None}, tree.num_trees
    assert tree.evict(nblocks) == 0  # pinned by us: nothing to evict, the tree stays
    pool.decref(list(tree.paths().values()))
    assert tree.num_trees == 1
    assert tree.evict(nblocks) == nblocks and tree.num_trees == 0 and pool.num_free == nblocks



def test_a_long_salt_is_not_held_by_the_tree():
    """A root lives as long as its pages: a salt kept as given held its string for that long
    (1,024 distinct 5 MB salts through the Python API, ~5 GB after the calls). A str salt past
    SALT_KEY_CHARS is keyed by its digest: the tree holds no reference to it, it still matches
    itself, and two long salts that differ only in their last character stay apart."""
    import sys

    bs = 4
    pool = BlockPool(1, 8, bs, 1, 1, torch.float32, "cpu")
    tree = PrefixCache(pool)
    salt, other = "t" * 1_000_000 + "a", "t" * 1_000_000 + "b"
    tokens = list(range(2 * bs))
    before = sys.getrefcount(salt)
    blocks = tree.allocate(2)
    tree.insert(salt, tokens, blocks)
    pool.decref(blocks)
    assert sys.getrefcount(salt) == before, "the tree holds the salt string"
    assert all(sys.getsizeof(k) < 1_000 for k, _ in tree.paths()), "a root key is the size of the salt"
    got = tree.match(salt, tokens)
    assert got == blocks, (got, blocks)
    pool.decref(got)
    assert tree.match(other, tokens) == [] and tree.match("t" * 1_000_000, tokens) == []
    short = "tenant-7"   # short salts are kept as given (paths() shows them)
    more = tree.allocate(1)
    tree.insert(short, tokens[:bs], more)
    pool.decref(more)
    assert short in {k for k, _ in tree.paths()}

def test_insert_adopts_the_callers_copy_of_a_page_only_the_tree_holds():
    """A batch-invariant match is cut down to prefix_align and the caller computes its own copy of
    the pages past the cut. Kept, the tree's old copy sat above the caller's pinned pages, an
    interior node eviction never reaches, though available_blocks counted it as free (a setwise
    decode then ran out of pages and computed its prompt again). insert adopts the caller's copy
    where the tree held the only reference to its own (that one is freed at once); a page someone
    else still reads stays the tree's."""
    bs = 2
    pool = BlockPool(1, 8, bs, 1, 1, torch.float32, "cpu")
    tree = PrefixCache(pool)
    tokens = list(range(3 * bs))
    old = tree.allocate(2)
    tree.insert(None, tokens[:2 * bs], old)
    pool.decref(old)                                 # the first call is done: only the tree holds them
    mine = tree.allocate(3)                          # the second call's own copies (its match was cut to 0)
    assert pool.num_free == 3 and tree.available_blocks() == 3 + 2
    tree.insert(None, tokens, mine)
    got = [tree.paths()[(None, tuple(tuple(tokens[i:i + bs]) for i in range(0, j, bs)))] for j in (2, 4, 6)]
    assert got == mine, f"the tree kept {got}, not the caller's copies {mine}"
    assert pool.num_free == 5 and all(pool.refcount[b] == 0 for b in old), [pool.refcount[b] for b in old]
    assert tree.available_blocks() == 5, "what the fit check counted as free must be free"
    assert tree.allocate(5) and pool.num_free == 0   # the caller's pages stay pinned; the rest all serve
    pool.decref(mine)
    # a page another call still reads (matched, pinned) stays the tree's; the caller's copy stays the caller's
    tree.evict(8)
    pool.decref([b for b in range(8) if pool.refcount[b] > 0])
    assert pool.num_free == 8 and tree.resident_tokens == 0
    old = tree.allocate(1)
    tree.insert(None, tokens[:bs], old)
    pool.decref(old)
    reader = tree.match(None, tokens[:bs])
    assert reader == old
    mine = tree.allocate(2)
    tree.insert(None, tokens[:2 * bs], mine)
    assert list(tree.paths().values()).count(old[0]) == 1 and mine[0] not in tree.paths().values(), tree.paths()
    assert pool.refcount[mine[0]] == 1 and pool.refcount[old[0]] == 2, (pool.refcount[mine[0]], pool.refcount[old[0]])


# -- the reranker: cached == uncached ----------------------------------------------------
QUESTION = "Which optimisation lets a setwise reranker learn from a tutor's hints during RL?"
STEP = ("Step {i}: I searched for reranker training with hints and read source {i}; it says the "
        "tutor gives rubric feedback when the reward is high, reflection otherwise. ")
DOCS = ["Adaptive Tutoring Optimization trains a setwise reranker with hints.", "数字 12345 混合。",
        "an unrelated passage about cooking pasta"]


@pytest.fixture(scope="module")
def model():
    return random_reranker_model(layers=2, heads=4, kv_heads=2, head_dim=32)


def session(steps, subqueries=1):
    """An agent session: the trace grows every step; several sub-queries share a context."""
    out = []
    for s in range(steps):
        trace = "".join(STEP.format(i=i) for i in range(s + 1))
        out.append([ScoreRequest(f"sub-query {j} of step {s}: tutor hints?", DOCS, question=QUESTION, trace=trace)
                    for j in range(subqueries)])
    return out


def close(a, b, tol=1e-6):
    return max(abs(x - y) for x, y in zip(sum(a, []), sum(b, []))) <= tol


@pytest.mark.parametrize("subqueries", [1, 3])
def test_agent_session_cached_equals_uncached(model, qwen3_tokenizer, subqueries):
    cached = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    plain = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    computed = []
    for reqs in session(3, subqueries):
        before = cached.cache_stats()["computed_tokens"]
        a, b = cached.score_batch(reqs), plain.score_batch(reqs)
        assert close(a, b), (a, b)
        computed.append(cached.cache_stats()["computed_tokens"] - before)
    st_c, st_p = cached.cache_stats(), plain.cache_stats()
    assert st_c["hit_tokens"] > 0 and st_p["hit_tokens"] == 0
    assert st_c["computed_tokens"] + st_c["hit_tokens"] == st_p["computed_tokens"] == st_p["lookup_tokens"]
    # from step 2 on only the new trace step, the sub-queries and the partial pages are computed
    shared = [len(cached.encode(r).shared_ids) for r in session(3, 1)[-1]][0]
    assert computed[-1] < shared / 2, (computed, shared)


def test_eviction_pressure_never_changes_a_score_or_passes_the_budget(model, qwen3_tokenizer):
    one = len(PointwiseReranker(model=model, tokenizer=qwen3_tokenizer).encode(session(3)[-1][0]).shared_ids)
    budget = one + 40  # room for about one context: smaller than the session
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=budget)
    plain = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    for reqs in session(3, 2) + session(2, 1):
        assert close(rr.score_batch(reqs), plain.score_batch(reqs))
        st_ = rr.cache_stats()
        assert st_["resident_tokens"] <= st_["budget_tokens"] <= budget
        assert rr._prefix_cache.pool.num_blocks * rr.runner.block_size <= budget
    assert rr.cache_stats()["evicted_tokens"] > 0
    tiny = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=64)  # < one context
    assert close(tiny.score_batch(session(2)[-1]), plain.score_batch(session(2)[-1]))


def test_hit_tokens_never_go_down_when_a_hit_is_recomputed(model, qwen3_tokenizer, monkeypatch):
    """A prefix that hits the cache and then runs out of pages is computed again in a private pool:
    its matched tokens are no hits. ``hit_tokens`` is a monotonic counter (a Prometheus counter
    in the server, scraped from another thread at any time): a scrape during that prefill must
    never see hits that a later scrape takes back (a decrease reads as a counter reset)."""
    from acarerank.setwise import SetwiseReranker

    reqs = session(3)
    short = len(PointwiseReranker(model=model, tokenizer=qwen3_tokenizer).encode(reqs[0][0]).shared_ids)
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=(short // 16 + 1) * 16)
    rr.score_batch(reqs[0])  # caches the short context: the long one's start hits it, the rest does not fit
    seen, extend = [], rr.runner.extend

    def scraped(*args, **kw):  # a /metrics scrape while the prefill runs
        seen.append(rr.cache_stats()["hit_tokens"])
        return extend(*args, **kw)

    monkeypatch.setattr(rr.runner, "extend", scraped)
    plain = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    assert close(rr.score_batch(reqs[2]), plain.score_batch(reqs[2]))
    st_ = rr.cache_stats()
    assert max(seen) <= st_["hit_tokens"], (seen, st_)
    assert st_["hit_tokens"] + st_["computed_tokens"] == st_["lookup_tokens"], st_

    # the setwise step API: hits pinned at start_select, the pool runs out in prefill_select
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=8)
    n = len(sr.encode_select(QUESTION, DOCS[:1], max_select=1).prompt.input_ids)
    sr = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=8,
                         cache_budget_tokens=(n // 16 + 1) * 16)
    sr.select(QUESTION, DOCS[:1], max_select=1)
    st = sr.start_select(sr.encode_select(QUESTION, DOCS[:1] + [STEP.format(i=0) * 4], max_select=1))
    before = sr.cache_stats()["hit_tokens"]
    while st.prefilling:
        sr.prefill_select(st, 10_000)
    sr.release_select(st)
    st_ = sr.cache_stats()
    assert before <= st_["hit_tokens"], (before, st_)
    assert st_["hit_tokens"] + st_["computed_tokens"] == st_["lookup_tokens"], st_


def test_cache_salt_isolation(model, qwen3_tokenizer):
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    req = session(1)[0][0]
    enc_a, enc_b = (rr.encode(ScoreRequest(req.query, req.documents, req.question, req.trace, cache_salt=s))
                    for s in ("tenant-a", "tenant-b"))
    h1 = rr.acquire_prefix(enc_a)
    h2 = rr.acquire_prefix(enc_b)
    h3 = rr.acquire_prefix(rr.encode(ScoreRequest(req.query, req.documents, req.question, req.trace,
                                                  cache_salt="tenant-a")))
    n = len(enc_a.shared_ids)
    assert (h1.cached_tokens, h1.computed_tokens) == (0, n)
    assert (h2.cached_tokens, h2.computed_tokens) == (0, n), "reused across salts"
    assert h3.cached_tokens == n // 16 * 16 and h3.computed_tokens == n - h3.cached_tokens
    assert not set(h1.blocks[:n // 16]) & set(h2.blocks), "two salts share a page"
    for h in (h1, h2, h3):
        rr.release_prefix(h)


def test_reranker_salts_leave_no_trees_behind(model, qwen3_tokenizer):
    """Through the reranker: 100 distinct salts under a 256-token budget leave at most one tree
    per cached page, and one unsalted context the size of the budget leaves exactly one.

    100 salts cycle the 16-page pool several times over and take every salt length of the
    ``i % 50`` pattern twice; a root kept after its last page fails within the first ~20."""
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=256)
    for i in range(100):
        h = rr.acquire_prefix(rr.encode(ScoreRequest(f"q{i}", ["d"], cache_salt=f"tenant-{i}" + "x" * (i % 50))))
        rr.release_prefix(h)
        pc = rr._prefix_cache
        assert pc.num_trees <= pc.resident_tokens // rr.runner.block_size <= 16, (i, pc.num_trees)
    big = ScoreRequest("q", ["d"], trace=" ".join(f"step {i}: searched and read." for i in range(60)))
    assert len(rr.encode(big).shared_ids) > 256
    before = (pc.num_trees, pc.resident_tokens)
    rr.release_prefix(rr.acquire_prefix(rr.encode(big)))  # too big for the pool: private, nothing evicted
    assert (pc.num_trees, pc.resident_tokens) == before  # it evicted every salt's pages for nothing
    pc.evict(pc.pool.num_blocks)  # every salt's pages gone: their roots too
    assert pc.num_trees == 0
    h = rr.acquire_prefix(rr.encode(ScoreRequest("q", ["d"], trace="short")))  # unsalted, fits
    rr.release_prefix(h)
    assert rr._prefix_cache.num_trees == 1, rr._prefix_cache.num_trees


def test_step_api_mixed_items_equal_score(model, qwen3_tokenizer):
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_batch_tokens=40)
    # a second reranker on the same runner (its handles are rr's to score: same weights), whose
    # handles live in other pages (no cache: private pools)
    off = PointwiseReranker(runner=rr.runner, tokenizer=qwen3_tokenizer, prefix_cache=False)
    reqs = [session(2)[1][0], ScoreRequest("plain query", DOCS[::-1])]
    handles = [rr.acquire_prefix(rr.encode(r)) for r in reqs] + [off.acquire_prefix(off.encode(reqs[0]))]
    items = [(handles[i % 3], handles[i % 3].encoding.segment_ids[i % 3]) for i in range(7)]
    got = rr.score_segments(items)
    want = [rr.score(reqs[0].query, DOCS, question=QUESTION, trace=reqs[0].trace), rr.score("plain query", DOCS[::-1])]
    for i, v in enumerate(got):
        w = want[i % 3 % 2][i % 3]
        assert abs(v - w) <= 1e-6, (i, v, w)
    enc0 = handles[0].encoding
    assert handles[0].prompt_tokens == len(enc0.shared_ids) + sum(map(len, enc0.segment_ids))
    for h in handles:
        (rr if h is not handles[2] else off).release_prefix(h)
        rr.release_prefix(h)  # idempotent
    with pytest.raises(ValueError, match="released"):
        rr.score_segments([(handles[0], [1, 2])])
    assert set(rr.cache_stats()) == {"lookup_tokens", "hit_tokens", "computed_tokens", "evicted_tokens",
                                     "resident_tokens", "budget_tokens"}
    assert all(rr._prefix_cache.pool.refcount[b] <= 1 for b in range(rr._prefix_cache.pool.num_blocks))


def test_step_api_refuses_handles_of_another_runner(model, qwen3_tokenizer):
    """A handle's pages hold KV its runner's weights computed: another reranker's handle (other
    weights, or the same model loaded into another runner) is refused by item, never scored with
    this reranker's head over the other's KV; the same request's own handle still scores as
    ``score``."""
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    other = PointwiseReranker(model=random_reranker_model(2, 4, 2, 32, seed=7), tokenizer=qwen3_tokenizer)
    twin = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)  # same weights, another runner
    req = ScoreRequest("plain query", DOCS)
    mine, theirs, twins = (r.acquire_prefix(r.encode(req)) for r in (rr, other, twin))
    try:
        seg = mine.encoding.segment_ids[0]
        # the other model's KV under this model's layers: a score, silently wrong, before the check
        for foreign in (theirs, twins):
            with pytest.raises(ValueError, match=r"item 1's handle was not made by this reranker's runner"):
                rr.score_segments([(mine, seg), (foreign, seg)])
        got = rr.score_segments([(mine, ids) for ids in mine.encoding.segment_ids])
        want = rr.score("plain query", DOCS)
        assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)
    finally:
        for r, h in ((rr, mine), (other, theirs), (twin, twins)):
            r.release_prefix(h)


def test_block_ids_out_of_the_pool_are_refused(model, qwen3_tokenizer):
    """A block id is a page of one pool: -1 was the pool's last page (Python and torch indexing
    wrap around), so a table holding it pinned and read another page, a wrong score without a
    word. The pool refuses it when a table takes its reference, before any count changes."""
    pool = BlockPool(1, 3, 16, 1, 8, torch.float32, "cpu")
    ids = pool.allocate(3)
    for bad in ([-1], [3], [0, -3], [True], [1.0]):
        for op in (pool.incref, pool.decref):
            with pytest.raises(ValueError, match="is not a block of this pool"):
                op(bad)
    assert pool.refcount == [1, 1, 1], pool.refcount
    pool.decref(ids)
    # through the step API: a budget of exactly the shared part's pages, so -1 is one of its own
    # (held) pages — the old read got a score from the wrong page
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    enc = rr.encode(ScoreRequest("plain query", DOCS))
    pages = -(-len(enc.shared_ids) // rr.runner.block_size)
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=pages * rr.runner.block_size)
    h = rr.acquire_prefix(enc)
    assert h.pool is rr._prefix_cache.pool and h.pool.num_free == 0
    try:
        tampered = dataclasses.replace(h, blocks=[-1] + h.blocks[1:])
        with pytest.raises(ValueError, match="block id -1 is not a block of this pool"):
            rr.score_segments([(tampered, enc.segment_ids[0])])
        assert rr.score_segments([(h, enc.segment_ids[0])])[0] == pytest.approx(rr.score("plain query", DOCS)[0],
                                                                                abs=1e-6)
    finally:
        rr.release_prefix(h)
    assert all(c <= 1 for c in rr._prefix_cache.pool.refcount)


def test_score_segments_pins_its_handles_pages_for_the_call(model, qwen3_tokenizer, monkeypatch):
    """A handle released by another thread while score_segments runs: its last page (partly
    filled, so the handle's alone, not the tree's) went back to the pool after the released check,
    another request took it and wrote its own KV there, and the pass read that — a wrong score with
    no error. The call pins its handles' pages, so the pass still reads the handle's own."""
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    enc = rr.encode(ScoreRequest("plain query", DOCS))
    assert len(enc.shared_ids) % rr.runner.block_size, "the last page must be partly filled"
    want = rr.score("plain query", DOCS)
    h = rr.acquire_prefix(enc)
    other = []
    forward = rr.runner.forward_segments

    def release_meanwhile(items, max_batch_tokens):  # what another thread may do after the check
        rr.release_prefix(h)
        other.append(rr.acquire_prefix(rr.encode(ScoreRequest("another tenant's query, longer " * 3, DOCS))))
        return forward(items, max_batch_tokens)

    monkeypatch.setattr(rr.runner, "forward_segments", release_meanwhile)
    got = rr.score_segments([(h, ids) for ids in enc.segment_ids])
    monkeypatch.undo()
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6, (got, want)
    rr.release_prefix(other[0])
    assert all(c <= 1 for c in rr._prefix_cache.pool.refcount), "a pin was not given back"
    with pytest.raises(ValueError, match="item 0's handle was released"):
        rr.score_segments([(h, enc.segment_ids[0])])


def test_score_segments_takes_iterables_and_names_bad_ids(model, qwen3_tokenizer):
    """Items and token ids as any iterable (a generator was 'object of type generator has no
    len()'), 1-D tensors of ids; anything else a TypeError naming the item."""
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    enc = rr.encode(ScoreRequest("plain query", DOCS))
    h = rr.acquire_prefix(enc)
    try:
        want = rr.score_segments([(h, ids) for ids in enc.segment_ids])
        assert rr.score_segments((h, iter(ids)) for ids in enc.segment_ids) == want
        assert rr.score_segments([(h, torch.tensor(enc.segment_ids[1]))]) == [want[1]]
        for bad, what in ((None, "NoneType"), ("abc", "str"), (torch.tensor([[1, 2]]), r"Tensor of shape \(1, 2\)"),
                          (7, "int")):
            with pytest.raises(TypeError, match=f"item 1's token ids must be a 1-D sequence of ints, got {what}"):
                rr.score_segments([(h, enc.segment_ids[0]), (h, bad)])
        with pytest.raises(TypeError, match="takes a list of .* items, got NoneType"):
            rr.score_segments(None)
        assert rr.score_segments([]) == []
        # integers only, as rescore's ids (docs/api.md): True was scored as token id 1, 5.7 as 5
        seg = list(enc.segment_ids[0])
        for bad, shown in (([True] + seg[1:], "True"), ([seg[0] + 0.7] + seg[1:], f"{seg[0] + 0.7}"),
                           (torch.tensor(seg, dtype=torch.float32), f"{float(seg[0])}"),
                           (torch.tensor([True, False]), "True")):
            with pytest.raises(TypeError, match=f"score_segments: item 1: token ids must be integers, got {shown}"):
                rr.score_segments([(h, seg), (h, bad)])
    finally:
        rr.release_prefix(h)


def test_encode_is_thread_safe(model, qwen3_tokenizer):
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    reqs = [r for step in session(3, 2) for r in step]
    serial = [rr.encode(r).shared_ids for r in reqs]
    results = {}

    def work(i):
        results[i] = [rr.encode(r).shared_ids for r in reqs]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[i] == serial for i in range(4))


def test_decode_writes_only_new_rows(model):
    """Appending a token writes its rows into pages: the pages are not re-packed (same storage)."""
    from acarerank.model import Qwen3Runner

    r = Qwen3Runner.from_hf(model)
    cache = r.prefill([list(range(100, 130)), list(range(200, 205))])
    ptrs = [t.data_ptr() for t in cache.pool.k]
    before = [t.clone() for t in cache.pool.k]
    r.forward(cache, [[7], [8]], [0, 1], append=True)
    assert cache.lengths == [31, 6]
    assert [t.data_ptr() for t in cache.pool.k] == ptrs
    # compare bit patterns: unwritten pages are uninitialised memory (NaN != NaN)
    changed = sum(int((a.view(torch.int32) != b.view(torch.int32)).any(dim=(-1, -2)).sum())
                  for a, b in zip(before, cache.pool.k))
    assert changed == 2 * len(ptrs), f"{changed} rows changed, expected one per group per layer"


def test_a_cache_budget_past_the_devices_memory_is_refused_at_construction(model, qwen3_tokenizer):
    """The pool is allocated whole on first use: a budget no device holds (10**23 tokens) failed
    there, in the first request (torch's 'Overflow when unpacking long'; serve's warm-up), and a
    merely huge one would allocate until the host ran out. Now a ValueError at construction naming
    the budget, its bytes (K and V of every layer, per token) and the device's memory."""
    from acarerank.model.cached_prefill import device_memory_bytes
    from acarerank.setwise import SetwiseReranker

    a = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer).runner.arch
    per_token = 2 * a.num_layers * a.num_kv_heads * a.head_dim * 4  # fp32
    total = device_memory_bytes(torch.device("cpu"))
    over = total // per_token + 1
    for cls, budget in ((PointwiseReranker, over), (SetwiseReranker, 10 ** 23)):
        with pytest.raises(ValueError, match=rf"^cache_budget_tokens={budget:,} \(serve --cache-budget\) is .* GiB of "
                                             rf"KV pages for this model \({per_token:,} bytes a token\), more than "):
            cls(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=budget)
    # at the device's memory it is taken (allocated on first use only), and with no cache it is ignored
    assert PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=total // per_token)
    assert PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False, cache_budget_tokens=over)


def test_agent_bench_smoke(model, qwen3_tokenizer):
    """The agent workload runs end to end on a tiny session; cached tokens < uncached, same scores."""
    from acarerank.benchmark.agent import AgentSpec, check, format_report, run_agent_bench

    spec = AgentSpec(steps=2, trace_step_tokens=40, question_tokens=10, query_tokens=5, docs=2, doc_tokens=(5, 10),
                     subqueries=2)
    res = run_agent_bench(model, qwen3_tokenizer, spec, log=lambda m: None)
    t = res["totals"]
    assert t["acarerank+cache"]["tokens_computed"] < t["acarerank"]["tokens_computed"] == \
        t["transformers+prefix-cache"]["tokens_computed"]
    assert check(res), format_report(res)
    assert "token bound" in format_report(res)


def test_setwise_prompt_prefill_through_the_cache(model, qwen3_tokenizer):
    """A second setwise call sharing the prompt's instructions and query hits the cache and
    selects exactly what an uncached reranker selects (constrained and free decoding)."""
    from acarerank.setwise import SetwiseReranker

    cached = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=16)
    plain = SetwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_new_tokens=16, prefix_cache=False)
    for docs, constrained in ((DOCS, True), (DOCS[::-1] + ["one more candidate passage"], False)):
        a = cached.select(QUESTION, docs, max_select=2, constrained=constrained)
        b = plain.select(QUESTION, docs, max_select=2, constrained=constrained)
        assert (a.indices, a.text) == (b.indices, b.text)
    st_ = cached.cache_stats()
    assert st_["hit_tokens"] > 0 and plain.cache_stats()["hit_tokens"] == 0
    assert all(cached._cache_slot._cache.pool.refcount[b] == 1 for b in cached._cache_slot._cache.paths().values())


def test_a_freed_block_table_is_handed_out_again_as_one_run():
    """allocate -> decref -> allocate keeps consecutive ids consecutive and ascending (the CPU
    paged attention reads such a run of pages in place); every id is still handed out once."""
    from acarerank.model.block_pool import BlockPool

    pool = BlockPool(1, 12, 16, 1, 4, torch.float32, "cpu")
    a = pool.allocate(5)
    b = pool.allocate(4)
    assert a == [0, 1, 2, 3, 4] and b == [5, 6, 7, 8]
    pool.decref(b)
    pool.decref(a)
    again = pool.allocate(5)
    assert again == [0, 1, 2, 3, 4], again
    rest = pool.allocate(7)
    assert sorted(again + rest) == list(range(12)) and rest[:4] == [5, 6, 7, 8], rest


def test_first_use_from_two_threads_builds_one_cache(monkeypatch):
    """CacheSlot.get() allocates the pages on first use: two threads there at once must get one
    cache (a slow allocation, here 0.2 s, let both build their own before)."""
    import time

    from acarerank.model.cached_prefill import CacheSlot

    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=4, kv_heads=2, head_dim=32), max_length=256)
    slot = CacheSlot(rr.runner, budget_tokens=64)
    new_pool, built = rr.runner.new_pool, []

    def slow_pool(n):
        built.append(n)
        time.sleep(0.2)
        return new_pool(n)

    monkeypatch.setattr(rr.runner, "new_pool", slow_pool)
    got = []
    threads = [threading.Thread(target=lambda: got.append(slot.get())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(built) == 1 and got[0] is got[1], f"{len(built)} pools built, caches {got}"


def test_score_and_rerank_take_a_cache_salt(model, qwen3_tokenizer):
    """``score(..., cache_salt=)`` / ``rerank`` cache the shared part under that salt, as a
    ScoreRequest's: the same context under another salt computes it again, the same salt hits."""
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    req = session(1)[0][0]
    ctx = dict(question=req.question, trace=req.trace)
    hits = lambda: rr.cache_stats()["hit_tokens"]  # noqa: E731
    first = rr.score(req.query, req.documents, cache_salt="tenant-a", **ctx)
    assert hits() == 0
    assert rr.score(req.query, req.documents, cache_salt="tenant-b", **ctx) == first and hits() == 0, "reused across salts"
    ranked = rr.rerank(req.query, req.documents, cache_salt="tenant-a", **ctx)
    assert hits() > 0 and max(abs(s - first[i]) for i, s in ranked) <= 1e-6  # a hit: same scores, other rounding
    with pytest.raises(TypeError, match="cache_salt"):
        rr.score(req.query, req.documents, cache_salt=7)


def test_step_api_refuses_segments_and_shared_parts_past_max_length(model, qwen3_tokenizer, monkeypatch):
    """A segment and its handle's shared part are one document's prompt, which ``encode`` caps at
    ``max_length``: score_segments took a segment of any length (one pass held all of it), and
    acquire_prefix a shared part of any length (a private pool of that size). At the cap both
    score as ``score``; one token past it is a ValueError naming the item, its length and the cap,
    before any page is pinned or pass run — an iterator read no further than the first id past."""
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer)
    enc = rr.encode(ScoreRequest("plain query", DOCS))
    want = rr.score("plain query", DOCS)
    seg = enc.segment_ids[0]
    h = rr.acquire_prefix(enc)
    try:
        # a reranker on the same runner whose cap is exactly this handle's shared part + seg
        cap = len(enc.shared_ids) + len(seg)
        tight = PointwiseReranker(runner=rr.runner, tokenizer=qwen3_tokenizer, max_length=cap)
        for at_cap in (seg, torch.tensor(seg), iter(seg)):
            assert tight.score_segments([(h, at_cap)])[0] == pytest.approx(want[0], abs=1e-6)
        refcount = list(h.pool.refcount)

        def no_pass(*args):
            raise AssertionError("a pass ran for an item past the cap")

        monkeypatch.setattr(rr.runner, "forward_segments", no_pass)
        over = seg + [seg[-1]]

        def counted():  # an iterator that fails the test if read past the first id over the cap
            for k, t in enumerate(over + [seg[-1]] * 10):
                assert k <= len(seg), f"id {k} read: past the first one over the cap"
                yield t

        for past, size in ((over, f"{len(seg) + 1}"), (torch.tensor(over), f"{len(seg) + 1}"),
                           (counted(), rf"{len(seg) + 1}\+")):
            with pytest.raises(ValueError, match=rf"item 1's segment of {size} tokens after its handle's "
                                                 rf"{len(enc.shared_ids)} shared tokens is over max_length={cap}"):
                tight.score_segments([(h, seg), (h, past)])
        assert h.pool.refcount == refcount, "pages stayed pinned"
        monkeypatch.undo()
        # acquire_prefix: a shared part one token short of the cap is taken, one of the cap's length not
        for max_length, ok in ((len(enc.shared_ids) + 1, True), (len(enc.shared_ids), False)):
            short = PointwiseReranker(runner=rr.runner, tokenizer=qwen3_tokenizer, max_length=max_length)
            if ok:
                h2 = short.acquire_prefix(enc)
                assert short.score_segments([(h2, seg[-1:])])[0] == pytest.approx(
                    rr.score_segments([(h, seg[-1:])])[0], abs=1e-6)
                short.release_prefix(h2)
            else:
                with pytest.raises(ValueError, match=rf"acquire_prefix: the encoding's shared part of "
                                                     rf"{len(enc.shared_ids)} tokens leaves no room for a document "
                                                     rf"under max_length={max_length}"):
                    short.acquire_prefix(enc)
                assert short.cache_stats()["lookup_tokens"] == 0, "a prefill ran"
    finally:
        rr.release_prefix(h)
