"""Serving benchmark: ``acarerank serve`` under load, beside the same requests run offline.

The server runs as its own process (the CLI, real HTTP on a free port); this process is the
load generator (``httpx.AsyncClient``) and, separately, the offline baseline on the same
weights (the embedded default model is seeded, so both processes hold identical weights).

Workloads (token counts measured with the real Qwen3 tokenizer):
  m3     independent ACARe M3 requests: sub-query 20, question 60, trace 1,500 tokens,
         ``--depth`` documents of 60–380 tokens; every request a different context.
  agent  agent sessions (the prefix-cache issue's workload): ``--steps`` calls per session,
         the trace growing by 600 tokens per call, question 60, ``--depth`` documents per
         call; one ``cache_salt`` per session; a session's calls are sequential (an agent
         waits for its reranker), different sessions run side by side.

Loads:
  closed loop  C clients (C in ``--concurrency``), each sending its next request (or its
               session's next call) when the previous answer arrives;
  open loop    Poisson arrivals at ``--loads`` × capacity, capacity = the best closed-loop
               requests/s; latency counts from the scheduled arrival, so queueing shows.
Both run in float32 (the score check needs the same dtype). Offline: every request through
``PointwiseReranker.score_batch`` one by one, and all of them in one ``score_batch`` call (the
throughput ceiling of batching without a server). Every run, offline and served, starts from
an empty prefix cache (its own ``cache_salt``), so no run is fed by the KV of an earlier one.

Reported per run: requests/s, documents/s, p50/p90/p99 latency and queue time (the server's
``x-queue-time`` header), prefix-cache hit tokens (``usage.cached_tokens``), errors, and the
largest |server − offline| score difference, and ``model_busy``: the share of the run's wall
time the server's model thread spent in model calls (its ``acarerank_model_seconds``). Writes ``serve.csv``, ``serve.txt`` (the table)
and ``serve.png`` (latency vs load) into ``--out``. Checks the CPU targets: closed loop at
concurrency 16 ≥ 0.9× offline ``score_batch`` throughput; at 70 % load p99 ≤ 3× p50; no errors.

    python bench/bench_serve.py                       # the full run (quiet machine)
    python bench/bench_serve.py --quick               # a smoke run with tiny sizes
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from acarerank.benchmark.harness import max_abs_diff
from acarerank.benchmark.measure import machine_info, percentile, timed_call
from acarerank.benchmark.workload import WorkloadSpec, make_workload
from acarerank.server.launch import serve_subprocess

TRACE_STEP_TOKENS = 600


@dataclass
class Req:
    body: dict
    session: int = -1          # agent workload: session index (calls of one session are sequential)


@dataclass
class Run:
    workload: str
    load: str                  # "closed" or "open"
    level: float               # concurrency, or fraction of capacity
    wall: float = 0.0
    latencies: list = field(default_factory=list)
    queue_times: list = field(default_factory=list)
    docs: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    errors: int = 0
    max_diff: float = 0.0
    model_seconds: float = 0.0  # the server's acarerank_model_seconds over the run

    def row(self) -> dict:
        ms = lambda xs, q: round(percentile(xs, q) * 1e3, 1)  # noqa: E731
        n = len(self.latencies)
        return dict(workload=self.workload, load=self.load, level=self.level, requests=n + self.errors,
                    req_per_s=round(n / self.wall, 3) if self.wall else 0.0,
                    docs_per_s=round(self.docs / self.wall, 1) if self.wall else 0.0,
                    p50_ms=ms(self.latencies, 50), p90_ms=ms(self.latencies, 90), p99_ms=ms(self.latencies, 99),
                    queue_p50_ms=ms(self.queue_times, 50), queue_p90_ms=ms(self.queue_times, 90),
                    queue_p99_ms=ms(self.queue_times, 99), cached_tokens=self.cached_tokens,
                    prompt_tokens=self.prompt_tokens, errors=self.errors, max_abs_diff=self.max_diff,
                    model_busy=round(self.model_seconds / self.wall, 3) if self.wall and self.model_seconds else "")


# -- workloads -------------------------------------------------------------------------------
def _prefix_by_tokens(tok, text: str, n: int) -> str:
    """The first ``n`` tokens of ``text`` (cut at a token's end offset)."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    n = min(n, len(enc["input_ids"]))
    return text[:enc["offset_mapping"][n - 1][1]]


def m3_requests(tok, n: int, depth: int, seed: int) -> list:
    out = []
    for i in range(n):
        w = make_workload(tok, WorkloadSpec(num_docs=depth, seed=seed + i))
        out.append(Req(dict(query=w.query, question=w.question, trace=w.trace, documents=w.documents)))
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


# -- offline ---------------------------------------------------------------------------------
def salted(reqs: list, run: str) -> list:
    """``reqs`` with every request in the prefix-cache namespace of ``run``: each measured run
    starts from an empty cache, so no run is served by the KV of an earlier one (an agent
    session's calls still share theirs: the salt keeps the session's name)."""
    out = []
    for r in reqs:
        salt = f"{run}/{r.body.get('cache_salt', '')}"
        out.append(Req(dict(r.body, cache_salt=salt), r.session))
    return out


def offline(rr, reqs: list, repeats: int = 1) -> dict:
    """The same requests in this process: one by one, then all in one ``score_batch`` (the
    fastest of ``repeats`` runs), each run from an empty prefix cache (its own salt)."""
    from acarerank import ScoreRequest

    def request(b):
        return ScoreRequest(b["query"], b["documents"], b.get("question"), b.get("trace"),
                            cache_salt=b.get("cache_salt"))

    device = rr.runner.device
    rr.score_batch([request(r.body) for r in salted(reqs[:1], "offline-warm-up")])
    ones = salted(reqs, "offline-one-by-one")
    one, t_one = timed_call(lambda: [rr.score_batch([request(r.body)])[0] for r in ones], device)
    t_batch = float("inf")
    for k in range(repeats):
        batch_reqs = salted(reqs, f"offline-score-batch-{k}")
        out, t = timed_call(lambda: rr.score_batch([request(r.body) for r in batch_reqs]), device)
        if t < t_batch:
            batch, t_batch = out, t
    return dict(scores=one, one_by_one_s=t_one, score_batch_s=t_batch,
                batch_diff=max(max_abs_diff(a, b) for a, b in zip(one, batch)))


# -- load generators ---------------------------------------------------------------------------
async def _send(client, req: Req, run: Run, reference: list, index: int, t_arrival: float) -> None:
    try:
        r = await client.post("/v1/rerank", json=req.body)
    except httpx.HTTPError:
        run.errors += 1
        return
    done = time.perf_counter()
    if r.status_code != 200:
        run.errors += 1
        return
    out = r.json()
    run.latencies.append(done - t_arrival)
    run.queue_times.append(float(r.headers.get("x-queue-time", "nan")) / 1e3)
    run.docs += len(req.body["documents"])
    run.cached_tokens += out["usage"].get("cached_tokens", 0)
    run.prompt_tokens += out["usage"]["prompt_tokens"]
    got = {x["index"]: x["relevance_score"] for x in out["results"]}
    run.max_diff = max(run.max_diff, max_abs_diff([got[i] for i in range(len(got))], reference[index]))


async def closed_loop(base: str, reqs: list, reference: list, concurrency: int, run: Run) -> None:
    # work units: single requests, or whole sessions (sequential calls)
    units: dict = {}
    for i, r in enumerate(reqs):
        units.setdefault(r.session if r.session >= 0 else -1 - i, []).append(i)
    queue = list(units.values())
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=concurrency)) as c:
        async def worker():
            while queue:
                for i in queue.pop(0):
                    await _send(c, reqs[i], run, reference, i, time.perf_counter())

        t = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        run.wall = time.perf_counter() - t


async def open_loop(base: str, reqs: list, reference: list, rate: float, run: Run, seed: int) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        t0 = time.perf_counter()
        tasks, at = [], 0.0
        for i, r in enumerate(reqs):
            at += rng.expovariate(rate)
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_send(c, r, run, reference, i, t0 + at)))
        await asyncio.gather(*tasks)
        run.wall = time.perf_counter() - t0


# -- report ----------------------------------------------------------------------------------
COLUMNS = ["workload", "load", "level", "requests", "req_per_s", "docs_per_s", "p50_ms", "p90_ms", "p99_ms",
           "queue_p50_ms", "queue_p90_ms", "queue_p99_ms", "cached_tokens", "prompt_tokens", "errors",
           "max_abs_diff", "model_busy"]


def model_seconds(base: str) -> float:
    """The server's ``acarerank_model_seconds`` (all kinds): time its model thread was busy."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) if fam.name == "acarerank_model_seconds"
               for s in fam.samples if s.name.endswith("_total"))


def measured(base: str, run: "Run", coro) -> None:
    """Run ``coro`` (a load) and record the server's model-busy seconds over it."""
    before = model_seconds(base)
    asyncio.run(coro)
    run.model_seconds = model_seconds(base) - before


def table(rows: list) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        pts = sorted((r["req_per_s"], r["p50_ms"], r["p99_ms"], r["load"], r["level"]) for r in rows
                     if r["workload"] == w and r["load"] in ("closed", "open"))
        for load, marker in (("closed", "o"), ("open", "s")):
            sel = [p for p in pts if p[3] == load]
            if sel:
                ax.plot([p[0] for p in sel], [p[1] for p in sel], marker=marker, label=f"{load} loop p50")
                ax.plot([p[0] for p in sel], [p[2] for p in sel], marker=marker, linestyle="--",
                        label=f"{load} loop p99")
                for p in sel:
                    ax.annotate(f"{p[4]:g}" if load == "closed" else f"{p[4]:.0%}", (p[0], p[2]), fontsize=7)
        for r in rows:
            if r["workload"] == w and r["load"] == "offline score_batch":
                ax.axvline(r["req_per_s"], color="gray", linestyle=":", label="offline score_batch")
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{w}: latency vs load")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="HF checkpoint folder (default: the embedded random model)")
    ap.add_argument("--workloads", nargs="+", default=["m3", "agent"], choices=["m3", "agent"])
    ap.add_argument("--requests", type=int, default=24, help="m3: requests per run")
    ap.add_argument("--depth", type=int, default=20, help="documents per request")
    ap.add_argument("--sessions", type=int, default=8, help="agent: sessions per run")
    ap.add_argument("--steps", type=int, default=4, help="agent: calls per session")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.7, 0.9])
    ap.add_argument("--max-batch-tokens", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2,
                    help="runs of offline score_batch and of each closed loop; the fastest counts (a shared "
                         "2-core VM only ever slows a run down)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/serve")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 requests of depth 4, 2 sessions of 2 steps")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.depth, args.sessions, args.steps = 4, 4, 2, 2
        args.concurrency, args.loads, args.repeats = [1, 4], [0.7], 1
    os.makedirs(args.out, exist_ok=True)

    import torch

    from acarerank import PointwiseReranker
    from acarerank.model.default import build_default_model
    from acarerank.tokenizer import load_qwen3_tokenizer

    tok = load_qwen3_tokenizer()
    rr = PointwiseReranker.from_pretrained(args.model) if args.model else \
        PointwiseReranker(model=build_default_model(), tokenizer=tok)
    workloads = {}
    if "m3" in args.workloads:
        workloads["m3"] = m3_requests(tok, args.requests, args.depth, args.seed)
    if "agent" in args.workloads:
        workloads["agent"] = agent_requests(tok, args.sessions, args.steps, args.depth, args.seed)

    rows = []
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    refs = {}
    for name, reqs in workloads.items():
        log(f"[offline] {name}: {len(reqs)} requests")
        off = offline(rr, reqs, args.repeats)
        refs[name] = off["scores"]
        docs = sum(len(r.body["documents"]) for r in reqs)
        for label, secs in (("offline one-by-one", off["one_by_one_s"]), ("offline score_batch", off["score_batch_s"])):
            rows.append(dict(workload=name, load=label, level="", requests=len(reqs),
                             req_per_s=round(len(reqs) / secs, 3), docs_per_s=round(docs / secs, 1),
                             max_abs_diff=off["batch_diff"] if "batch" in label else 0.0))
            log(table(rows[-1:]).splitlines()[-1])

    cli = ["--dtype", "float32"]
    if args.max_batch_tokens:
        cli += ["--max-batch-tokens", str(args.max_batch_tokens)]
    if args.model:
        cli += ["--model", args.model]
    with serve_subprocess(*cli, omp_threads=None) as (base, _proc):  # all cores, as offline
        for name, reqs in workloads.items():
            best = 0.0
            for c in args.concurrency:
                runs = []
                for k in range(args.repeats):  # the fastest run counts, as offline
                    log(f"[closed] {name} concurrency {c} (run {k + 1} of {args.repeats})")
                    runs.append(Run(name, "closed", c))
                    measured(base, runs[-1], closed_loop(base, salted(reqs, f"closed-{c}-{k}"), refs[name], c,
                                                         runs[-1]))
                run = min(runs, key=lambda r: r.wall if not r.errors else float("inf"))
                run.errors = sum(r.errors for r in runs)
                run.max_diff = max(r.max_diff for r in runs)
                rows.append(run.row())
                log(table(rows[-1:]).splitlines()[-1])
                best = max(best, rows[-1]["req_per_s"])
            for f in args.loads:
                log(f"[open] {name} {f:.0%} of {best:.2f} req/s")
                run = Run(name, "open", f)
                measured(base, run, open_loop(base, salted(reqs, f"open-{f}"), refs[name], f * best, run, args.seed))
                rows.append(run.row())
                log(table(rows[-1:]).splitlines()[-1])

    meta = dict(machine_info(torch.device("cpu")), model=args.model or "embedded default (random weights)",
                args=vars(args))
    with open(os.path.join(args.out, "serve.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c, "") for c in COLUMNS})
    text = [json.dumps(meta), "", table(rows), ""]
    ok = True
    for name in workloads:
        batch = next(r for r in rows if r["workload"] == name and r["load"] == "offline score_batch")
        c16 = [r for r in rows if r["workload"] == name and r["load"] == "closed" and r["level"] == 16]
        o70 = [r for r in rows if r["workload"] == name and r["load"] == "open" and r["level"] == 0.7]
        errors = sum(r.get("errors", 0) for r in rows if r["workload"] == name)
        diff = max(r.get("max_abs_diff", 0.0) for r in rows if r["workload"] == name)
        checks = [("zero errors", errors == 0, f"{errors} errors"),
                  ("scores equal offline (<= 1e-6)", diff <= 1e-6, f"max |diff| {diff:.2g}")]
        if c16:
            ratio = c16[0]["req_per_s"] / batch["req_per_s"]
            checks.append(("concurrency 16 >= 0.9x offline score_batch", ratio >= 0.9, f"{ratio:.2f}x"))
        if o70:
            ratio = o70[0]["p99_ms"] / o70[0]["p50_ms"]
            checks.append(("70 % load: p99 <= 3x p50", ratio <= 3.0, f"{ratio:.2f}x"))
        for what, passed, detail in checks:
            ok &= passed
            text.append(f"{name}: {'PASS' if passed else 'FAIL'} {what} ({detail})")
    report = "\n".join(text)
    print(report)
    with open(os.path.join(args.out, "serve.txt"), "w") as f:
        f.write(report + "\n")
    plot(rows, os.path.join(args.out, "serve.png"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
