"""Every path that takes KV pages gives them all back on any exception: a fault is injected at
each layer of a prefill (``PagedKVCache.pages``, called once per layer on every path: the new rows go
into those pages by ``PagedKVCache.write`` or inside ``qk_norm_rope``) and the pool must be
exactly as it was — reference counts and free blocks — with cached pages pinned by the failing
call (a prefix-cache hit) released too."""
import pytest
import torch
from _tiny import random_qwen3

from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker
from acarerank.model.cached_prefill import ChunkedPrefill, prefill_cached
from acarerank.model.paged_cache import PagedKVCache

LAYERS = 4
TRACE = "the agent read the tutor's hint, searched twice and kept the pages about bread and rivers. " * 5


class Injected(Exception):
    pass


@pytest.fixture(scope="module")
def model():
    return random_qwen3(layers=LAYERS, tie=True, spread_yes_no=20)


@pytest.fixture
def fault_at(monkeypatch):
    """``fault_at(layer, exc)``: the next passes raise ``exc`` when they reach ``layer``."""
    where = {}
    pages = PagedKVCache.pages

    def pages_or_fail(self, layer):
        if where.get("layer") == layer:
            raise where["exc"]
        return pages(self, layer)

    monkeypatch.setattr(PagedKVCache, "pages", pages_or_fail)

    def set_(layer, exc=None):
        where.clear()
        if layer is not None:
            where.update(layer=layer, exc=exc or Injected(f"layer {layer}"))
    return set_


def pool_state(pool):
    return list(pool.refcount), sorted(pool._free)


def warm(rr):
    """Cache the context once (a later call then pins cached pages before it computes)."""
    rr.score("warm", ["d"], trace=TRACE)
    state = pool_state(rr._prefix_cache.pool)
    assert sum(1 for c in state[0] if c > 0) >= 3, "nothing cached"
    return state


@pytest.mark.parametrize("exc", [Injected("x"), torch.OutOfMemoryError("oom"), KeyboardInterrupt()],
                         ids=["error", "oom", "interrupt"])
@pytest.mark.parametrize("layer", range(LAYERS))
def test_acquire_prefix_gives_back_every_page(model, fault_at, layer, exc):
    rr = PointwiseReranker(model=model)
    idle = warm(rr)
    enc = rr.encode(ScoreRequest("warm", ["d"], trace=TRACE + " and one more step."))
    fault_at(layer, exc)
    with pytest.raises(type(exc)):
        rr.acquire_prefix(enc)
    assert pool_state(rr._prefix_cache.pool) == idle, f"pages pinned after a fault at layer {layer}"
    fault_at(None)
    got, want = rr.score("warm", ["d"], trace=TRACE), PointwiseReranker(model=model).score("warm", ["d"], trace=TRACE)
    assert abs(got[0] - want[0]) <= 1e-6, f"score after the fault {got} vs a fresh reranker's {want}"


@pytest.mark.parametrize("where", ["insert", "add_hits", "count", "handle"])
def test_an_interrupt_after_the_passes_pins_no_page(model, monkeypatch, where):
    """A signal delivered once the passes are done — while the new pages enter the tree, the hits
    are counted, or the handle is built — left the call's pages pinned for good (the cache then
    shrank call by call: 1 of 32 pages usable after four interrupts, 0 hits). Every page is free or
    evictable after it, and the next call scores as a fresh reranker."""
    from acarerank import pointwise
    from acarerank.model import prefix_cache
    from acarerank.model.cached_prefill import CacheSlot

    rr = PointwiseReranker(model=model)
    warm(rr)
    pc = rr._prefix_cache
    target = {"insert": (prefix_cache.PrefixCache, "insert"), "add_hits": (prefix_cache.PrefixCache, "add_hits"),
              "count": (CacheSlot, "count"), "handle": (pointwise, "PrefixHandle")}[where]
    real = getattr(*target)

    def interrupted(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(*target, interrupted)
    with pytest.raises(KeyboardInterrupt):
        rr.score("warm", ["d"], trace=TRACE + " and a step of its own.")
    monkeypatch.setattr(*target, real)
    assert pc.available_blocks() == pc.pool.num_blocks, f"pinned after an interrupt in {where}"
    got = rr.score("warm", ["d"], trace=TRACE)
    want = PointwiseReranker(model=model).score("warm", ["d"], trace=TRACE)
    assert abs(got[0] - want[0]) <= 1e-6, (got, want)


@pytest.mark.parametrize("layer", range(LAYERS))
def test_prefill_cached_of_several_groups_and_score_batch(model, fault_at, layer):
    rr = PointwiseReranker(model=model)
    idle = warm(rr)
    ids = rr.encode(ScoreRequest("warm", ["d"], trace=TRACE + " more")).shared_ids
    fault_at(layer)
    with pytest.raises(Injected):
        prefill_cached(rr.runner, rr._cache_slot, [ids, ids[:40], list(range(100, 180))])
    assert pool_state(rr._prefix_cache.pool) == idle
    with pytest.raises(Injected):
        rr.score_batch([("warm", ["a", "b"]), dict(query="q2", documents=["c"], trace=TRACE + " other")])
    assert pool_state(rr._prefix_cache.pool) == idle


@pytest.mark.parametrize("layer", range(LAYERS))
def test_setwise_prefill_and_select_give_back_every_page(model, fault_at, layer):
    rr = PointwiseReranker(model=model)
    sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer)
    docs = ["tutor hints", "bread", "rivers", "the agent's trace"]
    sr.select("which helps the agent?", docs, max_select=2)   # caches the prompt's pages
    pool = sr._cache_slot.get().pool
    idle = pool_state(pool)
    fault_at(layer)
    with pytest.raises(Injected):
        sr.select("which helps the agent most?", docs, max_select=2)
    assert pool_state(pool) == idle, "select() left pages pinned"
    with pytest.raises(Injected):
        sr.select_batch(["which helps the agent most?", "which one?"], [docs, docs[:2]], max_select=2)
    assert pool_state(pool) == idle, "select_batch() left pages pinned"
    # the step API as the server drives it: a failing chunk, then the engine releases the state
    st = sr.start_select(sr.encode_select("which helps the agent most?", docs, max_select=2))
    with pytest.raises(Injected):
        sr.prefill_select(st, 8)
    sr.release_select(st)
    assert pool_state(pool) == idle, "a failed prefill_select left pages pinned after release_select"
    # a chunk that failed can be retried: the state stays consistent
    fault_at(None)
    pc = ChunkedPrefill(rr.runner, sr._cache_slot, list(range(200, 260)))
    fault_at(layer)
    with pytest.raises(Injected):
        pc.step(30)
    fault_at(None)
    while not pc.done:
        pc.step(30)
    pc.cache.free()
    assert all(c <= 1 for c in pool.refcount), "only the tree's own references remain"


def test_a_step_that_failed_after_some_passes_resumes_where_they_end(model, monkeypatch):
    """A step of several passes (``extend`` commits each) that fails in a later one, then retried:
    the retry starts where the committed rows end. It started where the step had (its position
    moved only on success), appended the committed tokens again, and the finished prefix went into
    the tree with those repeats filed under the next tokens' ids: a later hit read another
    position's K/V with no error (a /v1/select retried by the engine after an out-of-memory pass,
    then every selection of that prompt; a next-token logit 0.375 off in a tiny fp32 model)."""
    from acarerank.model import Qwen3Runner

    runner = Qwen3Runner.from_hf(model, prefill_chunk=16)
    sr = SetwiseReranker(runner=runner, tokenizer=PointwiseReranker(model=model).tokenizer)
    prefix = [int(t) for t in torch.randint(100, 5000, (90,), generator=torch.Generator().manual_seed(4))]
    passes, pages = [0], PagedKVCache.pages

    def third_pass_fails(self, layer):
        if layer == 0:
            passes[0] += 1
            if passes[0] == 3:
                raise torch.OutOfMemoryError("injected on the step's third pass")
        return pages(self, layer)

    monkeypatch.setattr(PagedKVCache, "pages", third_pass_fails)
    pc = ChunkedPrefill(runner, sr._cache_slot, prefix)
    with pytest.raises(torch.OutOfMemoryError):
        pc.step(64)   # passes of 16 rows: two committed, the third raised
    assert pc.cache.lengths[0] == 32, pc.cache.lengths
    while not pc.done:
        pc.step(64)
    assert pc.cache.lengths[0] == len(prefix), \
        f"the cache holds {pc.cache.lengths[0]} rows of a {len(prefix)}-token prefix"
    pc.cache.free()
    monkeypatch.setattr(PagedKVCache, "pages", pages)
    hit, hits = prefill_cached(runner, sr._cache_slot, [prefix])
    fresh = runner.prefill([prefix])
    try:
        assert hits[0] >= 64, f"the prefix was not cached ({hits})"
        got, want = (runner.logits(runner.forward(c, [[42]], [0]))[0] for c in (hit, fresh))
        assert (got - want).abs().max().item() <= 1e-4, \
            f"a hit on the retried prefix: next-token logits {(got - want).abs().max().item():.3g} off a fresh one's"
    finally:
        hit.free()
        fresh.free()


def test_a_step_that_raised_once_its_last_pass_committed_still_caches_the_prefix(model, monkeypatch):
    """The prefix's last pass committed, then the step raised (an interrupt between the commit and
    the return): the next step found the prefix done and returned without putting its pages in
    the tree or counting it. It finishes that end now."""
    from acarerank.model import Qwen3Runner

    runner = Qwen3Runner.from_hf(model, prefill_chunk=16)
    sr = SetwiseReranker(runner=runner, tokenizer=PointwiseReranker(model=model).tokenizer)
    prefix = [int(t) for t in torch.randint(100, 5000, (40,), generator=torch.Generator().manual_seed(6))]
    commit = PagedKVCache.commit

    def commit_then_interrupt(self, groups, counts):
        commit(self, groups, counts)
        if self.lengths[0] == len(prefix):
            raise KeyboardInterrupt

    monkeypatch.setattr(PagedKVCache, "commit", commit_then_interrupt)
    pc = ChunkedPrefill(runner, sr._cache_slot, prefix)
    with pytest.raises(KeyboardInterrupt):
        pc.step(64)
    monkeypatch.setattr(PagedKVCache, "commit", commit)
    assert pc.step(64) == 0 and pc.done
    pc.cache.free()
    hit, hits = prefill_cached(runner, sr._cache_slot, [prefix])
    hit.free()
    assert hits[0] == 32, f"the finished prefix's two full pages were not cached (hit {hits})"
