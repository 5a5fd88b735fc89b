"""Serving benchmark: ``acarerank serve`` under load, beside the same requests offline and beside
any other rerank server (``--target NAME=URL``: vLLM, llama.cpp, TEI, another acarerank).

The acarerank server runs as its own process (the CLI, real HTTP on a free port); this process
is the load generator (``httpx.AsyncClient``) and, separately, the offline baseline on the same
weights (the embedded default model is seeded, so both processes hold identical weights; a peer
serves the same weights from the folder ``bench/peers/*.sh`` wrote, passed here as ``--model``).

Workloads (token counts measured with the real Qwen3 tokenizer):
  m3     independent ACARe M3 requests: sub-query 20, question 60, trace 1,500 tokens,
         ``--depth`` documents of 60–380 tokens; every request a different context.
  m0     independent M0 requests: the sub-query alone, ``--depth`` documents.
  agent  agent sessions (the prefix cache's workload): ``--steps`` calls per session,
         the trace growing by 600 tokens per call, question 60, ``--depth`` documents per
         call; one ``cache_salt`` per session; a session's calls are sequential (an agent
         waits for its reranker), different sessions run side by side.

With ``--target``, every server gets the same prompts: the context is folded into the query
text (``acarerank.benchmark.peers.fold_context``; the peers take no question or trace), for
acarerank too. Rounds use fresh documents and contexts (a new seed per load, level and round),
so no server is fed whole prompts it saw in an earlier round; targets take turns round by
round, so a load change on a shared machine hits all of them alike.

Loads:
  closed loop  C clients (C in ``--concurrency``), each sending its next request (or its
               session's next call) when the previous answer arrives;
  open loop    Poisson arrivals at ``--loads`` × capacity, capacity = the target's best
               closed-loop requests/s; latency counts from the scheduled arrival.
Offline (acarerank only, in the server's ``--dtype``, float32 by default): every request through
``PointwiseReranker.score_batch`` one by one, and all in one call (the throughput ceiling of
batching without a server), each from an empty prefix cache (its own ``cache_salt``).

Step 1, before anything is timed: score agreement. A fixed set of requests goes to every target
(all at once, so acarerank batches them) and is scored offline; the largest |target − offline|
is reported per target and checked (acarerank ≤ 1e-6 in float32, 2e-2 in bfloat16; peers ≤
``--peer-tolerance``); a target that disagrees is a FAIL in the report and the exit code, never
a silent row. During the timed rounds every target's scores are compared with acarerank's on
the same requests.

Reported per (target, workload, load): requests/s, documents/s, workload tokens/s (Σ of the
full, unshared prompt tokens: the same numerator for every target), p50/p90/p99 latency,
queue time (acarerank's ``x-queue-time``), the tokens the server says it processed
(``usage``: acarerank counts shared + segments once, vLLM and llama.cpp every full prompt),
prefix-cache hit tokens, errors, max |Δ score|, ``acarerank_speedup`` (acarerank's tokens/s
÷ this target's, same load), acarerank's ``model_busy``, and ``gflop_per_s``: the FLOPs of
scoring each request with its shared part computed once (``report.least_work_flops``: the
least work an exact server can do, what ``acarerank bench`` credits its peers with too; an agent
call's shared part past what it shares with its session's previous call, ``with_tokens``) ÷ wall
time, with ``peak_fraction`` = that ÷ the GEMM peak in ``--dtype`` at the model's layer shapes (``gemm_peak``, measured
before and after the loads, each shape's faster kept). End to end nothing beats the GEMMs it
is made of, so ``peak_fraction`` says how much faster any server could still be on this
machine. Writes ``serve.csv``, ``serve.txt`` and ``serve.png`` into ``--out``. Checks the CPU
targets of acarerank: closed loop at concurrency 16 ≥ 0.9× offline ``score_batch`` tokens/s;
at 70 % load p99 ≤ 3× p50; no errors.

    python bench/bench_serve.py                       # the full run (quiet machine)
    python bench/bench_serve.py --quick               # a smoke run with tiny sizes
    python bench/bench_serve.py --model DIR --target vllm=http://127.0.0.1:8001 \\
        --target llama=http://127.0.0.1:8002          # peers side by side (bench/peers/*.sh)
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field, replace

import httpx
import torch

from acarerank.benchmark.harness import max_abs_diff
from acarerank.benchmark.measure import machine_info, percentile, timed_call, wait_for_quiet_cpu
from acarerank.benchmark.gemm_peak import best_of, gemm_peak
from acarerank.benchmark.report import Shapes
from acarerank.benchmark.peers import Target, fold_context, parse_response, parse_target, request_body, resolve
from acarerank.benchmark.workload import MAX_DOCS, MAX_TEXT_TOKENS, WorkloadSpec, make_workload
from acarerank import malloc_tuning
from acarerank.server.config import DEFAULT_MAX_QUEUE
from acarerank.server.launch import serve_subprocess

TRACE_STEP_TOKENS = 600
OURS = "acarerank"           # the in-process acarerank server's target name
# acarerank served vs offline: fp32 runs the same kernels in the same order; bf16 GEMMs round by
# how a pass is blocked, and the server batches requests that offline scores one by one
OWN_TOLERANCE = {"float32": 1e-6, "bfloat16": 2e-2}
PEER_TOLERANCE = {"float32": 1e-2, "bfloat16": 5e-2}  # default --peer-tolerance (another engine's kernels)
PEER_TARGETS = {"vllm": 1.5, "llama.cpp": 2.0}  # acarerank ≥ this × the peer's throughput (docs/benchmarks.md)
NO_CAPACITY = "open: not run (no capacity)"  # the load of an open-loop row a target without capacity gets


@dataclass
class Req:
    """One rerank call: ACARe fields (query, question, trace, documents, cache_salt) in ``body``."""
    body: dict
    session: int = -1          # agent workload: session index (calls of one session are sequential)
    workload_tokens: int = 0   # Σ over documents of the full prompt's tokens
    flops: float = 0.0         # the least FLOPs of scoring it (with_tokens): shared part once, a session's reused


@dataclass
class Run:
    target: str
    workload: str
    load: str                  # "closed", "open" or "agreement"
    level: float               # concurrency, or fraction of capacity
    wall: float = 0.0
    latencies: list = field(default_factory=list)
    queue_times: list = field(default_factory=list)
    docs: int = 0
    workload_tokens: int = 0
    flops: float = 0.0
    server_tokens: int = 0
    cached_tokens: int = 0
    errors: int = 0
    scores: dict = field(default_factory=dict)  # request index -> scores
    max_diff: float = float("nan")
    model_seconds: float = 0.0  # acarerank's acarerank_model_seconds over the run

    def row(self) -> dict:
        ms = lambda xs, q: round(percentile(xs, q) * 1e3, 1) if xs else ""  # noqa: E731
        n, w = len(self.latencies), self.wall
        return dict(target=self.target, workload=self.workload, load=self.load, level=self.level,
                    requests=n + self.errors, req_per_s=round(n / w, 3) if w else 0.0,
                    docs_per_s=round(self.docs / w, 1) if w else 0.0,
                    tokens_per_s=round(self.workload_tokens / w, 1) if w else 0.0,
                    gflop_per_s=round(self.flops / w / 1e9, 3) if w else 0.0,
                    p50_ms=ms(self.latencies, 50), p90_ms=ms(self.latencies, 90), p99_ms=ms(self.latencies, 99),
                    queue_p50_ms=ms(self.queue_times, 50), queue_p90_ms=ms(self.queue_times, 90),
                    queue_p99_ms=ms(self.queue_times, 99), workload_tokens=self.workload_tokens,
                    server_tokens=self.server_tokens, cached_tokens=self.cached_tokens, errors=self.errors,
                    # acarerank's timed rows are the reference of the others' (its own check is the agreement row)
                    max_abs_diff="" if self.target == OURS and self.load != "agreement" else self.max_diff,
                    model_busy=round(self.model_seconds / w, 3) if w and self.model_seconds else "")


# -- workloads -------------------------------------------------------------------------------
def _prefix_by_tokens(tok, text: str, n: int) -> str:
    """The first ``n`` tokens of ``text`` (cut at a token's end offset)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    n = min(n, len(enc["input_ids"]))
    return text[:enc["offset_mapping"][n - 1][1]]


def m3_requests(tok, n: int, depth: int, seed: int, mode: str = "M3") -> list:
    out = []
    for i in range(n):
        w = make_workload(tok, WorkloadSpec(num_docs=depth, seed=seed + i))
        out.append(Req(dict(w.context(mode), documents=w.documents)))
    return out


def agent_requests(tok, sessions: int, steps: int, depth: int, seed: int) -> list:
    out = []
    for s in range(sessions):
        w = make_workload(tok, WorkloadSpec(trace_tokens=TRACE_STEP_TOKENS * steps, num_docs=depth * steps,
                                            seed=seed + 1000 + s))
        sub = make_workload(tok, WorkloadSpec(num_docs=1, trace_tokens=1, seed=seed + 2000 + s))
        for k in range(steps):
            out.append(Req(dict(query=f"{sub.query} (step {k + 1})", question=w.question,
                                trace=_prefix_by_tokens(tok, w.trace, TRACE_STEP_TOKENS * (k + 1)),
                                documents=w.documents[k * depth:(k + 1) * depth], cache_salt=f"session-{s}"),
                           session=s))
    return out


def folded(reqs: list) -> list:
    """``reqs`` with the context folded into the query (the prompt every server can take)."""
    return [Req(dict(r.body, query=fold_context(r.body["query"], r.body.get("question"), r.body.get("trace")),
                     question=None, trace=None), r.session) for r in reqs]


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token-id sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def with_tokens(tok, reqs: list, shapes=None) -> list:
    """Fill each request's workload tokens, Σ_i (shared + segment_i) of its full prompts, and (given
    the model's ``Shapes``) its FLOPs with the shared part computed once: the work every exact
    server must do at least, so FLOPs ÷ wall time is a rate comparable across servers and with
    the machine's GEMM peak (a server that recomputes the shared part per document spends more
    FLOPs than it is credited with).

    An agent session's call (``Req.session`` >= 0; ``reqs`` holds a session's calls in order) is
    credited with its shared tokens past the common prefix with the session's previous call, which
    an exact server keeps (``report.packed_flop_parts(..., cached=)``): crediting the whole shared
    part every call read 116 % of the GEMM peak (docs/benchmarks.md, "A server's GFLOP/s")."""
    from acarerank.benchmark.baselines import split_prompt_ids
    from acarerank.benchmark.report import packed_flop_parts

    previous = {}  # session -> the shared ids of its last call so far
    for r in reqs:
        shared, segs = split_prompt_ids(tok, r.body["query"], r.body["documents"], r.body.get("question"),
                                        r.body.get("trace"))
        r.workload_tokens = len(shared) * len(segs) + sum(len(s) for s in segs)
        cached = common_prefix(previous[r.session], shared) if r.session in previous else 0
        if r.session >= 0:
            previous[r.session] = shared
        if shapes is not None:
            r.flops = sum(packed_flop_parts(shapes, len(shared), [len(s) for s in segs], cached=cached).values())
    return reqs


class Workloads:
    """Fresh requests on demand: ``make(name, key)`` is seeded by (``--seed``, name, key), so a
    round gets documents no earlier round had and every target gets the same ones."""

    def __init__(self, tok, args, shapes=None):
        self.tok, self.args, self.fold, self.shapes = tok, args, bool(args.target), shapes
        self._keys: dict = {}

    def make(self, name: str, key: str) -> list:
        a = self.args
        idx = self._keys.setdefault((name, key), len(self._keys))
        seed = a.seed + 100_003 * idx  # far apart: request i of a round uses seed + i (+ 1000/2000 for sessions)
        if name == "agent":
            reqs = agent_requests(self.tok, a.sessions, a.steps, a.depth, seed)
        else:
            reqs = m3_requests(self.tok, a.requests, a.depth, seed, mode=name.upper())
        return with_tokens(self.tok, folded(reqs) if self.fold else reqs, self.shapes)


# -- offline ---------------------------------------------------------------------------------
def salted(reqs: list, run: str) -> list:
    """``reqs`` with every request in the prefix-cache namespace of ``run``: each measured run
    starts from an empty cache, so no run is served by the KV of an earlier one (an agent
    session's calls still share theirs: the salt keeps the session's name)."""
    return [replace(r, body=dict(r.body, cache_salt=f"{run}/{r.body.get('cache_salt') or ''}")) for r in reqs]


def _score_request(b):
    from acarerank import ScoreRequest

    return ScoreRequest(b["query"], b["documents"], b.get("question"), b.get("trace"), cache_salt=b.get("cache_salt"))


def offline(rr, reqs: list, repeats: int = 1) -> dict:
    """The same requests in this process: one by one, then all in one ``score_batch`` (the
    fastest of ``repeats`` runs), each run from an empty prefix cache (its own salt)."""
    device = rr.runner.device
    rr.score_batch([_score_request(r.body) for r in salted(reqs[:1], "offline-warm-up")])
    ones = salted(reqs, "offline-one-by-one")
    one, t_one = timed_call(lambda: [rr.score_batch([_score_request(r.body)])[0] for r in ones], device)
    t_batch = float("inf")
    for k in range(repeats):
        batch_reqs = salted(reqs, f"offline-score-batch-{k}")
        out, t = timed_call(lambda: rr.score_batch([_score_request(r.body) for r in batch_reqs]), device)
        if t < t_batch:
            batch, t_batch = out, t
    return dict(scores=one, one_by_one_s=t_one, score_batch_s=t_batch,
                batch_diff=_max_or_nan(max_abs_diff(a, b) for a, b in zip(one, batch)))


# -- load generators ---------------------------------------------------------------------------
async def _send(client, target: Target, req: Req, run: Run, index: int, t_arrival: float) -> None:
    b = req.body
    path, body = request_body(target.api, b["query"], b["documents"], b.get("question"), b.get("trace"),
                              b.get("cache_salt") if target.api == "acarerank" else None, target.model)
    try:
        r = await client.post(path, json=body)
    except httpx.HTTPError:
        run.errors += 1
        return
    done = time.perf_counter()
    try:
        if r.status_code != 200:
            raise ValueError(f"HTTP {r.status_code}")
        scores, tokens, cached = parse_response(target.api, r.json(), len(b["documents"]))
    except ValueError:
        run.errors += 1
        return
    run.latencies.append(done - t_arrival)
    if "x-queue-time" in r.headers:
        run.queue_times.append(float(r.headers["x-queue-time"]) / 1e3)
    run.docs += len(b["documents"])
    run.workload_tokens += req.workload_tokens
    run.flops += req.flops
    run.server_tokens += tokens or 0
    run.cached_tokens += cached
    run.scores[index] = scores


def _tls():
    """One TLS context for every client of the run: httpx builds a client's own from the CA bundle
    (~20 ms on a Xeon), and each measured load makes three clients (``measured``), a quarter of
    this script's CPU time in a small run."""
    global _TLS
    if _TLS is None:
        _TLS = httpx.create_ssl_context()
    return _TLS


_TLS = None


def _client(target: Target, connections):
    return httpx.AsyncClient(base_url=target.url, timeout=600, limits=httpx.Limits(max_connections=connections),
                             verify=_tls())


async def closed_loop(target: Target, reqs: list, concurrency: int, run: Run) -> None:
    # work units: single requests, or whole sessions (sequential calls)
    units: dict = {}
    for i, r in enumerate(reqs):
        units.setdefault(r.session if r.session >= 0 else -1 - i, []).append(i)
    queue = list(units.values())
    async with _client(target, concurrency) as c:
        async def worker():
            while queue:
                for i in queue.pop(0):
                    await _send(c, target, reqs[i], run, i, time.perf_counter())

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.wall = time.perf_counter() - t


async def open_loop(target: Target, reqs: list, rate: float, run: Run, seed: int) -> None:
    rng = random.Random(seed)
    async with _client(target, None) as c:
        t0 = time.perf_counter()
        tasks, at = [], 0.0
        for i, r in enumerate(reqs):
            at += rng.expovariate(rate)
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(c, target, r, run, i, t0 + at)))
        await asyncio.gather(*tasks)
        run.wall = time.perf_counter() - t0


def model_seconds(target: Target) -> float:
    """acarerank's ``acarerank_model_seconds`` (all kinds): time its model thread was busy; 0 elsewhere."""
    if target.api != "acarerank":
        return 0.0
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(target.url + "/metrics", timeout=30, verify=_tls()).text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "acarerank_model_seconds"
               for s in fam.samples if s.name.endswith("_total"))


def measured(target: Target, run: Run, coro) -> Run:
    """Run ``coro`` (a load) and record the server's model-busy seconds over it."""
    before = model_seconds(target)
    asyncio.run(coro)
    run.model_seconds = model_seconds(target) - before
    return run


def _max_or_nan(diffs) -> float:
    """The largest of ``diffs``; NaN when there is none or any is NaN (``max`` keeps a NaN only
    when it comes first, so a NaN score in a later request would read as agreement)."""
    diffs = list(diffs)
    return float("nan") if not diffs or any(d != d for d in diffs) else max(diffs)


def diff_vs(run: Run, reference: dict) -> float:
    """max |Δ| over the requests both answered; NaN when none, or when a score is NaN (never silently 0)."""
    common = [i for i in run.scores if i in reference]
    return _max_or_nan(max_abs_diff(run.scores[i], reference[i]) for i in common)


# -- the steps -----------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded random model)")
    ap.add_argument("--target", action="append", default=[], type=parse_target, metavar="NAME=[API@]URL",
                    help="another rerank server to drive beside acarerank (repeatable); API: acarerank, vllm, "
                         "llama.cpp, tei (default: asked from the server)")
    ap.add_argument("--workloads", nargs="+", default=["m3", "agent"], choices=["m0", "m3", "agent"])
    ap.add_argument("--requests", type=int, default=24, help="m0/m3: requests per run")
    ap.add_argument("--depth", type=int, default=20, help="documents per request")
    ap.add_argument("--sessions", type=int, default=8, help="agent: sessions per run")
    ap.add_argument("--steps", type=int, default=4, help="agent: calls per session")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--loads", type=float, nargs="*", default=[0.5, 0.7, 0.9])
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of offline score_batch and rounds of each closed loop; the fastest counts (a "
                         "shared 2-core VM only ever slows a run down)")
    ap.add_argument("--settle-s", type=float, default=5.0,
                    help="before each target's closed-loop round, wait up to this long for idle CPUs (a server "
                         "may still be busy after its last answer; 0: do not wait)")
    ap.add_argument("--agreement-requests", type=int, default=4,
                    help="requests (agent: sessions) of the score-agreement step, per workload")
    ap.add_argument("--dtype", choices=sorted(OWN_TOLERANCE), default="float32",
                    help="weights and activations of acarerank (server and offline); start the peers in the "
                         "same dtype (vllm_cpu.sh --dtype)")
    ap.add_argument("--peer-tolerance", type=float, default=None,
                    help="largest |peer − acarerank offline| score accepted (default 1e-2 in float32: llama.cpp "
                         "f32 ~1e-3, q8_0 ~7e-3; 5e-2 in bfloat16)")
    ap.add_argument("--malloc", choices=malloc_tuning.CHOICES, default="tuned",
                    help="glibc's malloc in this process and in the server it starts, as acarerank serve's "
                         "--malloc (default tuned: the offline rows then run as the server does, freed blocks "
                         "kept and 4,096-token CPU passes; default: glibc as it is, 2,048)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/serve")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 requests of depth 4, 2 sessions of 2 steps")
    args = ap.parse_args(argv)
    if args.peer_tolerance is None:
        args.peer_tolerance = PEER_TOLERANCE[args.dtype]
    if args.quick:
        args.requests, args.depth, args.sessions, args.steps = 4, 4, 2, 2
        args.concurrency, args.loads, args.repeats, args.agreement_requests = [1, 4], [0.7], 1, 2
    for flag in ("requests", "depth", "sessions", "steps", "repeats", "agreement_requests", "max_batch_tokens"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    # the caps of `acarerank bench` (docs/benchmarks.md): every request is built in memory before
    # anything is timed, so a typo (--depth 1000000) would build a million documents first
    count = "(the cap of `acarerank bench` on a count: the server's documents per request)"
    for flag, cap, what in (("depth", MAX_DOCS, "documents (the server's documents per request)"),
                            ("requests", MAX_DOCS, count), ("sessions", MAX_DOCS, count),
                            ("repeats", MAX_DOCS, count), ("agreement_requests", MAX_DOCS, count),
                            ("steps", MAX_TEXT_TOKENS // TRACE_STEP_TOKENS,
                             f"(a session's whole trace, {TRACE_STEP_TOKENS} tokens a step, at most "
                             f"{MAX_TEXT_TOKENS:,} tokens: Qwen3-Reranker's context length)")):
        if getattr(args, flag) > cap:
            ap.error(f"--{flag.replace('_', '-')} must be at most {cap:,} {what}, got {getattr(args, flag):,}")
    if any(c < 1 for c in args.concurrency):
        ap.error(f"--concurrency values must be >= 1, got {args.concurrency}")
    # a closed loop runs one client task per unit of concurrency; past the queue of the server this
    # script starts (serve --max-queue), the extra clients' requests are answered 429: errors, not load
    if max(args.concurrency) > DEFAULT_MAX_QUEUE:
        ap.error(f"--concurrency values must be at most {DEFAULT_MAX_QUEUE:,} (the requests the acarerank server "
                 f"admits at once, serve --max-queue), got {max(args.concurrency):,}")
    if not all(0 < f < math.inf for f in args.loads):  # a rate of 0 or NaN has no Poisson arrivals
        ap.error(f"--loads fractions must be > 0 and finite, got {args.loads}")
    if not 0 <= args.settle_s <= 60:
        ap.error(f"--settle-s must be in [0, 60], got {args.settle_s}")
    if not 0 <= args.peer_tolerance < math.inf:
        ap.error(f"--peer-tolerance must be a number >= 0, got {args.peer_tolerance}")
    names = [t.name for t in args.target]
    if OURS in names or len(set(names)) != len(names):
        ap.error(f"--target names must be unique and not {OURS!r} (the server this script starts)")
    return args


def load_offline(args):
    """(tokenizer, PointwiseReranker) on the model the acarerank server will load."""
    from acarerank import PointwiseReranker
    from acarerank.model.default import build_default_model
    from acarerank.tokenizer import load_qwen3_tokenizer

    tok = load_qwen3_tokenizer()
    # the dtype the server is started with: "auto" would pick bf16 on a CPU with native bf16
    rr = PointwiseReranker.from_pretrained(args.model, dtype=args.dtype) if args.model else \
        PointwiseReranker(model=build_default_model().to(getattr(torch, args.dtype)), tokenizer=tok)
    return tok, rr


def offline_rows(rr, workloads: Workloads, args) -> list:
    rows = []
    for name in args.workloads:
        reqs = workloads.make(name, "offline")
        log(f"[offline] {name}: {len(reqs)} requests")
        off = offline(rr, reqs, args.repeats)
        docs = sum(len(r.body["documents"]) for r in reqs)
        tokens = sum(r.workload_tokens for r in reqs)
        flops = sum(r.flops for r in reqs)
        for label, secs in (("offline one-by-one", off["one_by_one_s"]), ("offline score_batch", off["score_batch_s"])):
            rows.append(dict(target=OURS, workload=name, load=label, level="", requests=len(reqs),
                             req_per_s=round(len(reqs) / secs, 3), docs_per_s=round(docs / secs, 1),
                             tokens_per_s=round(tokens / secs, 1), gflop_per_s=round(flops / secs / 1e9, 3),
                             workload_tokens=tokens,
                             max_abs_diff=off["batch_diff"] if "batch" in label else 0.0))
            log(table(rows[-1:]).splitlines()[-1])
    return rows


def resolve_targets(ours: str, extra: list) -> tuple:
    """([Target], {name: version}) with acarerank first and every API known."""
    targets, versions = [Target(OURS, ours, "acarerank")], {OURS: ""}
    for t in extra:
        t, versions[t.name] = resolve(t)
        if t.api == "vllm" and t.model is None:
            from acarerank.benchmark.peers import served_model

            t = replace(t, model=served_model(t.url))
        targets.append(t)
        log(f"[target] {t.name}: {t.api} {versions[t.name]} at {t.url}")
    return targets, versions


def agreement_rows(rr, targets: list, workloads: Workloads, args) -> list:
    """Step 1: every target scores the same small set (sent at once) and is compared with offline."""
    rows = []
    for name in args.workloads:
        a = args.agreement_requests
        reqs = workloads.make(name, "agreement")
        reqs = [r for r in reqs if r.session < a] if name == "agent" else reqs[:a]
        reqs = salted(reqs, "agreement")
        reference = {i: rr.score_batch([_score_request(r.body)])[0] for i, r in enumerate(reqs)}
        for t in targets:
            run = Run(t.name, name, "agreement", len(reqs))
            units = len({r.session if r.session >= 0 else -1 - i for i, r in enumerate(reqs)})
            measured(t, run, closed_loop(t, reqs, units, run))
            run.max_diff = diff_vs(run, reference)
            rows.append(run.row())
            log(f"[agreement] {name} {t.name}: max |score - offline acarerank| {run.max_diff:.3g} "
                f"over {len(run.scores)} of {len(reqs)} requests, {run.errors} errors")
    return rows


def _fastest(runs: list) -> Run:
    """The round of the highest workload tokens/s (rounds have fresh requests of different sizes:
    the smallest wall time was the lightest round, not the fastest), a round with errors last;
    its errors and |Δ score| those of every round."""
    run = max(runs, key=lambda r: r.workload_tokens / r.wall if r.wall > 0 and not r.errors else -math.inf)
    run.errors = sum(r.errors for r in runs)
    # NaN when a round's scores were NaN or missing: its errors are counted, its scores not hidden
    run.max_diff = _max_or_nan(r.max_diff for r in runs)
    return run


def closed_rows(targets: list, workloads: Workloads, args) -> tuple:
    """Closed loops, targets interleaved round by round on each round's fresh requests;
    returns (rows, {(target, workload): best req/s})."""
    rows, best = [], {}
    for name in args.workloads:
        for c in args.concurrency:
            runs = {t.name: [] for t in targets}
            for k in range(args.repeats):
                reqs = salted(workloads.make(name, f"closed-{c}-{k}"), f"closed-{c}-{k}")
                for t in targets:
                    log(f"[closed] {name} concurrency {c} round {k + 1} of {args.repeats}: {t.name}")
                    waited, quiet = wait_for_quiet_cpu(args.settle_s) if args.settle_s > 0 else (0.0, True)
                    if not quiet:
                        log(f"note: {t.name}'s round starts on busy CPUs (not idle after {waited:.1f} s)")
                    runs[t.name].append(_closed(t, name, reqs, c))
                ours = runs[OURS][-1].scores
                for t in targets[1:]:
                    runs[t.name][-1].max_diff = diff_vs(runs[t.name][-1], ours)
            for t in targets:
                # the open loops' capacity: the best requests/s of any round, whichever round the
                # row reports (the highest token rate's need not be it)
                rates = [r.row()["req_per_s"] for r in runs[t.name] if not r.errors]
                run = _fastest(runs[t.name])
                rows.append(run.row())
                log(table(rows[-1:]).splitlines()[-1])
                best[(t.name, name)] = max(best.get((t.name, name), 0.0), rows[-1]["req_per_s"], *rates)
    return rows, best


def _closed(t: Target, name: str, reqs: list, c: int) -> Run:
    run = Run(t.name, name, "closed", c)
    return measured(t, run, closed_loop(t, reqs, c, run))


def open_rows(targets: list, workloads: Workloads, best: dict, args) -> list:
    """Open loops at each fraction of each target's own capacity, targets one after the other.
    A target without capacity (no closed-loop request succeeded) gets a ``NO_CAPACITY`` row
    instead, which ``checks`` fails."""
    rows = []
    for name in args.workloads:
        for f in args.loads:
            reqs = salted(workloads.make(name, f"open-{f}"), f"open-{f}")
            runs = {}
            for t in targets:
                capacity = best[(t.name, name)]
                if not capacity > 0:
                    log(f"[open] {name} {f:.0%}: {t.name} skipped, capacity 0 req/s (no closed-loop request "
                        "succeeded)")
                    continue
                log(f"[open] {name} {f:.0%} of {capacity:.2f} req/s: {t.name}")
                run = Run(t.name, name, "open", f)
                runs[t.name] = measured(t, run, open_loop(t, reqs, f * capacity, run, args.seed))
            reference = runs[OURS].scores if OURS in runs else {}
            for t in targets:
                if t.name not in runs:
                    rows.append(dict(target=t.name, workload=name, load=NO_CAPACITY, level=f))
                    continue
                if t.name != OURS:
                    runs[t.name].max_diff = diff_vs(runs[t.name], reference)
                rows.append(runs[t.name].row())
                log(table(rows[-1:]).splitlines()[-1])
    return rows


def add_speedups(rows: list, peak_gflops: float = 0.0) -> None:
    """acarerank_speedup = acarerank's tokens/s ÷ the target's, at the same (workload, load, level);
    peak_fraction = the row's GFLOP/s ÷ the GEMM peak measured in this run (when measured)."""
    for r in rows:
        if peak_gflops > 0 and r.get("gflop_per_s"):
            r["peak_fraction"] = round(r["gflop_per_s"] / peak_gflops, 3)
    ours = {(r["workload"], r["load"], r["level"]): r["tokens_per_s"] for r in rows if r["target"] == OURS}
    for r in rows:
        base = ours.get((r["workload"], r["load"], r["level"]))
        if r["load"] in ("closed", "open") and base and r.get("tokens_per_s"):
            r["acarerank_speedup"] = round(base / r["tokens_per_s"], 3)


# -- report ----------------------------------------------------------------------------------
COLUMNS = ["target", "workload", "load", "level", "requests", "req_per_s", "docs_per_s", "tokens_per_s",
           "gflop_per_s", "peak_fraction", "p50_ms",
           "p90_ms", "p99_ms", "queue_p50_ms", "queue_p90_ms", "queue_p99_ms", "workload_tokens", "server_tokens",
           "cached_tokens", "errors", "max_abs_diff", "acarerank_speedup", "model_busy"]


def table(rows: list) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def checks(rows: list, targets: list, args) -> tuple:
    """(all passed, report lines): acarerank's CPU targets, and every target's agreement and errors."""
    lines, ok = [], True

    def check(what, passed, detail, prefix):
        nonlocal ok
        ok &= bool(passed)
        lines.append(f"{prefix}: {'PASS' if passed else 'FAIL'} {what} ({detail})")

    for name in args.workloads:
        sel = lambda t, load: [r for r in rows if r["target"] == t and r["workload"] == name and r["load"] == load]  # noqa: E731
        batch = sel(OURS, "offline score_batch")[0]
        for t in targets:
            tol = OWN_TOLERANCE[args.dtype] if t.api == "acarerank" else args.peer_tolerance
            agree = sel(t.name, "agreement")[0]
            diff = agree["max_abs_diff"]
            check(f"scores agree with offline acarerank (<= {tol:g})", diff == diff and diff <= tol,
                  f"max |diff| {diff:.2g}", f"{name} {t.name}")
            errors = sum(r.get("errors", 0) or 0 for r in rows if r["target"] == t.name and r["workload"] == name)
            check("zero errors", errors == 0, f"{errors} errors", f"{name} {t.name}")
            skipped = len(sel(t.name, NO_CAPACITY))
            if skipped:
                check("open loops ran", False, f"{skipped} not run: no closed-loop request succeeded",
                      f"{name} {t.name}")
        c16 = [r for r in sel(OURS, "closed") if r["level"] == 16]
        if c16:
            ratio = c16[0]["tokens_per_s"] / batch["tokens_per_s"]
            check("concurrency 16 >= 0.9x offline score_batch (tokens/s)", ratio >= 0.9, f"{ratio:.2f}x",
                  f"{name} {OURS}")
        o70 = [r for r in sel(OURS, "open") if r["level"] == 0.7]
        if o70 and o70[0]["p50_ms"]:
            ratio = o70[0]["p99_ms"] / o70[0]["p50_ms"]
            check("70 % load: p99 <= 3x p50", ratio <= 3.0, f"{ratio:.2f}x", f"{name} {OURS}")
        for t in targets[1:]:  # information, not a pass/fail of this run: one quiet run decides (docs/benchmarks.md)
            for r in sel(t.name, "closed"):
                want = PEER_TARGETS.get(t.api)
                sp = r.get("acarerank_speedup")
                if sp:
                    lines.append(f"{name} {t.name}: acarerank is {sp:.2f}x {t.name} ({t.api}) at concurrency "
                                 f"{r['level']}" + (f" (target >= {want}x: {'met' if sp >= want else 'NOT met'})"
                                                    if want else ""))
    return ok, lines


def plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    targets = list(dict.fromkeys(r["target"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for ti, t in enumerate(targets):
            color = f"C{ti}"
            pts = sorted((r["req_per_s"], r["p50_ms"], r["p99_ms"], r["load"], r["level"]) for r in rows
                         if r["workload"] == w and r["target"] == t and r["load"] in ("closed", "open"))
            for load, marker in (("closed", "o"), ("open", "s")):
                sel = [p for p in pts if p[3] == load]
                if sel:
                    ax.plot([p[0] for p in sel], [p[1] for p in sel], marker=marker, color=color,
                            label=f"{t} {load} p50")
                    ax.plot([p[0] for p in sel], [p[2] for p in sel], marker=marker, color=color, linestyle="--",
                            label=f"{t} {load} p99")
                    for p in sel:
                        ax.annotate(f"{p[4]:g}" if load == "closed" else f"{p[4]:.0%}", (p[0], p[2]), fontsize=7)
        for r in rows:
            if r["workload"] == w and r["load"] == "offline score_batch":
                ax.axvline(r["req_per_s"], color="gray", linestyle=":", label="acarerank offline score_batch")
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{w}: latency vs load")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_report(rows: list, targets: list, versions: dict, args, peak: dict = None) -> int:
    meta = dict(machine_info(torch.device("cpu")), model=args.model or "embedded default (random weights)",
                gemm_peak=peak,
                targets={t.name: dict(api=t.api, url=t.url, version=versions.get(t.name, "")) for t in targets},
                prompts="context folded into the query for every target" if args.target else "ACARe fields",
                args={k: v for k, v in vars(args).items() if k != "target"})
    with open(os.path.join(args.out, "serve.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})
    ok, lines = checks(rows, targets, args)
    report = "\n".join([json.dumps(meta), "", table(rows), ""] + lines)
    print(report)
    with open(os.path.join(args.out, "serve.txt"), "w") as f:
        f.write(report + "\n")
    try:
        plot(rows, os.path.join(args.out, "serve.png"))
    except ImportError as e:  # matplotlib is the `bench` extra; the table stands without it
        log(f"no serve.png ({e}; pip install matplotlib)")
    return 0 if ok else 1


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # before the offline model's first allocation, so its rows and the server's run alike
    log(f"[bench_serve] malloc {malloc_tuning.apply(args.malloc)}")
    tok, rr = load_offline(args)
    shapes = Shapes.from_arch(rr.runner.arch)
    dtype = getattr(torch, args.dtype)
    peak = gemm_peak(shapes, dtype)  # this process, all cores, before acarerank's server starts
    workloads = Workloads(tok, args, shapes)
    rows = offline_rows(rr, workloads, args)
    cli = (["--dtype", args.dtype, "--malloc", args.malloc]
           + (["--max-batch-tokens", str(args.max_batch_tokens)] if args.max_batch_tokens else [])
           + (["--model", args.model] if args.model else []))
    with serve_subprocess(*cli, omp_threads=None) as (base, _proc):  # all cores, as offline
        targets, versions = resolve_targets(base, args.target)
        rows += agreement_rows(rr, targets, workloads, args)
        closed, best = closed_rows(targets, workloads, args)
        rows += closed
        rows += open_rows(targets, workloads, best, args)
    # again after the loads (every server idle): a peer still warming up at the start slowed the first
    peak = best_of(peak, gemm_peak(shapes, dtype))
    log(f"[peak] {args.dtype} GEMM peak at the model's layer shapes: {peak['peak_gflops']:.1f} GFLOP/s "
        f"({', '.join(f'{k} {v:.0f}' for k, v in peak['per_shape'].items())})")
    add_speedups(rows, peak["peak_gflops"])
    return write_report(rows, targets, versions, args, peak)


if __name__ == "__main__":
    sys.exit(main())
