"""The rerank endpoints as each peer's client calls them: the bodies the Cohere (v1 and v2), Jina,
vLLM and TEI clients send, their optional fields, and HTTP as clients speak it.

One uvicorn over a tiny random model for the module; every score is compared with the offline
``PointwiseReranker.score`` of the same request (1e-6), every error with its status, shape and
the field it names. What each peer documents: docs/serving.md, "Endpoints".
"""
import gzip
import json
import socket
import tracemalloc

import pytest
from _optional import require

require("fastapi", "uvicorn", "httpx", "cohere")
import cohere  # noqa: E402
import httpx  # noqa: E402

from acarerank import PointwiseReranker
from acarerank.server import RerankService, create_app
from serve_util import expect_error, expect_tei_error, thread_server, tiny_model

KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
QUERY = "tutor reranker"
DOCS = ["Adaptive tutoring optimization for rerankers", "bread baking at home", "setwise selection of passages"]


@pytest.fixture(scope="module")
def server():
    model = tiny_model()
    service = RerankService(PointwiseReranker(model=model), "tiny-compat", max_batch_tokens=256,
                            max_documents=16).start()
    ref = PointwiseReranker(model=model)   # its own prefix cache: the server's reranker is its scheduler's
    try:
        with thread_server(create_app(service, api_key=KEY)) as base:
            yield dict(base=base, ref=ref, client=httpx.Client(base_url=base, headers=AUTH, timeout=60))
    finally:
        service.stop()


def scores_of(results, key="relevance_score") -> dict:
    return {r["index"]: r[key] for r in results}


def assert_scores(got: dict, want: list, what: str):
    assert sorted(got) == list(range(len(want))), f"{what}: indices {sorted(got)} for {len(want)} documents"
    diff = max(abs(got[i] - want[i]) for i in range(len(want)))
    assert diff <= 1e-6, f"{what}: max |server - offline| = {diff:.3g}"


def test_cohere_v1_object_documents_come_back_with_their_fields(server):
    """Cohere v1: "If a document is provided the text field is required and all other fields will
    be preserved in the response" (the SDK's ``rerank`` docstring); only ``text`` is scored."""
    want = server["ref"].score(QUERY, DOCS)
    objects = [{"text": d, "title": f"t{i}", "id": str(i)} for i, d in enumerate(DOCS)]
    co = cohere.Client(base_url=server["base"], api_key=KEY)
    res = co.rerank(model="rerank-english-v3.0", query=QUERY, documents=objects, return_documents=True)
    assert_scores({x.index: x.relevance_score for x in res.results}, want, "cohere v1 objects")
    for x in res.results:
        assert x.document.text == DOCS[x.index]
        assert x.document.dict() == objects[x.index], f"document {x.index} came back as {x.document.dict()}"
    # strings still come back as {"text": ...}; without return_documents there is no document
    r = server["client"].post("/v1/rerank", json=dict(query=QUERY, documents=DOCS, return_documents=True))
    assert [x["document"] for x in r.json()["results"]] == [{"text": DOCS[x["index"]]} for x in r.json()["results"]]
    r = server["client"].post("/v1/rerank", json=dict(query=QUERY, documents=objects))
    assert all("document" not in x for x in r.json()["results"]), r.text


@pytest.mark.parametrize("field, refused, accepted", [
    ("rank_fields", ["title", "text"], ["text"]),          # Cohere v1: rank on other keys
    ("max_chunks_per_doc", 10, 1),                         # Cohere v1: score a long document's best chunk
    ("max_chunks_per_doc", 0, None),
    ("truncation_direction", "Left", "Right"),             # TEI: keep the end of the text
    ("truncate_prompt_tokens", 512, -1),                   # vLLM: keep the last 512 prompt tokens
    ("use_activation", False, True),                       # vLLM: logits, not probabilities
    ("softmax", False, None),                              # vLLM's older name of it
])
def test_options_that_change_the_scores_are_refused_not_ignored(server, field, refused, accepted):
    """A peer's option that would change what is scored, and that this server cannot honour, is a
    400 naming it; ignored, the client got scores of another input with no sign of it."""
    want = server["ref"].score(QUERY, DOCS)
    objects = [{"text": d, "title": "bread"} for d in DOCS]
    body = dict(query=QUERY, documents=objects) if field == "rank_fields" else dict(query=QUERY, texts=DOCS) \
        if field == "truncation_direction" else dict(query=QUERY, documents=DOCS)
    words = [field, json.dumps(refused) if isinstance(refused, bool) else str(refused)]
    r = server["client"].post("/rerank", json=body | {field: refused})
    expect_tei_error(r, 400, "Validation", words) if "texts" in body else expect_error(r, 400, words)
    r = server["client"].post("/rerank", json=body | {field: accepted})
    assert r.status_code == 200, r.text
    results = r.json() if field == "truncation_direction" else r.json()["results"]
    assert_scores(scores_of(results, "score" if field == "truncation_direction" else "relevance_score"), want, field)


@pytest.mark.parametrize("field, refused, accepted", [
    ("max_tokens_per_query", 5, 0),                           # vLLM: cut the query to 5 tokens
    ("truncation_side", "left", "right"),                     # vLLM: keep the end of the prompt
    ("padding", "max_length", "do_not_pad"),                  # vLLM: pad the prompt to the model's length
    ("chat_template_kwargs", {"enable_thinking": True}, {}),  # vLLM: render the template otherwise
])
def test_vllms_other_options_are_refused_not_ignored(server, field, refused, accepted):
    """vLLM's rerank request (vllm/entrypoints/pooling/scoring/protocol.py, 0.32) carries these too;
    they were unknown fields here, ignored: scores of another prompt with no sign of it."""
    c = server["client"]
    body = dict(query=QUERY, documents=DOCS)
    expect_error(c.post("/rerank", json=body | {field: refused}), 400, [field])
    r = c.post("/rerank", json=body | {field: accepted})
    assert r.status_code == 200, r.text
    assert_scores(scores_of(r.json()["results"]), server["ref"].score(QUERY, DOCS), field)


def test_a_body_from_vllms_request_model_is_served(server):
    """A client built on vLLM's RerankRequest sends every field at its default: max_tokens_per_doc
    0 (no cut) was a 422 'greater than or equal to 1'; chat_template_kwargs' instruction is the
    instruction (it wins over the field, as vLLM merges them)."""
    c, ref = server["client"], server["ref"]
    long_docs = [d + " and more words" * 30 for d in DOCS]
    defaults = dict(model=None, user=None, truncate_prompt_tokens=None, padding=None, truncation_side=None,
                    request_id="0f3a", priority=0, mm_processor_kwargs=None, cache_salt=None, use_activation=None,
                    max_tokens_per_query=0, max_tokens_per_doc=0, instruction=None, chat_template_kwargs=None,
                    top_n=0)
    r = c.post("/rerank", json=dict(query=QUERY, documents=long_docs, **defaults))
    assert r.status_code == 200, r.text
    assert_scores(scores_of(r.json()["results"]), ref.score(QUERY, long_docs), "vLLM's defaults")
    r = c.post("/rerank", json=dict(query=QUERY, documents=DOCS, instruction="not this one",
                                    chat_template_kwargs={"instruction": "Judge the passage."}))
    assert r.status_code == 200, r.text
    assert_scores(scores_of(r.json()["results"]), ref.score(QUERY, DOCS, instruction="Judge the passage."),
                  "chat_template_kwargs' instruction")


def test_null_is_the_field_left_out(server):
    """TEI declares ``truncate`` as ``Option<bool>`` and Cohere ``return_documents`` as
    ``Optional[bool]``: a client that writes ``null`` gets the default, not a 422."""
    want = server["ref"].score(QUERY, DOCS)
    c = server["client"]
    r = c.post("/rerank", json=dict(query=QUERY, texts=DOCS, truncate=None, return_text=None, raw_scores=None))
    assert r.status_code == 200, r.text
    assert_scores(scores_of(r.json(), "score"), want, "TEI nulls")
    assert all("text" not in x for x in r.json())
    r = c.post("/v1/rerank", json=dict(query=QUERY, documents=DOCS, return_documents=None, top_n=None))
    assert r.status_code == 200, r.text
    assert_scores(scores_of(r.json()["results"]), want, "Cohere nulls")
    assert all("document" not in x for x in r.json()["results"])
    expect_error(c.post("/v1/rerank", json=dict(query=QUERY, documents=DOCS, truncate="yes")), 422, ["truncate"])


def test_a_compressed_body_is_415_naming_the_encoding(server):
    """A gzip body reached the JSON decoder and came back as a 422 'malformed JSON' that hides the
    cause; it is refused before the body is read, naming Content-Encoding."""
    body = json.dumps(dict(query=QUERY, documents=DOCS)).encode()
    c = server["client"]
    for path in ("/v1/rerank", "/v2/rerank", "/rerank"):
        r = c.post(path, content=gzip.compress(body),
                   headers={"content-type": "application/json", "content-encoding": "gzip"})
        if path == "/rerank":   # refused before the body is read: TEI's route answers in TEI's shape
            expect_tei_error(r, 415, "Validation", ["Content-Encoding", "gzip"])
            continue
        expect_error(r, 415, ["Content-Encoding", "gzip"])
        assert r.json()["error"]["type"] == "unsupported_media_type"
    r = c.post("/v1/rerank", content=body, headers={"content-type": "application/json", "content-encoding": "identity"})
    assert r.status_code == 200, r.text


def test_a_body_with_a_utf8_byte_order_mark_is_read(server):
    """RFC 8259 lets a parser ignore a leading BOM and ``json.loads`` of bytes does (so FastAPI
    servers such as vLLM accept it); it was a 422 'malformed JSON ... (byte 0)'."""
    want = server["ref"].score(QUERY, DOCS)
    body = b"\xef\xbb\xbf" + json.dumps(dict(query=QUERY, documents=DOCS)).encode()
    r = server["client"].post("/v2/rerank", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert_scores(scores_of(r.json()["results"]), want, "BOM")
    expect_error(server["client"].post("/v2/rerank", content=b"\xef\xbb" + body[3:]), 422, ["malformed JSON"])


def test_models_list_has_the_openai_model_fields(server):
    """OpenAI's ``Model`` (and vLLM's model card) carries ``created``, Unix seconds."""
    data = server["client"].get("/v1/models").json()
    assert data["object"] == "list" and len(data["data"]) == 1, data
    model = data["data"][0]
    assert set(model) == {"id", "object", "created", "owned_by"}, model
    assert (model["id"], model["object"]) == ("tiny-compat", "model")
    assert isinstance(model["created"], int) and model["created"] > 1_600_000_000, model


def test_the_documented_choices_hold_as_clients_send_them(server):
    """A guard of what docs/serving.md promises each client (this passed before the fixes above):
    ``top_n`` 0 / absent = all, past n = all, negative = 422; ties in input order; unknown
    fields and another ``model`` name ignored; empty documents 400; unicode round trip."""
    c, ref = server["client"], server["ref"]
    docs = DOCS + [DOCS[0], "naïve café ☕ 日本語 \u202e", ""]
    want = ref.score(QUERY, docs)
    order = sorted(range(len(docs)), key=lambda i: (-want[i], i))
    for top_n, n in ((0, len(docs)), (None, len(docs)), (2, 2), (10**18, len(docs))):
        r = c.post("/v1/rerank", json=dict(model="some-other-model", query=QUERY, documents=docs, top_n=top_n,
                                           return_documents=True, priority=0, unknown={"nested": [1, 2]}))
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["model"] == "tiny-compat"
        assert [x["index"] for x in out["results"]] == order[:n], f"top_n={top_n}"
        assert [x["document"]["text"] for x in out["results"]] == [docs[i] for i in order[:n]]
        assert_scores(scores_of(out["results"]) | {i: want[i] for i in order[n:]}, want, f"top_n={top_n}")
    assert want[0] == want[3] and order.index(0) < order.index(3), "a duplicate document ties after the first"
    expect_error(c.post("/v1/rerank", json=dict(query=QUERY, documents=docs, top_n=-1)), 422, ["top_n"])
    expect_error(c.post("/v1/rerank", json=dict(query=QUERY, documents=[])), 400, ["empty"])
    expect_tei_error(c.post("/rerank", json=dict(query=QUERY, texts=[])), 400, "Validation", ["empty"])


def test_teis_route_answers_errors_in_teis_shape(server):
    """TEI's clients read ``error`` as the message (its router's ``{"error", "error_type"}``); our
    object there was no message. /rerank answers a TEI body, or one not read or not parsed, in TEI's
    shape; a body with ``documents`` (Cohere, Jina, vLLM) and every other route keep ours."""
    c = server["client"]
    raw = {"content-type": "application/json"}
    expect_tei_error(c.post("/rerank", content=b"{", headers=raw), 422, "Validation", ["malformed JSON"])
    expect_tei_error(c.post("/rerank", content=b"[]", headers=raw), 422, "Validation", ["malformed JSON"])
    expect_tei_error(c.post("/rerank", json=dict(query=QUERY, texts=[1])), 422, "Validation", ["texts"])
    expect_tei_error(c.post("/rerank", json=dict(query=QUERY, texts=DOCS, truncate="yes")), 422, "Validation",
                     ["truncate"])
    expect_tei_error(c.post("/rerank", json=dict(query=QUERY, texts=["d"] * 17)), 413, "Validation",
                     ["17 documents", "16"])
    expect_tei_error(httpx.post(server["base"] + "/rerank", json=dict(query=QUERY, texts=DOCS), timeout=30), 401,
                     "Validation", ["API key"])
    expect_tei_error(c.get("/rerank"), 405, "Validation")
    # the same mistakes in a documents body, or on another route: our shape, as before
    expect_error(c.post("/rerank", json=dict(query=QUERY, documents=[1])), 422, ["documents"])
    expect_error(c.post("/rerank", json=dict(query=QUERY, documents=DOCS, truncate="yes")), 422, ["truncate"])
    expect_error(c.post("/rerank", json=dict(query=QUERY, documents=[])), 400, ["empty"])
    expect_error(c.post("/v1/rerank", content=b"{", headers=raw), 422, ["malformed JSON"])
    expect_error(c.post("/v1/rerank", json=dict(query=QUERY, texts=[])), 400, ["empty"])
    expect_error(c.post("/v2/rerank", json=dict(query=QUERY, texts=[1])), 422, ["texts"])
    expect_error(c.post("/score", content=b"{", headers=raw), 422, ["malformed JSON"])



def test_a_null_field_picks_no_error_shape(server):
    """``null`` in an optional field is the field left out (docs/serving.md, "Endpoints"): a body with
    ``documents`` and ``"texts": null`` is a documents body, answered in our shape when it is
    refused as when it scores (Cohere's object); the error shape read the key alone, so such a
    body's 200 was Cohere's and its 422 TEI's. ``"documents": null`` beside ``texts`` is TEI's."""
    c = server["client"]
    ok = c.post("/rerank", json=dict(query=QUERY, documents=DOCS, texts=None))
    assert ok.status_code == 200 and isinstance(ok.json(), dict), ok.text   # scored as a documents body
    expect_error(c.post("/rerank", json=dict(query=1, documents=DOCS, texts=None)), 422, ["query"])
    expect_error(c.post("/rerank", json=dict(query=QUERY, documents=DOCS, texts=None, top_n=-1)), 422, ["top_n"])
    assert isinstance(c.post("/rerank", json=dict(query=QUERY, texts=DOCS, documents=None)).json(), list)
    expect_tei_error(c.post("/rerank", json=dict(query=1, texts=DOCS, documents=None)), 422, "Validation", ["query"])

def _raw_exchange(port: int, version: str, count: int) -> tuple:
    """``count`` identical rerank requests written at once on one socket: (bytes read, closed by the
    server). Reads until the server closes or ``count`` whole responses arrived."""
    body = json.dumps(dict(query=QUERY, documents=DOCS)).encode()
    head = (f"POST /v1/rerank {version}\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall((head + body) * count)
        while not (data.count(b"HTTP/1.1 ") == count and data.endswith(b"}")):
            chunk = s.recv(65536)
            if not chunk:
                return data, True
            data += chunk
        s.settimeout(2.0)
        try:
            return data, s.recv(1) == b""
        except socket.timeout:
            return data, False


def test_http_10_and_keep_alive(server):
    """HTTP/1.0 gets its answer and the connection closes (a second request on it is not read);
    HTTP/1.1 answers two pipelined requests on one kept-alive connection."""
    port = int(server["base"].rsplit(":", 1)[1])
    data, closed = _raw_exchange(port, "HTTP/1.0", 1)
    assert data.count(b"HTTP/1.1 200 OK") == 1 and closed, data[:300]
    data, closed = _raw_exchange(port, "HTTP/1.1", 2)
    assert data.count(b"HTTP/1.1 200 OK") == 2 and not closed, data[:300]


def test_an_object_documents_other_keys_go_back_as_sent_without_being_built(server):
    """Cohere v1 keeps an object document's other keys: they go back as their raw JSON, never built
    as Python objects. Built, 3 MB of ``[]`` in one key cost ~45 times its size (a 30 MB body:
    1.4 GB, 2.6 s to decode and 2.9 s of the event loop to answer); the bound here is 10 times
    the body, everything the server and this client allocate during the request together."""
    junk = b"[" + b"[]," * 1_000_000 + b"[]]"
    sent = b'{"text": "%s", "junk": %s, "title": "caf\xc3\xa9 \\u00e9", "n": 1.50}' % (DOCS[0].encode(), junk)
    body = b'{"query": "%s", "documents": [%s, "%s"], "return_documents": true}' % (
        QUERY.encode(), sent, DOCS[1].encode())
    want = server["ref"].score(QUERY, DOCS[:2])
    tracemalloc.start()
    try:
        r = server["client"].post("/v1/rerank", content=body, headers={"Content-Type": "application/json"})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert r.status_code == 200, r.text[:300]
    assert peak < 10 * len(body), f"a {len(body) / 1e6:.1f} MB body peaked at {peak / 1e6:.0f} MB allocated"
    results = r.json()["results"]
    assert_scores(scores_of(results), want, "object document with a large other key")
    docs = {x["index"]: x["document"] for x in results}
    assert docs[0] == json.loads(sent) and docs[1] == {"text": DOCS[1]}, {i: str(d)[:100] for i, d in docs.items()}
    # its skipped strings are still checked: they go back as sent
    r = server["client"].post("/v1/rerank", content=b'{"query": "q", "documents": [{"text": "a", "k": "\xff"}]}')
    expect_error(r, 422, ["UTF-8"])
