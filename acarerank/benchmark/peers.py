"""Other rerank servers as benchmark targets: one request adapter per API shape.

A target is ``NAME=URL`` or ``NAME=API@URL`` (``API`` one of ``API_KINDS``; without it the
server is asked what it is: ``detect_api``). Every adapter turns one rerank request
(query, documents, optional ACARe context) into the server's body and reads back one score
per document, in document order, plus the token count the server reports:

    api        endpoint         body                                answer
    acarerank  POST /v1/rerank  query, documents [, question,       results[{index, relevance_score}],
                                trace, cache_salt]                  usage{prompt_tokens, cached_tokens}
    vllm       POST /v1/rerank  model, query, documents             results[...], usage{total_tokens}
               (Cohere / Jina / vLLM shape)
    llama.cpp  POST /v1/rerank  query, documents, top_n             results[...], usage{prompt_tokens}
    tei        POST /rerank     query, texts, raw_scores=false      [{index, score}] (bare list)

Scores are probabilities P(yes) = softmax([no, yes])[1] on every server (vLLM's
``is_original_qwen3_reranker``, llama.cpp's Qwen3 rank pooling, acarerank), so they compare
directly. Results come sorted by score; the adapters put them back by ``index``.

ACARe context on a peer. The peers fill the model card's template ``<Instruct>: I\\n<Query>:
{query}\\n<Document>: {doc}`` and take no question or trace, so a context is *folded* into
the query text (``fold_context``): question, trace and sub-query, one per line. The folded
request is the same prompt on every server (acarerank scores it as an M0 request with a long
query: the same shared prefix, the same tokens), which is what a side-by-side comparison
needs; acarerank's own M3 fields add only the lines' labels (a few tokens).
"""
from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Optional, Sequence

API_KINDS = ("acarerank", "vllm", "llama.cpp", "tei")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")


@dataclass(frozen=True)
class Target:
    """A rerank server: ``name`` (a label in the report), ``url`` (base, no trailing /),
    ``api`` (one of ``API_KINDS``, or None until detected), ``model`` (sent where the API takes one)."""
    name: str
    url: str
    api: Optional[str] = None
    model: Optional[str] = None


def parse_target(text: str, flag: str = "--target") -> Target:
    """``NAME=URL`` / ``NAME=API@URL`` -> Target; ValueError naming what is wrong and ``flag``, the
    option it came from (bench_serve's --target, ``acarerank bench --peer``)."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"{flag} expects NAME=URL or NAME=API@URL, got {text!r}")
    if not _NAME.match(name):
        raise ValueError(f"{flag} name {name!r}: use letters, digits and _.+- only")
    api = None
    if "@" in rest and not rest.startswith("http"):
        api, _, rest = rest.partition("@")
        if api not in API_KINDS:
            raise ValueError(f"{flag} {name}: unknown API {api!r}; APIs: {', '.join(API_KINDS)}")
    if not re.match(r"^https?://[^/\s]+", rest):
        raise ValueError(f"{flag} {name}: {rest!r} is not an http(s) URL")
    return Target(name, rest.rstrip("/"), api)


def fold_context(query: str, question: Optional[str] = None, trace: Optional[str] = None) -> str:
    """The query text a peer gets for an ACARe request: question, trace, sub-query, one per line
    (missing fields left out; M0 gives the query unchanged)."""
    return "\n".join(x for x in (question, trace, query) if x is not None and x.strip())


# -- adapters ------------------------------------------------------------------------------
def request_body(api: str, query: str, documents: Sequence[str], question=None, trace=None, cache_salt=None,
                 model: Optional[str] = None) -> tuple:
    """(path, json body) of one rerank request for ``api``. Only acarerank takes the ACARe
    fields; for the others pass a folded query (``fold_context``)."""
    docs = list(documents)
    if api == "acarerank":
        body = dict(query=query, documents=docs)
        for k, v in (("question", question), ("trace", trace), ("cache_salt", cache_salt)):
            if v is not None:
                body[k] = v
        return "/v1/rerank", body
    if question is not None or trace is not None:
        raise ValueError(f"the {api} API takes no question/trace; fold them into the query (fold_context)")
    if api == "vllm":
        return "/v1/rerank", dict(model=model, query=query, documents=docs) if model else \
            dict(query=query, documents=docs)
    if api == "llama.cpp":
        return "/v1/rerank", dict(query=query, documents=docs, top_n=len(docs))
    if api == "tei":
        return "/rerank", dict(query=query, texts=docs, raw_scores=False)
    raise ValueError(f"unknown API {api!r}; APIs: {', '.join(API_KINDS)}")


def parse_response(api: str, payload, num_docs: int) -> tuple:
    """(scores in document order, server-reported tokens or None, cached tokens) from a JSON answer.

    ValueError when the answer does not hold exactly one score per document (a server that
    drops or repeats results never passes as a fast one)."""
    if api == "tei":
        if not isinstance(payload, list):
            raise ValueError(f"tei: expected a JSON list, got {type(payload).__name__}")
        pairs, usage = [(r["index"], r["score"]) for r in payload], {}
    else:
        if not isinstance(payload, dict) or "results" not in payload:
            raise ValueError(f"{api}: expected an object with 'results', got {str(payload)[:200]}")
        pairs, usage = [(r["index"], r["relevance_score"]) for r in payload["results"]], payload.get("usage") or {}
    got = dict(pairs)
    if len(pairs) != num_docs or sorted(got) != list(range(num_docs)):
        raise ValueError(f"{api}: {len(pairs)} results with indices {sorted(got)[:8]}... for {num_docs} documents")
    tokens = usage.get("prompt_tokens", usage.get("total_tokens"))
    return [float(got[i]) for i in range(num_docs)], tokens, int(usage.get("cached_tokens", 0) or 0)


# -- what is it -----------------------------------------------------------------------------
def detect_api(url: str, timeout: float = 10.0) -> tuple:
    """(api, version string) of the server at ``url``, asked through endpoints only one kind has:
    acarerank's ``/metrics`` names ``acarerank_`` series; vLLM answers ``/version``; llama.cpp
    ``/props`` (``build_info``); TEI ``/info`` (``model_id``). ValueError when none answers."""
    import httpx

    def get(path):
        try:
            r = httpx.get(url + path, timeout=timeout)
            return r if r.status_code == 200 else None
        except httpx.HTTPError:
            return None

    r = get("/metrics")
    if r is not None and "acarerank_" in r.text:
        v = get("/version")
        return "acarerank", (v.json().get("version", "") if v is not None else "")
    r = get("/props")
    if r is not None and "build_info" in r.text:
        return "llama.cpp", str(r.json().get("build_info", ""))
    r = get("/info")
    if r is not None and "model_id" in r.text:
        return "tei", str(r.json().get("version", ""))
    r = get("/version")
    if r is not None and "version" in r.text:
        return "vllm", str(r.json().get("version", ""))
    raise ValueError(f"{url}: not a rerank server this benchmark knows (no acarerank /metrics, llama.cpp /props, "
                     f"TEI /info or vLLM /version); name its API: NAME=API@URL with API in {', '.join(API_KINDS)}")


def resolve(target: Target) -> tuple:
    """(target with its api set, version string or "")."""
    if target.api is not None:
        try:
            return target, detect_api(target.url)[1]
        except ValueError:
            return target, ""
    api, version = detect_api(target.url)
    return Target(target.name, target.url, api, target.model), version


def served_model(url: str, timeout: float = 10.0) -> Optional[str]:
    """The first model id of an OpenAI-style ``/v1/models`` (vLLM wants it in the body), or None."""
    import httpx

    try:
        data = httpx.get(url + "/v1/models", timeout=timeout).json().get("data") or []
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, AttributeError):
        return None


class PeerProvider:
    """A rerank server as an ``acarerank bench`` provider: ``score(query, documents, ...)`` like
    the in-process ones, over HTTP (the HTTP round trip is part of what it costs).

    The context of M1–M3 is folded into the query (module docstring); ``folded(ctx)`` gives the
    context an in-process reference must score to see the same prompt. Its row is credited with
    the least work whatever the server (``harness.credited_flops``, ``report.least_work_flops``).
    """

    def __init__(self, target: Target, timeout: float = 600.0):
        import httpx

        target, self.version = resolve(target)
        if target.api == "vllm" and target.model is None:
            target = Target(target.name, target.url, target.api, served_model(target.url))
        self.target, self.name = target, target.name
        self._client = httpx.Client(base_url=target.url, timeout=timeout)

    @staticmethod
    def folded(ctx: dict) -> dict:
        return dict(query=fold_context(ctx["query"], ctx.get("question"), ctx.get("trace")), question=None,
                    trace=None)

    def score(self, query, documents, question=None, trace=None, instruction=None) -> list:
        if instruction is not None:
            raise ValueError(f"{self.name}: a peer server fills its own instruction; instruction= is not sent")
        # The bench repeats one context call after call (warm-up, repeats, nested depths): an
        # acarerank server would serve its shared part from its prefix cache from the second call
        # on, a hit the in-process providers cannot have (they run without a cross-call cache).
        # A fresh cache_salt per call starts each from an empty cache, as bench_serve's rounds do.
        salt = f"acarerank-bench-{uuid.uuid4().hex}" if self.target.api == "acarerank" else None
        path, body = request_body(self.target.api, fold_context(query, question, trace), documents,
                                  cache_salt=salt, model=self.target.model)
        r = self._client.post(path, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{self.name} ({self.target.url}{path}) answered {r.status_code}: {r.text[:300]}")
        return parse_response(self.target.api, r.json(), len(documents))[0]

    def close(self) -> None:
        self._client.close()
