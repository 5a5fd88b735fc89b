"""vLLM's score API (``POST /score``, ``/v1/score``) as its clients send it.

One uvicorn over a tiny random model for the module. Every score is compared with the offline
``PointwiseReranker.score`` of the same query and document (1e-6) and with the rerank route's
``relevance_score``; every error with its status, shape and the field it names. The pairing rule,
the field names and the response shape are vLLM 0.32's (vllm/entrypoints/pooling/scoring/:
``ScoreRequest``'s four namings, ``_validate_score_input_lens``, ``ScoreResponse``);
docs/serving.md, "Endpoints".
"""
import pytest
from _optional import require

require("fastapi", "uvicorn", "httpx")
import httpx  # noqa: E402

from acarerank import PointwiseReranker
from acarerank.server import RerankService, create_app
from acarerank.server.config import ServeConfig
from acarerank.server.schemas import RerankRequest
from serve_util import expect_error, thread_server, tiny_model

QUERY = "tutor reranker"
DOCS = ["Adaptive tutoring optimization for rerankers", "bread baking at home", "setwise selection of passages",
        "a tutor gives hints to the reranker"]
MAX_DOCUMENTS = 8
MAX_CHARS = 8000
#: tokens of the queue budget: the module's requests fit, MAX_DOCUMENTS long documents do not
BUDGET = 800
PAIRS = [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")]


@pytest.fixture(scope="module")
def server():
    model = tiny_model()
    service = RerankService(PointwiseReranker(model=model), "tiny-score", max_batch_tokens=256,
                            max_documents=MAX_DOCUMENTS, max_queue_tokens=BUDGET).start()
    ref = PointwiseReranker(model=model)   # its own prefix cache: the server's reranker is its scheduler's
    try:
        with thread_server(create_app(service, ServeConfig(max_request_chars=MAX_CHARS))) as base:
            yield dict(base=base, ref=ref, service=service, client=httpx.Client(base_url=base, timeout=60))
    finally:
        service.stop()


def score_body(r) -> list:
    """The scores of a 200 ``/score`` answer, in ``data`` order, after checking vLLM's shape."""
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"id", "object", "created", "model", "data", "usage"}, out
    assert out["object"] == "list" and out["model"] == "tiny-score" and out["id"].startswith("score-"), out
    assert isinstance(out["created"], int) and out["created"] > 1_600_000_000, out
    assert [d["index"] for d in out["data"]] == list(range(len(out["data"]))), "data is in input order"
    assert all(set(d) == {"index", "object", "score"} and d["object"] == "score" for d in out["data"]), out["data"]
    usage = out["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] > 0 and usage["completion_tokens"] == 0, usage
    assert "cached_tokens" not in usage, "cached_tokens goes only to a request with a cache_salt (Tenancy)"
    return [d["score"] for d in out["data"]]


def assert_close(got: list, want: list, what: str):
    assert len(got) == len(want), f"{what}: {len(got)} scores for {len(want)} pairs"
    diff = max(abs(g - w) for g, w in zip(got, want))
    assert diff <= 1e-6, f"{what}: max |server - offline| = {diff:.3g}"


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize("first, second", PAIRS)
def test_one_query_with_n_documents_in_input_order(server, path, first, second):
    """1 to N, in each of vLLM's four namings, the query side a string or a list of one; scores in
    input order (not sorted), each the offline reranker's."""
    want = server["ref"].score(QUERY, DOCS)
    for query in (QUERY, [QUERY]):
        got = score_body(server["client"].post(path, json={first: query, second: DOCS}))
        assert_close(got, want, f"{path} {first}/{second}")
    assert sorted(want) != want, "the documents are not already in score order: input order is checked"


def test_one_to_n_is_the_rerank_routes_request(server):
    """1 to N is one group, the rerank route's request: the same scores (bit for bit, both from the
    same cached prefix) and the same usage."""
    c = server["client"]
    c.post("/v1/rerank", json=dict(query=QUERY, documents=DOCS, question="why?"))   # the prefix cached
    r = c.post("/v1/rerank", json=dict(query=QUERY, documents=DOCS, question="why?"))
    rerank = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    s = c.post("/score", json=dict(text_1=QUERY, text_2=DOCS, question="why?"))
    assert score_body(s) == [rerank[i] for i in range(len(DOCS))]
    assert s.json()["usage"]["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert_close(score_body(s), server["ref"].score(QUERY, DOCS, question="why?"), "1 to N with a question")


def test_n_queries_with_n_documents_pair_i_with_i(server):
    """N to N: pair i is query i with document i. A repeated query is one group (its prefix once);
    each pair's score is a 1 to 1 request's, and the usage is the sum of its groups'."""
    c = server["client"]
    queries = ["q zero", "q one", "q zero", "q three"]
    got = score_body(c.post("/score", json=dict(queries=queries, documents=DOCS)))
    alone = [score_body(c.post("/score", json=dict(text_1=q, text_2=d))) for q, d in zip(queries, DOCS)]
    assert_close(got, [a[0] for a in alone], "N to N against 1 to 1")
    assert_close(got, [server["ref"].score(q, [d])[0] for q, d in zip(queries, DOCS)], "N to N against offline")
    groups = {"q zero": [DOCS[0], DOCS[2]], "q one": [DOCS[1]], "q three": [DOCS[3]]}
    usage = sum(c.post("/v1/rerank", json=dict(query=q, documents=d)).json()["usage"]["prompt_tokens"]
                for q, d in groups.items())
    r = c.post("/score", json=dict(queries=queries, documents=DOCS))
    assert r.json()["usage"]["prompt_tokens"] == usage, (r.json()["usage"], usage)
    # one to one, and N to N with every query the same (one group): the 1 to N scores
    assert_close(score_body(c.post("/score", json=dict(data_1=[QUERY] * 4, data_2=DOCS))),
                 server["ref"].score(QUERY, DOCS), "N to N of one query")


@pytest.mark.parametrize("body, code, words", [
    (dict(queries=["a", "b"], documents=DOCS), 400, ["queries has 2 texts and documents 4", "1 to N or N to N"]),
    (dict(text_1=["a", "b", "c"], text_2="d"), 400, ["text_1 has 3 texts and text_2 1"]),
    (dict(text_1=[], text_2=DOCS), 400, ["text_1 is empty"]),
    (dict(data_1="q", data_2=[]), 400, ["data_2 is empty"]),
    (dict(text_1="q"), 422, ["exactly one pair of fields", "got text_1"]),
    (dict(queries="q", documents=DOCS, items=DOCS), 422, ["exactly one pair", "got queries, documents, items"]),
    (dict(text_1="q", documents=DOCS), 422, ["exactly one pair"]),
    (dict(query="q", documents=DOCS), 422, ["exactly one pair", "got documents"]),   # a rerank body
    (dict(text_1=3, text_2=DOCS), 422, ["text_1"]),
    (dict(text_1="q", text_2=[{"content": [{"type": "text", "text": "d"}]}]), 422, ["text_2", "multi-modal"]),
    (dict(queries="q", documents=[{"text": "d"}]), 422, ["documents", "multi-modal"]),
])
def test_bad_pairs_are_named(server, body, code, words):
    expect_error(server["client"].post("/score", json=body), code, words)


def test_limits_are_the_rerank_routes(server):
    """--max-documents (413, the rerank route's message), --max-request-chars counting both sides
    (413), --max-queue-tokens (413 for a request over the whole budget)."""
    c = server["client"]
    many = [f"d{i}" for i in range(MAX_DOCUMENTS + 1)]
    want = c.post("/v1/rerank", json=dict(query="q", documents=many))
    for body in (dict(text_1="q", text_2=many), dict(queries=["q"], documents=many), dict(data_1="q", data_2=many)):
        r = c.post("/score", json=body)
        expect_error(r, 413, [f"{MAX_DOCUMENTS + 1} documents exceed the limit of {MAX_DOCUMENTS}"])
        assert r.json() == want.json()
    # N to N: the query side is the first list read (parsing.py: no list is read past the limit)
    expect_error(c.post("/score", json=dict(queries=many, documents=many)), 413,
                 [f"{MAX_DOCUMENTS + 1} items in queries exceed the limit of {MAX_DOCUMENTS}"])
    half = "x" * (MAX_CHARS // 2)
    expect_error(c.post("/score", json=dict(queries=[half, half], documents=["a", "b"])), 413,
                 ["--max-request-chars"])
    long_docs = ["word " * 150] * MAX_DOCUMENTS   # 6,000 characters, ~1,200 tokens
    expect_error(c.post("/score", json=dict(text_1="q", text_2=long_docs)), 413,
                 ["--max-queue-tokens"])


@pytest.mark.parametrize("field, refused, accepted", [
    ("truncate_prompt_tokens", 512, -1),
    ("use_activation", False, True),
    ("activation", False, None),
    ("softmax", False, True),
    ("max_tokens_per_query", 5, 0),
    ("truncation_side", "left", "right"),
    ("padding", "max_length", "do_not_pad"),
    ("chat_template_kwargs", {"enable_thinking": True}, {}),
])
def test_options_that_change_the_scores_are_refused_not_ignored(server, field, refused, accepted):
    """vLLM's options that would change the scores and that are not served: a 400 naming them, as
    the rerank route refuses truncate_prompt_tokens and use_activation: false."""
    c = server["client"]
    body = dict(text_1=QUERY, text_2=DOCS)
    r = c.post("/score", json=body | {field: refused})
    expect_error(r, 400, [field])
    assert_close(score_body(c.post("/score", json=body | {field: accepted})), server["ref"].score(QUERY, DOCS), field)


def test_the_options_that_are_served(server):
    """max_tokens_per_doc (0: vLLM's "no cut"), chat_template_kwargs' instruction (over the field,
    as vLLM merges them), cache_salt's cached_tokens, request_id in the id; vLLM's request-model
    defaults (priority, user, mm_processor_kwargs, nulls) and unknown fields accepted."""
    c, ref = server["client"], server["ref"]
    long_docs = [d + " and more words " * 20 for d in DOCS]
    cut = c.post("/v1/rerank", json=dict(query=QUERY, documents=long_docs, max_tokens_per_doc=4))
    want = {x["index"]: x["relevance_score"] for x in cut.json()["results"]}
    assert_close(score_body(c.post("/score", json=dict(text_1=QUERY, text_2=long_docs, max_tokens_per_doc=4))),
                 [want[i] for i in range(len(DOCS))], "max_tokens_per_doc")
    assert_close(score_body(c.post("/score", json=dict(text_1=QUERY, text_2=long_docs, max_tokens_per_doc=0))),
                 ref.score(QUERY, long_docs), "max_tokens_per_doc 0")
    got = score_body(c.post("/score", json=dict(text_1=QUERY, text_2=DOCS, instruction="ignored",
                                                chat_template_kwargs={"instruction": "Judge the passage."})))
    assert_close(got, ref.score(QUERY, DOCS, instruction="Judge the passage."), "chat_template_kwargs instruction")
    assert_close(got, score_body(c.post("/score", json=dict(text_1=QUERY, text_2=DOCS,
                                                            instruction="Judge the passage."))), "instruction")
    expect_error(c.post("/score", json=dict(text_1=QUERY, text_2=DOCS, chat_template_kwargs={"instruction": 3})),
                 400, ["instruction"])
    vllm_defaults = dict(model="other", user=None, truncate_prompt_tokens=None, padding=None, truncation_side=None,
                         request_id="abc-1", priority=0, mm_processor_kwargs=None, cache_salt=None,
                         use_activation=None, max_tokens_per_query=0, max_tokens_per_doc=0, instruction=None,
                         chat_template_kwargs=None, unknown={"x": [1]})
    r = c.post("/score", json=dict(text_1=QUERY, text_2=DOCS, **vllm_defaults))
    assert_close(score_body(r), ref.score(QUERY, DOCS), "vLLM's defaults")
    assert r.json()["id"] == "score-abc-1"
    r = c.post("/score", json=dict(text_1=QUERY, text_2=DOCS, cache_salt="tenant"))
    c.post("/score", json=dict(text_1=QUERY, text_2=DOCS, cache_salt="tenant"))
    r = c.post("/score", json=dict(text_1=QUERY, text_2=DOCS, cache_salt="tenant"))
    assert r.json()["usage"]["cached_tokens"] > 0, r.json()["usage"]


def test_the_request_id_is_bounded_and_echoed_as_sent(server):
    """vLLM's request_id comes back in the id and counts in no character limit: past
    MAX_REQUEST_ID_CHARS it is a 422 naming it (a 4 MB id was echoed whole, 200), at the bound and
    with control or markup characters it is echoed exactly (JSON-escaped on the way back). An
    X-Request-Id header, as vLLM reads it, wins over the body's (the same bound)."""
    from acarerank.server.schemas import MAX_REQUEST_ID_CHARS

    c = server["client"]
    body = dict(text_1=QUERY, text_2=DOCS[:1])
    expect_error(c.post("/score", json=body | {"request_id": "x" * (MAX_REQUEST_ID_CHARS + 1)}), 422,
                 ["request_id", str(MAX_REQUEST_ID_CHARS)])
    expect_error(c.post("/score", json=body | {"request_id": "x" * 4_000_000}), 422, ["request_id"])
    for rid in ("x" * MAX_REQUEST_ID_CHARS, "a\x00\n\r\"<script>\u2028é"):
        r = c.post("/score", json=body | {"request_id": rid})
        score_body(r)
        assert r.json()["id"] == "score-" + rid
    # vLLM's X-Request-Id header wins over the body's request_id (its _base_request_id); it was ignored
    for sent in (body, body | {"request_id": "from-the-body"}):
        r = c.post("/score", json=sent, headers={"X-Request-Id": "from-the-header"})
        score_body(r)
        assert r.json()["id"] == "score-from-the-header"
    expect_error(c.post("/score", json=body, headers={"X-Request-Id": "x" * (MAX_REQUEST_ID_CHARS + 1)}), 422,
                 ["X-Request-Id", str(MAX_REQUEST_ID_CHARS)])


def test_a_score_body_larger_than_a_non_api_body_is_read(server):
    """The score routes are API paths of the gate: admitted (--max-queue) and read up to
    --max-body-bytes. Outside them a body over 64 KiB was a 413 naming the other paths."""
    doc = "word " * 20_000   # 100 kB of JSON, truncated to the model's length
    r = httpx.post(server["base"] + "/score", json=dict(text_1="q", text_2=[doc]), timeout=60)
    expect_error(r, 413, ["--max-request-chars"])   # read, then refused by the per-request limit, not the gate's
    assert "only a POST to" not in r.text


def test_openapi_shows_the_score_routes_with_their_schemas(server):
    spec = server["client"].get("/openapi.json").json()
    for path in ("/score", "/v1/score"):
        post = spec["paths"][path]["post"]
        assert post["requestBody"]["content"]["application/json"]["schema"] == \
            {"$ref": "#/components/schemas/ScorePairsRequest"}, post
        assert post["responses"]["200"]["content"]["application/json"]["schema"] == \
            {"$ref": "#/components/schemas/ScoreResponse"}, post["responses"]["200"]
    fields = spec["components"]["schemas"]["ScorePairsRequest"]["properties"]
    assert {"queries", "documents", "items", "data_1", "data_2", "text_1", "text_2"} <= set(fields), fields
    assert set(spec["components"]["schemas"]["ScoreResponse"]["properties"]) == \
        {"id", "object", "created", "model", "data", "usage"}


def test_a_client_gone_drops_every_group_of_its_request(server, monkeypatch):
    """N to N runs one engine job per distinct query: a client that leaves while they wait has all
    of them dropped, none left to run, and the request counted once in
    acarerank_requests_cancelled_total, as a rerank is (docs/serving.md, "Metrics") — it counted the
    groups then in the engine, at most half its window (2 of the 5 groups here: the window is 4)."""
    import asyncio
    import threading
    import time

    from acarerank.server.disconnect import ClientGone
    from acarerank.server.parsing import parse_body
    from acarerank.server.schemas import ScorePairsRequest

    service = server["service"]
    monkeypatch.setattr(service.engine, "max_running", 4)   # 2 groups in the engine, 3 still to submit
    block = threading.Event()
    service.engine.submit_call(lambda: block.wait(30))   # holds the scheduler: the groups stay queued
    req = parse_body(b'{"queries": ["a", "b", "a", "c", "d", "e"], "documents": ["x", "y", "z", "u", "v", "w"]}',
                     ScorePairsRequest)
    rerank = parse_body(b'{"query": "a", "documents": ["x", "y", "z"]}', RerankRequest)
    counts = []

    async def gone():
        return True
    try:
        for call in (service.score, service.rerank):
            before = service.metrics.cancelled._value.get()
            with pytest.raises(ClientGone):
                asyncio.run(call(req if call == service.score else rerank, gone))
            counts.append(service.metrics.cancelled._value.get() - before)
    finally:
        block.set()
    deadline = time.monotonic() + 30
    while service.engine.num_jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.engine.num_jobs == 0
    assert counts == [1, 1], f"cancelled requests counted {counts[0]} for the score request, {counts[1]} for the rerank"


def test_a_score_requests_groups_leave_later_requests_room_in_the_passes():
    """The engine's pass takes documents from its first max_running jobs in arrival order: N to N's
    groups all queued at once filled that window, and a rerank sent after them waited until all but
    the last few groups had ended (38 of 40 here, with a window of 8). At most half the window is one
    score request's, so the later rerank is answered after a few of its groups; both are scored as
    offline."""
    import asyncio
    import json
    import threading

    from acarerank.server.parsing import parse_body
    from acarerank.server.schemas import RerankRequest, ScorePairsRequest

    model = tiny_model()
    service = RerankService(PointwiseReranker(model=model), "tiny-window", max_batch_tokens=256,
                            max_documents=64).start()
    service.engine.max_running = 8   # the window (64 by default: a 40-group request would not fill it)
    ref = PointwiseReranker(model=model)
    n = 40
    queries, docs = [f"query {i} about tutors" for i in range(n)], [f"document {i} on rerankers" for i in range(n)]
    score = parse_body(json.dumps(dict(queries=queries, documents=docs)).encode(), ScorePairsRequest)
    later = parse_body(json.dumps(dict(query=QUERY, documents=DOCS[:2])).encode(), RerankRequest)

    async def here():
        return False

    async def until_jobs_past(count: int):
        while service.engine.num_jobs <= count:
            await asyncio.sleep(0.005)

    async def run():
        block = threading.Event()
        service.engine.submit_call(lambda: block.wait(30))   # holds the scheduler while both queue
        try:
            scoring = asyncio.ensure_future(service.score(score, here))
            await until_jobs_past(1)        # its groups are queued (submitted in one step)
            queued = service.engine.num_jobs
            reranking = asyncio.ensure_future(service.rerank(later, here))
            await until_jobs_past(queued)   # and the rerank behind them
            before = service.metrics.documents._value.get()
        finally:
            block.set()
        ranked = await reranking
        groups_done = service.metrics.documents._value.get() - before - 2
        return groups_done, scoring.done(), ranked, await scoring
    try:
        groups_done, score_done, ranked, scored = asyncio.run(run())
    finally:
        service.stop()
    assert not score_done and groups_done < n // 2, \
        f"the later rerank was answered after {groups_done} of the score request's {n} groups"
    assert_close([d["score"] for d in scored["data"]], [ref.score(q, [d])[0] for q, d in zip(queries, docs)], "N to N")
    got = {x["index"]: x["relevance_score"] for x in ranked["results"]}
    assert_close([got[0], got[1]], ref.score(QUERY, DOCS[:2]), "the later rerank")


def test_a_group_that_cannot_be_queued_answers_as_the_engine_says(server, monkeypatch):
    """Groups past the window are queued as earlier ones end: an engine that died or stopped by then
    is the 503 it is for a rerank (not a 500), and the groups already queued are dropped."""
    import time

    from acarerank.server.engine import EngineDead

    service = server["service"]
    submit, calls = service.engine.submit, []

    def submit_then_die(enc, rid=None, **kw):
        calls.append(rid)
        if len(calls) > service.engine.max_running // 2:
            raise EngineDead("injected: the engine died")
        return submit(enc, rid, **kw)
    monkeypatch.setattr(service.engine, "submit", submit_then_die)
    n = MAX_DOCUMENTS
    monkeypatch.setattr(service.engine, "max_running", 4)   # a window of 2 groups: the third is queued later
    r = server["client"].post("/score", json=dict(queries=[f"q{i}" for i in range(n)], documents=DOCS * 2))
    expect_error(r, 503, ["injected: the engine died"])
    assert len(calls) == 3 and service.admitted == 0
    deadline = time.monotonic() + 30
    while service.engine.num_jobs and time.monotonic() < deadline:   # dropped at the next iteration
        time.sleep(0.01)
    assert service.engine.num_jobs == 0
    assert service.queued_tokens == 0 and service.waiting_for_tokens == 0


@pytest.mark.parametrize("error, status, says", [
    ("EngineDead", 503, ["injected"]), ("ValueError", 500, ["internal error while scoring", "ValueError: injected"])])
def test_a_first_window_that_cannot_be_queued_answers_as_a_later_one(server, monkeypatch, error, status, says):
    """The first window of groups is submitted before the request's first await (its turn in the
    token budget, admission.py), outside the task that queues the later ones: an error there is
    answered as it is for a later window (the engine's 503; anything else the 500 naming it) and
    the group already queued is dropped."""
    import time

    from acarerank.server.engine import EngineDead

    service = server["service"]
    submit, calls = service.engine.submit, []

    def submit_then_fail(enc, rid=None, **kw):
        calls.append(rid)
        if len(calls) == 2:
            raise {"EngineDead": EngineDead, "ValueError": ValueError}[error]("injected")
        return submit(enc, rid, **kw)
    monkeypatch.setattr(service.engine, "submit", submit_then_fail)
    monkeypatch.setattr(service.engine, "max_running", 4)   # a window of 2 groups: the second fails
    r = server["client"].post("/score", json=dict(queries=["q0", "q1", "q2"], documents=DOCS[:3]))
    expect_error(r, status, says)
    assert len(calls) == 2 and service.admitted == 0
    deadline = time.monotonic() + 30
    while service.engine.num_jobs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.engine.num_jobs == 0 and service.queued_tokens == 0


def test_a_score_requests_token_ids_take_4_bytes_a_token(server):
    """N to N holds every group's tokenized prompt until the request is answered, and the shared
    parts (one per distinct query) are most of its tokens: they were lists of Python ints, ~36
    bytes a token (1,000 queries of 3.3 k tokens: ~120 MB), where docs/serving.md ("Limits and
    timeouts") bounds the ids at 4 bytes a token (array('i'), as the documents' segments were)."""
    import tracemalloc

    from acarerank.pointwise import ScoreRequest
    from acarerank.server.service import score_tokens

    service = server["service"]
    # words whose ids are past CPython's cached small ints, as most tokens' are
    requests = [ScoreRequest(f"query {i}: " + "adaptive tutoring for rerankers " * 100, [DOCS[i % len(DOCS)]])
                for i in range(40)]
    tracemalloc.start()
    try:
        encs = service._encode_groups(requests, None, True)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    tokens = sum(score_tokens(e) for e in encs)
    shared = sum(len(e.shared_ids) for e in encs)
    assert shared > 0.9 * tokens > 15_000, (shared, tokens)
    assert held / tokens < 6, f"{held:,} bytes held for {tokens:,} tokens: {held / tokens:.1f} a token"
    # what the engine computes from them is the offline score (shorter queries: the module's budget)
    queries = [f"query {i}: " + "adaptive tutoring for rerankers " * 20 for i in range(3)]
    out = server["client"].post("/score", json=dict(queries=queries, documents=DOCS[:3]))
    assert_close(score_body(out), [server["ref"].score(q, [d])[0] for q, d in zip(queries, DOCS)], "long queries")


def test_a_finished_group_is_not_held_until_the_request_ends(server, monkeypatch):
    """A finished group's engine job keeps its prefix handle, and a handle whose prefix did not fit
    the cache's pool holds a private pool of its KV: the request kept every job it had submitted
    until its answer, so with --cache-budget below the default (the engine pinned up to the default then)
    1,000 groups of 3.2 k tokens held ~10 GB at the end. Groups run one at a time here (a window of
    1); when group k is submitted, groups 0..k-2 must be gone (k-1 the engine may still hold)."""
    import gc
    import weakref

    service = server["service"]
    monkeypatch.setattr(service.engine, "max_running", 2)   # a window of 1 group
    submit, refs, alive = service.engine.submit, [], []

    def submit_and_look(enc, rid=None, **kw):
        gc.collect()
        alive.append(sum(r() is not None for r in refs[:-1]))
        job = submit(enc, rid, **kw)
        refs.append(weakref.ref(job))
        return job
    monkeypatch.setattr(service.engine, "submit", submit_and_look)
    n = MAX_DOCUMENTS
    queries, docs = [f"q{i}" for i in range(n)], [DOCS[i % len(DOCS)] for i in range(n)]
    out = server["client"].post("/score", json=dict(queries=queries, documents=docs))
    assert_close(score_body(out), [server["ref"].score(q, [d])[0] for q, d in zip(queries, docs)], "one at a time")
    assert len(alive) == n and alive == [0] * n, f"finished groups still held at each submission: {alive}"
