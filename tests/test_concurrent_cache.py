"""The prefix cache under several callers of one reranker (docs/api.md, "Threads"): the races
between deciding that a prefill fits (``cached_prefill._fits``) and allocating its pages, pages
taken by another caller mid-decode, eviction while another caller holds pinned pages, and
``cache_stats`` read while calls update it — each forced by a hook at the one place where it
can happen, then a storm of them all. On a ``batch_invariant=True`` runner (native attention,
the CPU default) a hit, a miss and a private recompute give the same bits (docs/api.md,
"Embedding in your process"), so every score and selection is compared bitwise with the same
call made alone, with no cache."""
import random
import sys
import threading

import pytest

from _tiny import tiny_causal
from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker
from acarerank.model import Qwen3Runner
from acarerank.model import cached_prefill
from acarerank.setwise import reranker as setwise_reranker

from test_concurrent_calls import assert_pages_at_rest, run_threads

DOCS = [f"document {i} about topic {i % 5}" + " and more text" * (i % 4) for i in range(10)]
STEP = "the agent looked at step {i} and decided to go on. "
LONG_SALT = "tenant-" + "x" * 80  # over prefix_cache.SALT_KEY_CHARS: keyed by its SHA-256 digest


def trace(n):
    return "".join(STEP.format(i=i) for i in range(n)) or None


# an agent's calls: the same question with a growing trace (each call's shared part extends the
# last one's, past the 512-token key tile a batch-invariant hit is cut to), sub-queries, salts
CALLS = [dict(query=f"sub-query {j % 3}", documents=DOCS[j % 4:j % 4 + 2 + j % 3], question="what is the topic?",
              trace=trace(6 * (j % 7)), cache_salt=[None, "tenant-1", LONG_SALT][j % 3]) for j in range(12)]
SELECTS = [dict(query=f"query {j % 2}", documents=DOCS[j:j + 4], intent="the agent's intent" if j % 2 else None,
                max_select=1 + j % 3, cache_salt=[None, "tenant-1", LONG_SALT][j % 3]) for j in range(6)]


@pytest.fixture(scope="module")
def runner():
    return Qwen3Runner.from_hf(tiny_causal(seed=5), batch_invariant=True)


@pytest.fixture(scope="module")
def alone(runner):
    """Every call of CALLS / SELECTS made alone, with no cache: (scores, selections)."""
    pw = PointwiseReranker(runner=runner, prefix_cache=False)
    sw = SetwiseReranker(runner=runner, prefix_cache=False)
    return [pw.score(**c) for c in CALLS], [sw.select(**c) for c in SELECTS]


def pin_every_page(pc):
    """What another caller holding pages does to ``pc``: every page eviction reaches (and every free
    one) allocated, in a thread of its own; returns the blocks to give back (``pool.decref``)."""
    held = []
    t = threading.Thread(target=lambda: held.extend(pc.allocate(pc.available_blocks())))
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert pc.available_blocks() == 0
    return held


def assert_counters_add_up(stats):
    assert stats["hit_tokens"] + stats["computed_tokens"] <= stats["lookup_tokens"], stats
    assert stats["resident_tokens"] <= stats["budget_tokens"], stats


# -- check-then-act: _fits said yes, another caller took the pages before the allocation ------
@pytest.mark.parametrize("call", ["score", "select", "select_batch"])
def test_pages_taken_between_the_fit_check_and_the_allocation(runner, alone, call, monkeypatch):
    """``_fits`` reads the pool, then the prefill allocates: another thread may take every page in
    between. The prefill then meets ``PoolExhausted`` in its first pass and is computed privately —
    the same bits as alone, every page given back, the counters still adding up."""
    pw = PointwiseReranker(runner=runner, cache_budget_tokens=4096)
    sw = SetwiseReranker(runner=runner, cache_budget_tokens=4096)
    rr = pw if call == "score" else sw
    rr._cache_slot.get()
    fits, held, said = cached_prefill._fits, [], []

    def fits_then_taken(pc, *args):
        ok = fits(pc, *args)
        said.append(ok)
        if ok and not held:
            held.extend(pin_every_page(pc))
        return ok

    monkeypatch.setattr(cached_prefill, "_fits", fits_then_taken)
    if call == "score":
        got, want = pw.score(**CALLS[5]), alone[0][5]
    elif call == "select":
        got, want = sw.select(**SELECTS[1]), alone[1][1]
    else:
        got = sw.select_batch([c["query"] for c in SELECTS[:3]], [c["documents"] for c in SELECTS[:3]],
                              [c["intent"] for c in SELECTS[:3]], max_select=1)
        plain = SetwiseReranker(runner=runner, prefix_cache=False)
        want = [plain.select(**{**c, "max_select": 1}) for c in SELECTS[:3]]
    assert said[:1] == [True] and held, "the hook never took the pages: the test tests nothing"
    assert got == want
    stats = rr.cache_stats()
    rr._cache_slot._cache.pool.decref(held)
    assert_pages_at_rest(rr)
    assert stats["hit_tokens"] + stats["computed_tokens"] == stats["lookup_tokens"], stats


# -- PoolExhausted mid-decode: another caller pinned the pool after the prompt's prefill -------
@pytest.mark.parametrize("call", ["select", "select_batch"])
def test_pages_taken_mid_decode_restart_the_selection_privately(runner, call, monkeypatch):
    """The prompt is prefilled in the cache, then another thread pins every page before the decode
    needs one: the decode meets ``PoolExhausted``, the selection restarts in a private pool and
    gives what it gives alone (the prompt's cached pages, pinned by the first try, are not read)."""
    sw = SetwiseReranker(runner=runner, cache_budget_tokens=4096, max_new_tokens=24)
    plain = SetwiseReranker(runner=runner, prefix_cache=False, max_new_tokens=24)
    # long enough outputs that the decode leaves the prompt's last page (3 ids, a free decode)
    kw = [dict(query=f"query {j}", documents=DOCS[j:j + 6], max_select=3, constrained=False) for j in range(2)]
    held, restarts = [], []

    if call == "select":
        make = sw._decoder

        def decoder_then_taken(enc, cache):  # the prefill is done: the decoder is made over its pages
            if not held and cache.pool is sw._cache_slot._cache.pool:
                held.extend(pin_every_page(sw._cache_slot._cache))
            return make(enc, cache)

        monkeypatch.setattr(sw, "_decoder", decoder_then_taken)
        init = cached_prefill.ChunkedPrefill.__init__

        def counted(self, *args, private=False, **kw_):  # the restart is a private ChunkedPrefill
            restarts.append(private)
            init(self, *args, private=private, **kw_)

        monkeypatch.setattr(cached_prefill.ChunkedPrefill, "__init__", counted)
        got, want = sw.select(**kw[0]), plain.select(**kw[0])
        restarted = any(restarts)
    else:
        decode = setwise_reranker.greedy_decode

        def decode_then_taken(runner_, ids, *args, cache=None, **kw_):
            if not held:
                held.extend(pin_every_page(sw._cache_slot._cache))
            else:
                restarts.append(cache)
            return decode(runner_, ids, *args, cache=cache, **kw_)

        monkeypatch.setattr(setwise_reranker, "greedy_decode", decode_then_taken)
        got = sw.select_batch([k["query"] for k in kw], [k["documents"] for k in kw], max_select=3,
                              constrained=False)
        want = [plain.select(**k) for k in kw]
        restarted = bool(restarts)
    assert held and restarted, "the decode never ran out of pages: the test tests nothing"
    assert got == want
    sw._cache_slot._cache.pool.decref(held)
    assert_pages_at_rest(sw)


# -- the private restart itself fails (out of memory): a retried step resumes, nothing is poisoned
def oom_on_the_next_private_pool(runner, monkeypatch):
    """The next growable (private) pool the runner makes fails as an allocation past the host's
    memory does; returns the list that records it."""
    new_pool, failed = runner.new_pool, []

    def new_pool_or_oom(num_blocks, growable=False):
        if growable and not failed:
            failed.append(num_blocks)
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 1 bytes")
        return new_pool(num_blocks, growable)

    monkeypatch.setattr(runner, "new_pool", new_pool_or_oom)
    return failed


def assert_tree_holds_the_prefix(rr, runner, prefix, salt):
    """The K/V pages the cache keeps for ``prefix`` are bitwise those of a private prefill of it."""
    import torch

    pc = rr._cache_slot._cache
    blocks = pc.match(salt, prefix, count_hits=False)
    ref = runner.prefill([prefix])
    try:
        assert blocks, "nothing of the prefix is cached"
        n = len(blocks) * pc.block_size
        for layer in range(len(pc.pool.k)):
            for got, want in ((pc.pool.k[layer], ref.pool.k[layer]), (pc.pool.v[layer], ref.pool.v[layer])):
                assert torch.equal(got[blocks].flatten(0, 1), want[ref.block_tables[0]].flatten(0, 1)[:n]), \
                    f"layer {layer}: the cached pages of the prefix hold other K/V"
    finally:
        pc.pool.decref(blocks)
        ref.free()


def test_a_prefill_step_whose_private_pool_fails_can_be_retried(runner, alone, monkeypatch):
    """A selection's prefill meets ``PoolExhausted`` mid-way (another caller pinned the pool) and
    its private restart cannot get memory: the step raises, and a retried step (the server retries
    an out-of-memory prefill at half the chunk; ChunkedPrefill's docstring allows it) resumes. The
    failed restart had already given back the cache's pages and kept its position: the retry
    computed the prompt's next tokens at position 0 over nothing and entered those pages in the
    tree under the prompt's tokens, for every later call of the salt to hit."""
    sw = SetwiseReranker(runner=runner, cache_budget_tokens=4096)
    call = SELECTS[1]
    st = sw.start_select(sw.encode_select(**call))
    pc = sw._cache_slot._cache
    step = runner.prefix_align  # a step's least in this batch-invariant mode (the native key tile)
    assert sw.prefill_select(st, step) == step and st.prefill.pc is pc and st.prefilling
    held = pin_every_page(pc)
    failed = oom_on_the_next_private_pool(runner, monkeypatch)
    with pytest.raises(RuntimeError, match="not enough memory"):
        sw.prefill_select(st, step)
    assert failed, "the private restart was never tried: the test tests nothing"
    pc.pool.decref(held)  # the other caller is done
    while not st.done:
        sw.prefill_select(st, 128) if st.prefilling else sw.decode_select(st)
    assert sw.finish_select(st) == alone[1][1]
    assert_pages_at_rest(sw)
    assert_tree_holds_the_prefix(sw, runner, st.encoding.prompt.input_ids[:-1], call["cache_salt"])
    assert sw.select(**call) == alone[1][1]
    assert_pages_at_rest(sw)


def test_a_decode_step_whose_private_pool_fails_can_be_retried(runner, monkeypatch):
    """As above, mid-decode: the decoder's pages were given back before the private restart failed,
    and a retried ``decode_select`` stepped the old decoder over an empty cache (lengths 0): a
    selection decoded over no prompt, with no error."""
    sw = SetwiseReranker(runner=runner, cache_budget_tokens=4096, max_new_tokens=24)
    call = dict(query="query 0", documents=DOCS[0:6], max_select=3, constrained=False)
    want = SetwiseReranker(runner=runner, prefix_cache=False, max_new_tokens=24).select(**call)
    st = sw.start_select(sw.encode_select(**call))
    pc = sw._cache_slot._cache
    while st.prefilling:
        sw.prefill_select(st, 10_000)
    held = pin_every_page(pc)
    failed = oom_on_the_next_private_pool(runner, monkeypatch)
    with pytest.raises(RuntimeError, match="not enough memory"):
        while not st.done:
            sw.decode_select(st)
    assert failed, "the decode never ran out of pages: the test tests nothing"
    pc.pool.decref(held)
    while not st.done:
        sw.prefill_select(st, 10_000) if st.prefilling else sw.decode_select(st)
    assert sw.finish_select(st) == want
    assert_pages_at_rest(sw)


# -- eviction while another caller holds pinned pages ---------------------------------------
def test_pinned_pages_survive_a_storm_of_evictions(runner, alone):
    """A handle acquired in one thread, then four threads of distinct prefixes and salts that evict
    everything they can from a 64-page cache: the handle's pages keep their bits and its
    documents score as alone."""
    import torch

    pw = PointwiseReranker(runner=runner, cache_budget_tokens=1024)
    h = pw.acquire_prefix(pw.encode(ScoreRequest(**CALLS[5])))
    pool = pw._cache_slot._cache.pool
    if h.pool is not pool:
        pytest.fail("the handle went private: nothing of the cache's is pinned")

    def rows(pages):  # the handle's rows (a partly filled last page's tail is never written: not compared)
        return pages[h.blocks].flatten(0, 1)[:h.length].clone()

    before = [(rows(pool.k[i]), rows(pool.v[i])) for i in range(len(pool.k))]

    def work(i):
        for n in range(6):
            # short shared parts (traces of 0-12 steps) that fit beside the pinned ones and evict
            pw.score(**{**CALLS[(i + n) % 3], "cache_salt": f"storm-{i}-{n}"})

    assert run_threads(4, work) == []
    assert pw.cache_stats()["evicted_tokens"] > 0, "nothing was evicted: the test tests nothing"
    assert all(torch.equal(rows(pool.k[i]), k) and torch.equal(rows(pool.v[i]), v)
               for i, (k, v) in enumerate(before)), "a pinned page was handed out and written"
    assert pw.score_segments([(h, ids) for ids in h.encoding.segment_ids]) == alone[0][5]
    pw.release_prefix(h)
    assert_pages_at_rest(pw)


# -- cache_stats read while a call updates the counters --------------------------------------
def test_a_scrape_never_sees_more_hits_and_computed_tokens_than_lookups(runner, monkeypatch):
    """``cache_stats`` reads five counters that calls on other threads update (a /metrics scrape
    does, from its own thread). A whole call that ran between its read of lookup_tokens and its
    read of hit_tokens / computed_tokens gave hit + computed > lookup — a hit rate over 1. The
    counters are read as one snapshot: a call on another thread waits for it (or it for the call)."""
    pw = PointwiseReranker(runner=runner, cache_budget_tokens=4096)
    pw.score(**CALLS[5])  # cached: the next call hits
    pc = pw._cache_slot._cache
    scraper, other = threading.get_ident(), []

    class Hooked(type(pc)):
        @property
        def lookup_tokens(self):
            value = self.__dict__["lookup_tokens"]
            if threading.get_ident() == scraper and not other:  # once, after the scrape read it
                t = threading.Thread(target=pw.score, kwargs=CALLS[5], daemon=True)
                other.append(t)
                t.start()
                t.join(2)  # finishes unless the scrape holds the counters (then it waits for the scrape)
            return value

        @lookup_tokens.setter
        def lookup_tokens(self, value):
            self.__dict__["lookup_tokens"] = value

    monkeypatch.setattr(pc, "__class__", Hooked)
    stats = pw.cache_stats()
    other[0].join(60)
    assert not other[0].is_alive()
    assert_counters_add_up(stats)
    assert_counters_add_up(pw.cache_stats())


def test_a_scrape_before_the_first_call_never_sees_computed_tokens_without_their_lookups(runner, monkeypatch):
    """The cache's pages are made by the first call. A scrape that read "no cache yet" and then the
    slot's counters, with that first call run on another thread in between, gave lookup 0 and the
    call's computed tokens (0 + 238 > 0, about one storm in ten): the snapshot is taken of the
    cache that is there once the locks are held."""
    from acarerank.model.cached_prefill import CacheSlot

    pw = PointwiseReranker(runner=runner, cache_budget_tokens=4096)
    slot = pw._cache_slot
    scraper, other = threading.get_ident(), []

    class Hooked(CacheSlot):
        @property
        def _cache(self):
            value = self.__dict__["_cache"]
            if threading.get_ident() == scraper and not other:  # once, after the scrape read it
                t = threading.Thread(target=pw.score, kwargs=CALLS[5], daemon=True)
                other.append(t)
                t.start()
                t.join(60)  # the first call, whole: the scrape holds nothing yet
            return value

        @_cache.setter
        def _cache(self, value):
            self.__dict__["_cache"] = value

    monkeypatch.setattr(slot, "__class__", Hooked)
    stats = pw.cache_stats()
    assert other and not other[0].is_alive()
    assert_counters_add_up(stats)
    assert stats["lookup_tokens"] > 0, stats  # the call's, whole (the snapshot is after it)


# -- everything at once --------------------------------------------------------------------
@pytest.mark.parametrize("budget", [512, 2048, 8192], ids=["32-pages", "128-pages", "512-pages"])
def test_a_storm_of_callers_gets_the_bits_of_calls_made_alone(runner, alone, budget, monkeypatch):
    """Six threads on one PointwiseReranker and one SetwiseReranker (one runner): score, score_batch,
    select and select_batch over overlapping traces, sub-queries and three salts (one over 64
    characters), with budgets that force evictions and private prefills, and a scraper reading
    cache_stats throughout. Every score and selection is bitwise the one made alone; the counters
    never go down and always add up; at the end no page is pinned and free + cached = the pool."""
    want, want_sel = alone
    pw = PointwiseReranker(runner=runner, cache_budget_tokens=budget)
    sw = SetwiseReranker(runner=runner, cache_budget_tokens=budget)
    fits, said = cached_prefill._fits, []
    monkeypatch.setattr(cached_prefill, "_fits", lambda *a: said.append(fits(*a)) or said[-1])
    bad, scrapes, stop = [], [], threading.Event()

    def scrape():
        while not stop.is_set():
            scrapes.append(pw.cache_stats())

    def work(i):
        rnd = random.Random(i)
        for _ in range(8):  # 48 calls a storm (at 4 a thread 3 storms of 15 at 128 pages had no hit)
            kind = (i + rnd.randrange(4)) % 4
            if kind == 0:
                j = rnd.randrange(len(SELECTS))
                got, exp = [sw.select(**SELECTS[j])], [want_sel[j]]
            elif kind == 1:
                js = rnd.sample(range(len(SELECTS)), 2)
                got = sw.select_batch([SELECTS[j]["query"] for j in js], [SELECTS[j]["documents"] for j in js],
                                      [SELECTS[j]["intent"] for j in js], max_select=SELECTS[js[0]]["max_select"],
                                      cache_salt=SELECTS[js[0]]["cache_salt"])
                exp = [SetwiseReranker(runner=runner, prefix_cache=False).select(
                    **{**SELECTS[j], "max_select": SELECTS[js[0]]["max_select"]}) for j in js]
            elif kind == 2:
                j = rnd.randrange(len(CALLS))
                got, exp = [pw.score(**CALLS[j])], [want[j]]
            else:
                js = [rnd.randrange(len(CALLS)) for _ in range(3)]
                got, exp = pw.score_batch([ScoreRequest(**CALLS[j]) for j in js]), [want[j] for j in js]
            if got != exp:
                bad.append((i, kind, got, exp))

    # The scraper spins holding the pool's lock and the slot's; at the default GIL switch interval
    # (5 ms) a worker that wants either lock waited out the scraper's whole turn, so the storm was
    # a queue: 9 s of a 13 s test for 24 calls on a Xeon (16-18 s on CI's 2 cores), 0.6 s with a
    # 0.1 ms interval, which also preempts the scraper, mid-read included, 50 times as often.
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    try:
        assert run_threads(6, work) == []
    finally:
        stop.set()
        scraper.join(60)
        sys.setswitchinterval(switch)
    assert bad == []
    assert scrapes, "the scraper never read the stats"
    for name in ("lookup_tokens", "hit_tokens", "computed_tokens", "evicted_tokens"):
        seen = [s[name] for s in scrapes]
        assert seen == sorted(seen), f"{name} went down between two scrapes"
    for s in scrapes:
        assert_counters_add_up(s)
    stats = pw.cache_stats()
    assert stats["hit_tokens"] + stats["computed_tokens"] == stats["lookup_tokens"], stats
    if budget >= 2048:  # at 32 pages a hit, a whole 512-token key tile of 32 pages, is rare
        assert stats["hit_tokens"] > 0, "no call was served from the cache: the storm shares nothing"
    if budget <= 2048:
        assert stats["evicted_tokens"] + sw.cache_stats()["evicted_tokens"] > 0, "nothing was evicted"
    if budget == 512:
        assert False in said, "no prefill went private: the budget does not bite"
    assert_pages_at_rest(pw)
    assert_pages_at_rest(sw)
