"""PointwiseReranker against the Qwen3-Reranker model card's own transformers path."""
import json
import random

import numpy as np
import pytest
import torch
from _tiny import random_qwen3

from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker
from acarerank.prompts import encode_pointwise, joint_input_ids, official_input_ids, official_scores

DOCS = [
    "Adaptive Tutoring Optimization trains a setwise reranker with a tutor's hints.",
    "  leading spaces and a trailing newline\n",
    "",
    "数字 12345 与中文混合的文档。",
    "punctuation!!! ??? ... --- [1] [2] <tags> & more; 3.14159",
    "line one\nline two\n\n\tline three",
]
QUESTION = "Which method lets a setwise reranker learn from a tutor during RL?"
TRACE = ("First I searched for GRPO rerankers and found background on group-relative advantages. "
         "The question mentions a tutor, so next I will look for hint-based distillation. ") * 3


def random_reranker_model(layers, heads, kv_heads, head_dim, hidden=64, seed=0, dtype=torch.float32):
    """A random tied-embedding Qwen3 with the real vocabulary and spread yes/no rows (tests/_tiny.py)."""
    return random_qwen3(seed=seed, dtype=dtype, spread_yes_no=20, hidden=hidden, intermediate=3 * hidden - 5,
                        layers=layers, heads=heads, kv_heads=kv_heads, head_dim=head_dim, tie=True)


SHAPES = [dict(layers=1, heads=2, kv_heads=2, head_dim=64),
          dict(layers=2, heads=4, kv_heads=2, head_dim=128),
          dict(layers=4, heads=4, kv_heads=1, head_dim=64)]
MODES = {"M0": {}, "M1": {"trace": TRACE}, "M2": {"question": QUESTION}, "M3": {"question": QUESTION, "trace": TRACE}}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"L{s['layers']}-h{s['heads']}/{s['kv_heads']}-d{s['head_dim']}")
def test_scores_equal_official_path_in_every_mode(shape, qwen3_tokenizer):
    tok = qwen3_tokenizer
    model = random_reranker_model(**shape)
    rr = PointwiseReranker(model=model, tokenizer=tok)
    for mode, ctx in MODES.items():
        ours = rr.score("tutoring optimization reranker", DOCS, **ctx)
        ref = official_scores(model, tok, [joint_input_ids(tok, "tutoring optimization reranker", d, **ctx) for d in DOCS],
                              batch_size=1)
        diff = [abs(a - b) for a, b in zip(ours, ref)]
        assert max(diff) <= 1e-5, f"{mode}: per-document |diff| {diff}"
        assert len(set(round(s, 4) for s in ref)) > 1, "degenerate reference scores"


def test_scores_equal_official_path_with_truncation(qwen3_tokenizer):
    tok = qwen3_tokenizer
    model = random_reranker_model(layers=2, heads=4, kv_heads=2, head_dim=64)
    long_doc = "retrieval " * 300 + "the tail that the cut removes"
    docs = [long_doc, DOCS[0], "x" * 2000]
    # M0: the model card truncates the body from its end; ours cuts the document's tail
    rr = PointwiseReranker(model=model, tokenizer=tok, max_length=160, min_doc_tokens=16)
    ref = official_scores(model, tok, [official_input_ids(tok, "q", d, max_length=160) for d in docs], batch_size=1)
    ours = rr.score("q", docs)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= 1e-5
    # M3 with the trace cut oldest-first (in 512-token chunks, so the trace is longer than one):
    # our split equals the full truncated sequence
    rr = PointwiseReranker(model=model, tokenizer=tok, max_length=700, min_doc_tokens=64)
    enc = encode_pointwise(tok, "q", docs, question=QUESTION, trace=TRACE * 8, max_length=700, min_doc_tokens=64)
    assert enc.trace_tokens_dropped > 0 and enc.trace_used and any(enc.doc_truncated)
    ref = official_scores(model, tok, [enc.input_ids(i) for i in range(len(docs))], batch_size=1)
    ours = rr.score("q", docs, question=QUESTION, trace=TRACE * 8)
    assert max(abs(a - b) for a, b in zip(ours, ref)) <= 1e-5


def test_bfloat16_error_within_twice_transformers_bfloat16(qwen3_tokenizer):
    """bf16 rule: |ours_bf16 − fp32| ≤ 2·|transformers_bf16 − fp32| + 2e-3 (per batch, max over docs)."""
    tok = qwen3_tokenizer
    m32 = random_reranker_model(layers=2, heads=4, kv_heads=2, head_dim=64)
    mbf = random_reranker_model(layers=2, heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    ids = [joint_input_ids(tok, "q", d, question=QUESTION) for d in DOCS]
    ref32 = torch.tensor(official_scores(m32, tok, ids, batch_size=1))
    refbf = torch.tensor(official_scores(mbf, tok, ids, batch_size=1))
    ours = torch.tensor(PointwiseReranker(model=mbf, tokenizer=tok).score("q", DOCS, question=QUESTION))
    e_ours, e_hf = (ours - ref32).abs().max().item(), (refbf - ref32).abs().max().item()
    assert e_ours <= 2 * e_hf + 2e-3, f"bf16 error {e_ours:.2e} vs transformers-bf16 {e_hf:.2e}"


def test_batch_invariance(qwen3_tokenizer):
    """A document's score does not depend on its neighbours, their number, order, or chunking."""
    tok = qwen3_tokenizer
    model = random_reranker_model(layers=2, heads=4, kv_heads=2, head_dim=64)
    rng = random.Random(0)
    docs = [" ".join(rng.choice(["alpha", "beta", "rerank", "国", "42", "tutor", "\n"]) for _ in range(rng.randint(0, 60)))
            for _ in range(17)]
    alone = [PointwiseReranker(model=model, tokenizer=tok).score("q", [d], trace=TRACE)[0] for d in docs]
    together = PointwiseReranker(model=model, tokenizer=tok).score("q", docs, trace=TRACE)
    order = list(range(len(docs)))
    rng.shuffle(order)
    shuffled = PointwiseReranker(model=model, tokenizer=tok, max_batch_tokens=50).score("q", [docs[i] for i in order],
                                                                                       trace=TRACE)
    unshuffled = [0.0] * len(docs)
    for pos, i in enumerate(order):
        unshuffled[i] = shuffled[pos]
    worst = max(max(abs(a - b), abs(a - c)) for a, b, c in zip(alone, together, unshuffled))
    assert worst <= 1e-6, f"batch composition changed a score by {worst:.2e}"


def test_score_batch_groups_equal_separate_calls(qwen3_tokenizer):
    tok = qwen3_tokenizer
    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64), tokenizer=tok)
    reqs = [ScoreRequest("first query", DOCS[:3], question=QUESTION), ScoreRequest("second", DOCS[2:], trace=TRACE)]
    batched = rr.score_batch(reqs)
    separate = [rr.score(r.query, r.documents, question=r.question, trace=r.trace) for r in reqs]
    assert max(abs(a - b) for x, y in zip(batched, separate) for a, b in zip(x, y)) <= 1e-6


def test_each_pass_attends_only_to_its_own_requests_prefixes(qwen3_tokenizer, monkeypatch):
    """A deep score_batch runs in several passes; each pass's cache holds the prefixes of the
    requests in that pass, not all of the batch's (every prefix in the cache is read, and the
    torch backend gathers it, per layer: all of them made score_batch slower than one by one)."""
    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64),
                           tokenizer=qwen3_tokenizer, max_batch_tokens=64)
    reqs = [ScoreRequest(f"query {i}", DOCS, question=QUESTION) for i in range(5)]
    seen = []
    forward = rr.runner.forward

    def spy(cache, segments, segment_group, **kw):
        seen.append((cache.num_groups, len(set(segment_group))))
        return forward(cache, segments, segment_group, **kw)

    monkeypatch.setattr(rr.runner, "forward", spy)  # the reranker's own runner (built from the model)
    batched = rr.score_batch(reqs)
    passes = [p for p in seen if p[1] > 0]
    assert len(passes) > 5 and all(groups == used for groups, used in passes), seen
    separate = [rr.score(r.query, r.documents, question=r.question) for r in reqs]
    assert max(abs(a - b) for x, y in zip(batched, separate) for a, b in zip(x, y)) <= 1e-6


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_score_batch_pins_a_bounded_number_of_shared_tokens(qwen3_tokenizer, monkeypatch, prefix_cache):
    """Every prefix a score_batch acquires stays pinned until it is scored: a batch of many requests
    must not hold all of their KV at once. Its requests go in windows of at most max_pinned_tokens
    shared tokens (about two requests' worth here: the cache's budget, or with the cache off the
    default budget, lowered), with the scores of separate calls. Under a budget the bound was at
    least the default budget (65,536 tokens), so all 7 requests were pinned at once, past the pool."""
    import acarerank.pointwise as pointwise

    model = random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64)
    reqs = [ScoreRequest(f"query {i}", DOCS[:2], question=QUESTION, trace=TRACE) for i in range(7)]
    probe = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    shared = len(probe.encode(reqs[0]).shared_ids)
    page = probe.runner.block_size
    bound = (2 * shared + 5) // page * page    # whole pages: what a cache budget holds
    assert shared <= bound < 3 * shared
    if prefix_cache:
        rr = PointwiseReranker(runner=probe.runner, tokenizer=qwen3_tokenizer, cache_budget_tokens=bound + page - 1)
    else:
        rr = probe
        monkeypatch.setattr(pointwise, "default_budget_tokens", lambda runner: bound, raising=False)
    live, peak = set(), [0]
    acquire, release = rr.acquire_prefix, rr.release_prefix

    def acquire_spy(enc, *a, **kw):
        h = acquire(enc, *a, **kw)
        live.add(h)
        peak[0] = max(peak[0], sum(x.length for x in live))
        return h

    def release_spy(h):
        live.discard(h)
        release(h)

    monkeypatch.setattr(rr, "acquire_prefix", acquire_spy)
    monkeypatch.setattr(rr, "release_prefix", release_spy)
    batched = rr.score_batch(reqs)
    assert not live and shared <= peak[0] <= bound, f"{peak[0]} shared tokens pinned at once, bound {bound}"
    assert rr.max_pinned_tokens == bound
    separate = [rr.score(r.query, r.documents, question=r.question, trace=r.trace) for r in reqs]
    assert max(abs(a - b) for x, y in zip(batched, separate) for a, b in zip(x, y)) <= 1e-6


def test_score_batch_windows_count_whole_pages(qwen3_tokenizer, monkeypatch):
    """The pinned bound is the cache's pool, whole pages; the windows counted shared tokens: three
    parts of 16k + 1 tokens (k + 1 pages each) fitted a budget of 3k + 1 pages as tokens, their
    3k + 3 pages did not — the third was computed in a private pool past the budget, every call.
    Windows now count each part's whole pages (``pinned_tokens``)."""
    model = random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64)
    probe = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False)
    page = probe.runner.block_size
    query = next(q for q in (" ".join(["word"] * n) for n in range(1, 40))
                 if len(probe.encode(ScoreRequest(q, ["d"], question=QUESTION)).shared_ids) % page == 1)
    reqs = [ScoreRequest(query, DOCS[:2], question=QUESTION, cache_salt=f"tenant {i}") for i in range(3)]
    shared = len(probe.encode(reqs[0]).shared_ids)
    pages = -(-shared // page)
    budget = -(-3 * shared // page) * page            # the three parts' tokens fit, their pages do not
    assert budget < 3 * pages * page
    rr = PointwiseReranker(runner=probe.runner, tokenizer=qwen3_tokenizer, cache_budget_tokens=budget)
    assert rr.pinned_tokens(rr.encode(reqs[0])) == pages * page
    live, peak, private = set(), [0], []
    acquire, release, prefill = rr.acquire_prefix, rr.release_prefix, rr.runner.prefill

    def acquire_spy(enc, *a, **kw):
        h = acquire(enc, *a, **kw)
        live.add(h)
        peak[0] = max(peak[0], sum(-(-x.length // page) for x in live))
        return h

    def release_spy(h):
        live.discard(h)
        release(h)

    def prefill_spy(*a, **kw):   # a shared part that did not fit the pool: a private pool of its own
        private.append(a)
        return prefill(*a, **kw)

    monkeypatch.setattr(rr, "acquire_prefix", acquire_spy)
    monkeypatch.setattr(rr, "release_prefix", release_spy)
    monkeypatch.setattr(rr.runner, "prefill", prefill_spy)
    for _ in range(2):
        scores = rr.score_batch(reqs)
    assert peak[0] * page <= budget, f"{peak[0]} pages pinned at once, the pool holds {budget // page}"
    assert not private, f"{len(private)} shared parts computed in private pools past the budget"
    want = probe.score_batch(reqs)
    assert max(abs(a - b) for x, y in zip(scores, want) for a, b in zip(x, y)) <= 1e-6


@pytest.mark.parametrize("budget, cache", [(None, True), (4096, True), (4100, True), (16, True), (8, False),
                                           (4096, False)])
def test_max_pinned_tokens_is_the_prefix_caches_budget(qwen3_tokenizer, budget, cache):
    """score_encodings and the server's engine pin at most the same bound: the prefix cache's budget
    in whole pages (at least one: a budget under a page is refused); with the cache off, the default
    budget, whatever budget was given. It was at least the default budget (65,536 tokens) offline."""
    from acarerank.model.cached_prefill import default_budget_tokens
    from acarerank.server.service import pinned_tokens_bound

    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64),
                           tokenizer=qwen3_tokenizer, prefix_cache=cache, cache_budget_tokens=budget)
    page, default = rr.runner.block_size, default_budget_tokens(rr.runner)
    want = default if not cache else max(1, (default if budget is None else budget) // page * page)
    assert rr.max_pinned_tokens == want == pinned_tokens_bound(rr), (rr.max_pinned_tokens, want)


@pytest.mark.parametrize("budget", [0, 1, 15])
def test_a_cache_budget_under_one_page_is_refused(qwen3_tokenizer, budget):
    """The cache's pool is whole pages (16 tokens): a budget under one held nothing and bounded the
    pinned shared parts to one request, so every request ran alone (score_encodings' windows of
    one, the server's engine one request at a time) — silently. Both rerankers refuse it by name
    (serve --cache-budget builds them: tests/server/test_serve_config.py); the cache turned off
    is prefix_cache=False, and one page is the least budget."""
    model = random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64)
    words = (rf"^cache_budget_tokens={budget} \(serve --cache-budget\) is under one page of the prefix cache "
             r"\(16 tokens\): .* one at a time; give at least 16 \(no cache: prefix_cache=False")
    for cls in (PointwiseReranker, SetwiseReranker):
        with pytest.raises(ValueError, match=words):
            cls(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=budget)
    assert PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=16).max_pinned_tokens == 16
    # a numpy integer is the int it holds (acarerank._validate's rule; it was refused), a bool never
    np = pytest.importorskip("numpy")
    for cls in (PointwiseReranker, SetwiseReranker):
        slot = cls(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=np.int64(32))._cache_slot
        assert slot.budget_blocks * slot.runner.block_size == 32, cls
        with pytest.raises(ValueError, match="cache_budget_tokens must be a non-negative int or None, got True"):
            cls(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=True)
    assert PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, cache_budget_tokens=budget,
                             prefix_cache=False).cache_budget_tokens is None


def test_prefix_cache_is_a_bool(qwen3_tokenizer):
    """prefix_cache is held to bool as batch_invariant / compile_layers are: "false" (a config
    file's string, truthy) kept the cache on with no word, in both rerankers."""
    model = random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64)
    for cls in (PointwiseReranker, SetwiseReranker):
        for flag in ("false", 0, None):
            with pytest.raises(TypeError, match=f"prefix_cache must be a bool, got {type(flag).__name__}"):
                cls(model=model, tokenizer=qwen3_tokenizer, prefix_cache=flag)
    assert PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, prefix_cache=False).cache_budget_tokens is None


def test_flags_take_numpy_bools(qwen3_tokenizer):
    """A numpy bool (a flag read through a numpy/pandas table) is the bool it holds, as
    ops._checks.check_flag says: prefix_cache and batch_invariant refused np.True_ (NumPy 2 names
    its type "bool", so a test of the name "bool_" missed it, and CacheSlot took Python's only)."""
    model = random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64)
    for cls in (PointwiseReranker, SetwiseReranker):
        for flag in (True, False):
            rr = cls(model=model, tokenizer=qwen3_tokenizer, prefix_cache=np.bool_(flag))
            assert rr._cache_slot.enabled is flag, (cls.__name__, flag, rr._cache_slot.enabled)
    rr = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, batch_invariant=np.True_)
    assert rr.runner.batch_invariant is True, rr.runner.batch_invariant
    req = ScoreRequest("q", DOCS[:2], question=QUESTION, trace=TRACE)
    got, want = rr.encode(req, truncate=np.True_), rr.encode(req, truncate=True)
    assert got.shared_ids == want.shared_ids and got.segment_ids == want.segment_ids, "encode(truncate=np.True_)"


def test_score_encodings_reports_cache_hits_and_equals_score_batch(qwen3_tokenizer):
    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64),
                           tokenizer=qwen3_tokenizer)
    reqs = [ScoreRequest("first", DOCS[:2], question=QUESTION, trace=TRACE, cache_salt="a"),
            ScoreRequest("second", DOCS[2:], question=QUESTION, trace=TRACE, cache_salt="a")]
    scores, cached = rr.score_encodings([rr.encode(r) for r in reqs])
    shared = [len(rr.encode(r).shared_ids) for r in reqs]
    assert cached[0] < shared[0] // 2 and shared[1] // 2 < cached[1] < shared[1], (cached, shared)
    fresh = PointwiseReranker(runner=rr.runner, tokenizer=qwen3_tokenizer, prefix_cache=False).score_batch(reqs)
    assert max(abs(a - b) for x, y in zip(scores, fresh) for a, b in zip(x, y)) <= 1e-6


def test_rerank_orders_best_first(qwen3_tokenizer):
    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64), tokenizer=qwen3_tokenizer)
    scores = rr.score("q", DOCS)
    ranked = rr.rerank("q", DOCS, top_n=3)
    assert [i for i, _ in ranked] == sorted(range(len(DOCS)), key=lambda i: -scores[i])[:3]
    assert all(0.0 <= s <= 1.0 for s in scores)


def test_bad_input_gives_clear_errors(qwen3_tokenizer, tmp_path):
    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64), tokenizer=qwen3_tokenizer,
                           max_length=600, min_doc_tokens=16)
    with pytest.raises(ValueError, match="no documents"):
        rr.score("q", [])
    with pytest.raises(TypeError, match=r"documents\[1\]"):
        rr.score("q", ["ok", 3])
    with pytest.raises(TypeError, match="query"):
        rr.score(None, ["doc"])
    with pytest.raises(ValueError, match="token"):  # the question alone is over the cap; never cut silently
        rr.score("q", ["doc"], question="why " * 800)
    with pytest.raises(ValueError, match="top_n"):
        rr.rerank("q", ["doc"], top_n=0)
    with pytest.raises(TypeError, match="dtype"):
        PointwiseReranker.from_pretrained(str(tmp_path), dtype=torch.int32)
    with pytest.raises(ValueError, match="device"):
        PointwiseReranker.from_pretrained(str(tmp_path), device="not-a-device")
    with pytest.raises(FileNotFoundError, match="config.json"):
        PointwiseReranker.from_pretrained(str(tmp_path))
    with pytest.raises(TypeError, match="exactly one"):
        PointwiseReranker()


def test_min_doc_tokens_not_below_max_length_is_refused_when_truncating(qwen3_tokenizer):
    """min_doc_tokens >= max_length leaves the prompt's fixed strings no room when a call truncates
    (docs/input-safety.md): a ValueError naming both, from score and encode (the CLI refuses the same
    pair before loading, cli/score.py). truncate=False reserves no document room: such an encode
    scores as with any other min_doc_tokens (it was refused at construction, a regression)."""
    model = random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64)
    req = ScoreRequest("q", ["a", "another document"], question=QUESTION, trace=TRACE)
    fine = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer, max_length=512, min_doc_tokens=400)
    want = fine.score_encodings([fine.encode(req, truncate=False)])
    assert len(fine.score("q", ["a"])) == 1
    for min_doc in (512, 600):
        rr = PointwiseReranker(runner=fine.runner, tokenizer=qwen3_tokenizer, max_length=512, min_doc_tokens=min_doc)
        for call in (lambda: rr.score("q", ["a"]), lambda: rr.encode(req),
                     lambda: encode_pointwise(qwen3_tokenizer, "q", ["a"], max_length=512, min_doc_tokens=min_doc)):
            with pytest.raises(ValueError, match=f"min_doc_tokens {min_doc} leaves no room in max_length 512"):
                call()
        got = rr.score_encodings([rr.encode(req, truncate=False)])
        assert got == want, (min_doc, got, want)


def test_score_encodings_names_what_is_not_an_encoding(qwen3_tokenizer):
    """score_encodings takes a list of PointwiseEncoding: a ScoreRequest was an AttributeError on
    'shared_ids', one encoding unwrapped "not iterable"; a TypeError naming the item now."""
    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64),
                           tokenizer=qwen3_tokenizer)
    req = ScoreRequest("q", ["a"])
    enc = rr.encode(req)
    with pytest.raises(TypeError, match=r"score_encodings: encodings\[1\] is a ScoreRequest, not a PointwiseEncoding"):
        rr.score_encodings([enc, req])
    with pytest.raises(TypeError, match="got one PointwiseEncoding: wrap it in a list"):
        rr.score_encodings(enc)
    assert rr.score_encodings([enc])[0] == rr.score_batch([req])


def test_from_pretrained_folder_and_cli(qwen3_tokenizer, tmp_path, capsys):
    from acarerank.cli import main
    model = random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64)
    model.save_pretrained(tmp_path / "ckpt")
    docs_file = tmp_path / "docs.jsonl"
    docs_file.write_text("\n".join(json.dumps({"id": i, "text": d}) for i, d in enumerate(DOCS[:4])) + "\n")
    expected = PointwiseReranker(model=model, tokenizer=qwen3_tokenizer).score("q", DOCS[:4])
    args = ["score", "--model", str(tmp_path / "ckpt"), "--query", "q", "--docs", str(docs_file)]
    assert main(args + ["--dtype", "float32"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == [0, 1, 2, 3]
    assert max(abs(r["score"] - e) for r, e in zip(rows, expected)) <= 1e-6
    assert "dtype: float32 (asked for explicitly)" in err
    # no --dtype: the automatic choice of this machine, with its reason
    from acarerank.hardware import default_dtype
    dtype, why = default_dtype("cpu")
    assert main(args) == 0
    assert f"dtype: {str(dtype).replace('torch.', '')} ({why})" in capsys.readouterr().err
    assert main(["score", "--model", str(tmp_path / "ckpt"), "--query", "q", "--docs", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_scores_as_a_constant_reward_inside_torch_func_grad(qwen3_tokenizer):
    """A reranker's scores used as a reward inside a torch.func.grad loss: its inputs are token ids,
    nothing depends on the differentiated parameters, so every layer op sees constants of the
    transform (docs/api.md, "Ops and backends") and the gradient is the plain scores. It was
    InferenceOnlyError (every tensor made under grad is the transform's wrapper, constants too)."""
    rr = PointwiseReranker(model=random_reranker_model(layers=1, heads=2, kv_heads=1, head_dim=64),
                           tokenizer=qwen3_tokenizer, prefix_cache=False)
    plain = rr.score("q", DOCS[:2])
    got = torch.func.grad(lambda theta: (theta * torch.tensor(rr.score("q", DOCS[:2]))).sum())(torch.zeros(2))
    assert got.tolist() == plain, (got.tolist(), plain)
