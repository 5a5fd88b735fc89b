"""Soak and chaos run of ``acarerank serve``: a bounded mixed load on loopback, then the server's
idle state, its resources and its shutdown are checked.

Starts ``acarerank serve`` (the embedded default model, fp32) with small ``--max-queue``,
``--max-queue-tokens`` and ``--request-timeout`` — through ``tests/server/fault_serve.py`` with
``FAULT=RuntimeError``, so a request whose query holds "poison" fails its scoring pass (the
engine's culprit search must give it alone a 500) — and for ``--seconds`` drives from threads:

* reranks of 1-200 documents, short and long, with and without question / trace, some with
  ``max_tokens_per_doc``, under a few repeated ``cache_salt`` and trace prefixes; a 429 is
  retried with backoff (at most ``RETRIES`` times);
* selections (``/v1/select``);
* clients that send a request and close the socket while it waits, or during its upload (499 on
  the server);
* slow readers (a small receive buffer, the response read a few hundred bytes at a time);
* uploads stalled past ``--body-timeout`` and heads past ``--header-timeout`` (408, both 2 s);
* large requests (one 300 k-character document: the tokenizer's large lane), half of them abandoned;
* malformed bodies (invalid JSON, wrong types, empty documents: 422 / 400), oversized ones
  (documents past ``--max-documents``, a body past ``--max-body-bytes``, tokens past
  ``--max-queue-tokens``: 413);
* poisoned reranks (500 naming an error id).

Throughout: every status is one the request may get (docs/serving.md, "Errors"), every error
has the documented shape ``{"error": {"message", "type", "code"}}``, ``/health`` and ``/ready``
answer 200, and ``/proc/PID`` is sampled (VmRSS, threads, descriptors). At the end: every 200's
scores equal the offline ``PointwiseReranker``'s for the same request (fp32, within 1e-6, as the
server tests), every selection the offline ``SetwiseReranker``'s; the gauges are idle
(``acarerank_queue_tokens``, ``requests_in_flight``, ``queue_size``, ``requests_running`` all 0),
the prefix cache within its budget, threads and descriptors back to their count after warm-up;
then SIGTERM during a last burst: exit 0 within ``--drain-timeout`` (plus the stop's margin).

    OMP_NUM_THREADS=1 python bench/soak_serve.py --seconds 300      # a soak
    OMP_NUM_THREADS=1 python bench/soak_serve.py --quick            # ~40-80 s, a smoke run (not part of CI)

Exits 1 with the list of problems found, 0 with the figures (requests by status, RSS curve,
descriptors, threads, duration) when there were none.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from acarerank.server.errors import tei_error_type  # noqa: E402 (stdlib only: no torch)
HELPER = ROOT / "tests" / "server" / "fault_serve.py"
WORDS = ("tutor hint reranker setwise document query agent trace search answer bread river model score "
         "token cache prefix batch server engine paging kernel attention budget drain canary").split()
TRACES = [" ".join(random.Random(k).choice(WORDS) for _ in range(300)) for k in range(3)]
SALTS = [None, "tenant-a", "tenant-b", "session-0123456789abcdef"]
RETRIES = 8
LARGE_CHARS = 300_000   # over the large lane's 256 k characters (tokenize_pool.LARGE_REQUEST_CHARS)
TOL = 1e-6        # fp32: the server tests' tolerance (tests/server/test_serve.py, assert_scores)
#: statuses a request of each kind may get (docs/serving.md, "Errors"); 503 only during the drain
ALLOWED = {"rerank": {200, 429, 504}, "select": {200, 429, 504}, "poison": {500, 429, 504},
           "malformed": {400, 422, 429}, "oversized": {413, 429}, "large": {200, 429, 504},
           "stalled": {408, 429}, "stalled_head": {408}}
# malformed and oversized bodies may meet a full --max-queue first: admission comes before the body is read


def words(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    def __init__(self, args):
        self.args = args
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.lock = threading.Lock()
        self.status = collections.Counter()           # (kind, status) -> count
        self.problems = []                            # what went wrong, in words
        self.answers = []                             # (body, response json) of every rerank 200
        self.selections = []                          # (body, response json) of every select 200
        self.samples = []                             # (t, rss_kb, threads, fds)
        self.stop = threading.Event()
        self.draining = False
        self.proc = None

    # -- the server ------------------------------------------------------------------------
    def start(self):
        a = self.args
        budget = ["--max-queue-tokens", str(a.max_queue_tokens)] if a.max_queue_tokens else []
        cmd = [sys.executable, str(HELPER), "serve", "--dtype", "float32", "--port", str(self.port),
               "--max-queue", str(a.max_queue), *budget,
               "--request-timeout", str(a.request_timeout), "--max-documents", "200",
               "--max-body-bytes", str(a.max_body_bytes), "--cache-budget", str(a.cache_budget),
               "--drain-timeout", str(a.drain_timeout), "--tokenize-workers", "2",
               "--body-timeout", "2", "--header-timeout", "2", "--log-level", "warning"]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, FAULT="RuntimeError", OMP_NUM_THREADS="1", PYTHONPATH=path)
        self.log = open(a.log, "w+")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        self.cmd = " ".join(cmd)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode} before it was ready; log {a.log}")
            try:
                if httpx.get(self.base + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit("server not ready within 300 s")

    def proc_sample(self):
        pid = self.proc.pid
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            rss = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1])
            threads = int(next(x for x in status.splitlines() if x.startswith("Threads:")).split()[1])
            fds = len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, StopIteration):
            return None
        return rss, threads, fds

    def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.base + "/metrics", timeout=30).text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    # -- checks ----------------------------------------------------------------------------
    def problem(self, what):
        with self.lock:
            if len(self.problems) < 200:
                self.problems.append(what)

    def record(self, kind, status, body=None, raw=None, headers=None, path=None):
        with self.lock:
            self.status[(kind, status)] += 1
        allowed = ALLOWED[kind] | ({503} if self.draining else set())
        if status not in allowed:
            self.problem(f"{kind}: status {status} not among {sorted(allowed)}: {str(raw)[:300]}")
        if status >= 400 and raw is not None:
            try:
                answer = json.loads(raw)
                err = answer["error"]
                # TEI's shape on its route (docs/serving.md, "Errors"): always for a TEI body (texts), for a
                # documents body only when refused before it was read (admission, drain); error_type by status
                tei_body = path == "/rerank" and isinstance(body, dict) and body.get("texts") is not None
                if path == "/rerank" and isinstance(err, str):
                    ok = set(answer) == {"error", "error_type"} and answer["error_type"] == tei_error_type(status)
                else:
                    ok = (not tei_body and isinstance(err["message"], str) and err["code"] == status
                          and isinstance(err["type"], str) and set(err) == {"message", "type", "code"})
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                self.problem(f"{kind}: {status} without the documented error shape: {str(raw)[:300]}")
            if status == 429 and headers is not None and "retry-after" not in headers:
                self.problem(f"{kind}: 429 without Retry-After")
            if status == 500 and "error id" not in str(raw):
                self.problem(f"{kind}: 500 without an error id: {str(raw)[:300]}")

    # -- clients ---------------------------------------------------------------------------
    def rerank_body(self, rng, poison=False):
        n = rng.choice([1, 2, 3, 5, 8, 13, 30, 60, 120, 200])
        long_docs = rng.random() < 0.25
        docs = [words(rng, rng.randint(60, 160) if long_docs else rng.randint(0, 12)) for _ in range(n)]
        if long_docs and n > 30:
            docs = docs[:30]
        body = dict(query=("poison " if poison else "") + words(rng, rng.randint(1, 8)), documents=docs)
        r = rng.random()
        if r < 0.3:
            body["question"] = "Which reranker learns from a tutor during reinforcement learning?"
        if 0.2 < r < 0.5:
            body["trace"] = rng.choice(TRACES)[:rng.choice([200, 800, 1600])]
        salt = rng.choice(SALTS)
        if salt is not None:
            body["cache_salt"] = salt
        if rng.random() < 0.15:
            body["max_tokens_per_doc"] = rng.randint(4, 40)
        if rng.random() < 0.3:
            body["return_documents"] = True
        if rng.random() < 0.2:
            body["top_n"] = rng.randint(1, n)
        if not poison and rng.random() < 0.15:   # object documents: return_documents sends them back as sent
            body["documents"] = [{"text": d, "id": f"doc-{k}", "meta": [k, None, {"x": 1.5}]}
                                 for k, d in enumerate(body["documents"])]
        return body

    def post_with_retry(self, client, path, kind, body=None, content=None):
        for attempt in range(RETRIES):
            r = client.post(path, json=body) if content is None else client.post(path, content=content)
            self.record(kind, r.status_code, body, r.text, r.headers, path)
            if r.status_code == 503 and self.draining:
                self.stop.set()   # the drain has begun: this burst is over
            if r.status_code != 429:
                return r
            time.sleep(min(2.0, 0.05 * 2 ** attempt) * (0.5 + random.random()))
        return r

    def normal_client(self, seed):
        rng = random.Random(seed)
        with httpx.Client(base_url=self.base, timeout=120) as c:
            while not self.stop.is_set():
                roll = rng.random()
                try:
                    if roll < 0.12:
                        docs = [words(rng, rng.randint(2, 15)) for _ in range(rng.randint(2, 8))]
                        body = dict(query=words(rng, 4), documents=docs, max_select=rng.randint(1, 3),
                                    cache_salt=rng.choice(SALTS[1:]))
                        r = self.post_with_retry(c, "/v1/select", "select", body)
                        if r.status_code == 200:
                            with self.lock:
                                self.selections.append((body, r.json()))
                    else:
                        poison = roll > 0.97
                        body = self.rerank_body(rng, poison)
                        path = rng.choice(["/v1/rerank", "/v2/rerank", "/rerank"])
                        if path == "/rerank" and rng.random() < 0.5:   # TEI's body: texts, a bare list back
                            body["texts"] = [d["text"] if isinstance(d, dict) else d for d in body.pop("documents")]
                            body["return_text"] = body.pop("return_documents", False)
                            body.pop("top_n", None)
                        r = self.post_with_retry(c, path, "poison" if poison else "rerank", body)
                        if r.status_code == 200:
                            with self.lock:
                                self.answers.append((body, r.json()))
                except httpx.HTTPError as e:
                    if not self.draining:
                        self.problem(f"client error: {type(e).__name__}: {e}")

    def raw_request(self, body: bytes, path="/v1/rerank", rcvbuf=None):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=60)
        if rcvbuf:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        return s

    def chaos_client(self, seed):
        rng = random.Random(seed)
        with httpx.Client(base_url=self.base, timeout=120) as c:
            while not self.stop.is_set():
                roll = rng.random()
                try:
                    if roll < 0.02:     # stall the upload past --body-timeout (408), or the head past --header-timeout
                        body = json.dumps(self.rerank_body(rng)).encode()
                        s = socket.create_connection(("127.0.0.1", self.port), timeout=60)
                        head = (f"POST /v1/rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                f"Content-Length: {len(body)}\r\n\r\n").encode()
                        stall_head = rng.random() < 0.5
                        s.sendall(head[:20] if stall_head else head + body[:len(body) // 2])
                        data = b""
                        with contextlib.suppress(OSError):
                            while chunk := s.recv(65536):
                                data += chunk
                        s.close()
                        head_, _, rest = data.partition(b"\r\n\r\n")
                        status = int(head_.split()[1]) if head_ else 0
                        self.record("stalled_head" if stall_head else "stalled", status, None,
                                    rest.decode(errors="replace"))
                    elif roll < 0.04:   # a large request (tokenized in the large lane), now and then abandoned
                        body = dict(query=words(rng, 5), documents=[words(rng, 50_000)[:LARGE_CHARS]],
                                    cache_salt=rng.choice(SALTS[1:]))
                        if rng.random() < 0.5:
                            s = self.raw_request(json.dumps(body).encode())
                            time.sleep(rng.uniform(0.05, 1.0))
                            s.close()
                            with self.lock:
                                self.status[("abandoned_large", "-")] += 1
                        else:
                            r = self.post_with_retry(c, "/v1/rerank", "large", body)
                            if r.status_code == 200:
                                with self.lock:
                                    self.answers.append((body, r.json()))
                    elif roll < 0.07:   # abandon during the upload: half the body, then close
                        body = json.dumps(self.rerank_body(rng)).encode()
                        s = socket.create_connection(("127.0.0.1", self.port), timeout=60)
                        s.sendall(f"POST /v1/rerank HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:len(body) // 2])
                        time.sleep(rng.uniform(0.01, 0.3))
                        s.close()
                        with self.lock:
                            self.status[("abandoned_upload", "-")] += 1
                    elif roll < 0.3:    # abandon while it waits
                        s = self.raw_request(json.dumps(self.rerank_body(rng)).encode())
                        time.sleep(rng.uniform(0.01, 1.0))
                        s.close()
                        with self.lock:
                            self.status[("abandoned", "-")] += 1
                    elif roll < 0.45:   # slow reader
                        body = self.rerank_body(rng)
                        body["return_documents"] = True
                        s = self.raw_request(json.dumps(body).encode(), rcvbuf=4096)
                        pause = rng.choice([0.001, 0.01, 0.05])
                        data = b""
                        t0 = time.monotonic()
                        while time.monotonic() - t0 < 110:
                            chunk = s.recv(512)
                            if not chunk:
                                break
                            data += chunk
                            head, _, rest = data.partition(b"\r\n\r\n")
                            if rest and b"content-length:" in head.lower():
                                cl = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                                if len(rest) >= cl:
                                    break
                            time.sleep(pause)
                        s.close()
                        head, _, rest = data.partition(b"\r\n\r\n")
                        status = int(head.split()[1]) if head else 0
                        self.record("rerank", status, body, rest.decode(errors="replace"))
                        if status == 200:
                            with self.lock:
                                self.answers.append((body, json.loads(rest)))
                    elif roll < 0.6:    # malformed
                        bad = rng.choice([b"{not json", b'{"query": 1, "documents": ["a"]}', b"[1, 2]",
                                          b'{"query": "q", "documents": []}', b'{"query": "q"}',
                                          b'{"query": "q", "documents": ["a"], "top_n": -1}', b"\xff\xfe{"])
                        self.post_with_retry(c, "/v1/rerank", "malformed", content=bad)
                    elif roll < 0.75:   # oversized
                        which = rng.random()
                        if which < 0.4:
                            body = dict(query="q", documents=["d"] * 201)
                        elif which < 0.7 or not self.args.max_queue_tokens:
                            body = dict(query="q", documents=["x" * 1000] * (self.args.max_body_bytes // 1000 + 1))
                        else:           # one request over the whole token budget
                            body = dict(query="q", documents=[words(rng, 150) for _ in range(200)])
                        self.post_with_retry(c, "/v1/rerank", "oversized", body)
                    else:
                        time.sleep(rng.uniform(0.05, 0.3))
                except (OSError, httpx.HTTPError) as e:
                    if not self.draining:
                        self.problem(f"chaos client error: {type(e).__name__}: {e}")

    def monitor(self):
        t0 = time.monotonic()
        while not self.stop.is_set():
            for path in ("/health", "/ready"):
                try:
                    r = httpx.get(self.base + path, timeout=30)
                    with self.lock:
                        self.status[(path, r.status_code)] += 1
                    if r.status_code != 200:
                        self.problem(f"{path}: {r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.problem(f"{path}: {type(e).__name__}: {e}")
            s = self.proc_sample()
            if s:
                self.samples.append((round(time.monotonic() - t0, 1), *s))
            self.stop.wait(1.0)

    # -- the offline references ------------------------------------------------------------
    def check_scores(self):
        from acarerank import PointwiseReranker, ScoreRequest, SetwiseReranker
        from acarerank.loading import load_reranker

        rr = load_reranker(PointwiseReranker, model=None, dtype="float32", device="cpu", backend=None,
                           max_length=8192, cache_budget_tokens=self.args.cache_budget)
        sr = SetwiseReranker(runner=rr.runner, tokenizer=rr.tokenizer, backend=rr.backend, max_length=16000,
                             max_new_tokens=64)
        worst = 0.0
        for body, resp in self.answers:
            kw = {}
            if "max_tokens_per_doc" in body:
                kw["max_doc_tokens"] = body["max_tokens_per_doc"]
            sent_docs = body["documents"] if "documents" in body else body["texts"]
            docs = [d["text"] if isinstance(d, dict) else d for d in sent_docs]
            enc = rr.encode(ScoreRequest(body["query"], docs, question=body.get("question"),
                                         trace=body.get("trace"), cache_salt=body.get("cache_salt")), **kw)
            want = rr.score_encodings([enc])[0][0]
            results = resp if isinstance(resp, list) else resp["results"]
            key = "score" if isinstance(resp, list) else "relevance_score"
            n = len(docs)
            if len(results) != min(n, body.get("top_n") or n):
                self.problem(f"{len(results)} results for {n} documents, top_n {body.get('top_n')}")
            got = [(-x[key], x["index"]) for x in results]
            if got != sorted(got):
                self.problem(f"results not best first (ties in input order): {got[:5]}...")
            for x in results:
                worst = max(worst, abs(x[key] - want[x["index"]]))
                if body.get("return_documents") or body.get("return_text"):
                    back = x.get("text") if isinstance(resp, list) else x.get("document")
                    want_back = sent_docs[x["index"]]
                    if isinstance(resp, dict) and isinstance(want_back, str):
                        want_back = {"text": want_back}
                    if back != want_back:
                        self.problem(f"result {x['index']} came back with document {str(back)[:80]!r}")
        if worst > TOL:
            self.problem(f"rerank scores: max |server - offline| = {worst:.3g} > {TOL}")
        for body, resp in self.selections:
            sel = sr.select(body["query"], body["documents"], max_select=body["max_select"],
                            cache_salt=body["cache_salt"])
            if list(sel.indices) != resp["indices"]:
                self.problem(f"select: server {resp['indices']} != offline {list(sel.indices)}")
        return worst

    # -- the run ---------------------------------------------------------------------------
    def run(self):
        a = self.args
        self.start()
        # the baseline: after requests of each kind, some at once, so that the pools' threads
        # (made on demand up to their size: tokenizer, parser; the event loop's default executor,
        # where /metrics renders, made its thread at the idle check's first scrape: 9 threads after
        # the load, 8 before, though none was made during it) exist already
        def warm(k):
            with httpx.Client(base_url=self.base, timeout=120) as c:
                c.post("/v1/rerank", json=dict(query=f"q{k}", documents=["a " * 200] * 8))
                c.post("/v1/select", json=dict(query=f"q{k}", documents=["a", "b"], max_select=1))
                c.get("/metrics")
        warmers = [threading.Thread(target=warm, args=(k,)) for k in range(a.max_queue)]
        for t in warmers:
            t.start()
        for t in warmers:
            t.join(300)
        time.sleep(1)
        base_sample = self.proc_sample()
        t_start = time.monotonic()
        threads = [threading.Thread(target=self.monitor, daemon=True)]
        threads += [threading.Thread(target=self.normal_client, args=(a.seed + k,), daemon=True)
                    for k in range(a.clients)]
        threads += [threading.Thread(target=self.chaos_client, args=(a.seed + 1000 + k,), daemon=True)
                    for k in range(a.chaos)]
        for t in threads:
            t.start()
        time.sleep(a.seconds)
        self.stop.set()
        for t in threads:
            t.join(180)
            if t.is_alive():
                self.problem(f"a client thread is still running 180 s after the stop: {t.name}")
        duration = time.monotonic() - t_start
        # idle: the abandoned requests' work is dropped at the next pass; give the engine a moment
        idle_names = ("acarerank_queue_tokens", "acarerank_requests_in_flight", "acarerank_queue_size",
                      "acarerank_requests_running")
        deadline = time.monotonic() + 60
        while True:
            m = self.metrics()
            gauges = {n: m[(n, ())] for n in idle_names}
            if not any(gauges.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        if any(gauges.values()):
            self.problem(f"gauges not idle 60 s after the load: {gauges}")
        for cache in ("rerank", "select"):   # each cache is bounded by the budget (docs/serving.md, "Metrics")
            resident = m.get(("acarerank_prefix_cache_resident_tokens", (("cache", cache),)), 0)
            budget = m.get(("acarerank_prefix_cache_budget_tokens", (("cache", cache),)), 0)
            if resident > budget:
                self.problem(f"{cache} prefix cache resident {resident} > budget {budget}")
        time.sleep(2)
        end_sample = self.proc_sample()
        # the pools make their threads on demand up to their size, so the count after warm-up may
        # still grow by a few: a leak is a count that keeps growing, past what the first quarter of
        # the load reached; descriptors must be back to their count after warm-up
        early = [s for s in self.samples if s[0] <= a.seconds / 4] or self.samples[:1]
        early_threads = max(s[2] for s in early)
        if end_sample[1] > max(early_threads, base_sample[1]):
            self.problem(f"{end_sample[1]} threads after the load, {early_threads} in its first quarter")
        if end_sample[2] > base_sample[2]:
            self.problem(f"{end_sample[2]} descriptors after the load, {base_sample[2]} after warm-up")
        # SIGTERM during a last burst: exit 0 within the drain timeout
        self.stop.clear()
        self.draining = True
        burst = [threading.Thread(target=self.normal_client, args=(a.seed + 5000 + k,), daemon=True)
                 for k in range(max(2, a.clients))]
        burst += [threading.Thread(target=self.chaos_client, args=(a.seed + 6000 + k,), daemon=True)
                  for k in range(a.chaos)]
        for t in burst:
            t.start()
        time.sleep(2)
        t_term = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        ready = None
        with contextlib.suppress(httpx.HTTPError):   # refused once uvicorn has stopped listening
            ready = httpx.get(self.base + "/ready", timeout=5).status_code
        if ready not in (None, 503):
            self.problem(f"/ready answered {ready} after SIGTERM (the drain: 503)")
        try:
            code = self.proc.wait(a.drain_timeout + 15)
        except subprocess.TimeoutExpired:
            code = None
            self.problem(f"no exit {a.drain_timeout + 15} s after SIGTERM (--drain-timeout {a.drain_timeout})")
            self.proc.kill()
            self.proc.wait(30)
        exit_s = time.monotonic() - t_term
        self.stop.set()
        for t in burst:
            t.join(130)
        if code not in (0, None):
            self.problem(f"exit status {code} after SIGTERM")
        worst = self.check_scores()
        self.log.seek(0)
        log = self.log.read()
        for bad in ("Traceback", "unhandled error"):
            if bad in log.replace("RuntimeError: injected into the scoring pass", ""):
                n = log.count(bad)
                self.problem(f"server log has {n} '{bad}' (see {a.log})")
        disconnects = sum(v for (n, _), v in m.items() if n == "acarerank_client_disconnects_total")
        return dict(command=self.cmd, client_disconnects_499=disconnects,
                    requests_cancelled=m.get(("acarerank_requests_cancelled_total", ())),
                    duration_s=round(duration, 1), exit_status=code, exit_s=round(exit_s, 2),
                    statuses={f"{k} {s}": n for (k, s), n in sorted(self.status.items(), key=str)},
                    checked_reranks=len(self.answers), checked_selections=len(self.selections),
                    max_score_diff=worst, baseline_rss_threads_fds=base_sample, end_rss_threads_fds=end_sample,
                    rss_kb_start_peak_end=(base_sample[0], max([end_sample[0]] + [s[1] for s in self.samples]),
                                           end_sample[0]),
                    rss_curve_kb=[(t, r) for t, r, _, _ in self.samples[::max(1, len(self.samples) // 20)]],
                    fds_curve=[(t, f) for t, _, _, f in self.samples[::max(1, len(self.samples) // 20)]],
                    threads_curve=[(t, n) for t, _, n, _ in self.samples[::max(1, len(self.samples) // 20)]],
                    prefix_cache_resident_budget=(resident, budget), problems=self.problems)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300.0, help="load duration (default 300)")
    p.add_argument("--quick", action="store_true", help="30 s, 3 + 2 clients, --max-queue 4, --max-queue-tokens "
                                                          "10000: a CI-sized run")
    p.add_argument("--clients", type=int, default=4, help="threads sending reranks and selections (default 4)")
    p.add_argument("--chaos", type=int, default=2, help="threads abandoning, reading slowly, sending bad "
                                                         "or oversized bodies (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-queue", type=int, default=6)
    p.add_argument("--max-queue-tokens", type=int, default=12000, help="0: the flag off (admission by count only)")
    p.add_argument("--request-timeout", type=float, default=8.0)
    p.add_argument("--max-body-bytes", type=int, default=512 * 1024)
    p.add_argument("--cache-budget", type=int, default=4096)
    p.add_argument("--drain-timeout", type=float, default=10.0)
    p.add_argument("--log", default="/tmp/soak_serve.log", help="the server's log (default /tmp/soak_serve.log)")
    p.add_argument("--json", help="write the figures here too")
    a = p.parse_args(argv)
    if a.quick:
        a.seconds, a.clients, a.chaos, a.max_queue, a.max_queue_tokens = 30.0, 3, 2, 4, 10000
    soak = Soak(a)
    try:
        out = soak.run()
    finally:
        if soak.proc is not None and soak.proc.poll() is None:
            soak.proc.kill()
            soak.proc.wait(30)
    text = json.dumps(out, indent=1, default=str)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
