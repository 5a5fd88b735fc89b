"""Agent-session workload: the same question, a trace that grows every step, new documents.

    step k (1..steps): trace = the first k·trace_step tokens of one long trace;
                       sub-queries j = 1..subqueries, each scoring ``docs`` new documents

Providers, run one after the other on the same session:
  acarerank+cache   one PointwiseReranker for the session, prefix cache on: a step computes
                    only what the previous steps did not leave in the cache
  acarerank         prefix cache off: every call computes its whole shared part
  transformers+prefix-cache   transformers with a per-request prefix cache (the shared part
                    once per request, nothing kept across calls)

Per step: tokens computed (shared tokens computed + every document segment) and latency.
The token bound of the cache's speedup is tokens(cache off) / tokens(cache on) — what the
speedup would be if time were proportional to tokens; the FLOP bound weighs each token by
its linear and attention FLOPs (``report``'s model); the measured speedup is latency(cache
off) / latency(cache on). Scores of all providers must agree (``check``): the two acarerank
providers within ``cache_tolerance(dtype)`` (fp32 1e-6), and acarerank+cache within
``tolerance(dtype)`` of transformers (fp32 1e-5); bf16/fp16 both the depth workload's
``harness.SCORE_TOLERANCE``.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .._validate import positive_int
from .workload import _cut_to_tokens, _text, _trace, check_sizes, token_count, vocab_words


@dataclass(frozen=True)
class AgentSpec:
    steps: int = 8
    trace_step_tokens: int = 600
    question_tokens: int = 60
    query_tokens: int = 20
    docs: int = 20
    doc_tokens: tuple = (60, 380)
    subqueries: int = 1
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "trace_step_tokens", "question_tokens", "query_tokens", "docs", "subqueries"):
            v = getattr(self, name)
            positive_int(f"AgentSpec.{name}", v)
        lo, hi = self.doc_tokens
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ValueError(f"AgentSpec.doc_tokens must be (low, high) with 1 <= low <= high, got {self.doc_tokens!r}")
        check_sizes("AgentSpec", dict(question_tokens=self.question_tokens, query_tokens=self.query_tokens,
                                      doc_tokens=hi, **{"steps x trace_step_tokens": self.steps * self.trace_step_tokens}),
                    dict(docs=self.docs, subqueries=self.subqueries))


def make_session(tokenizer, spec: AgentSpec) -> list:
    """[step] -> [ScoreRequest per sub-query]; traces are token-boundary prefixes of one trace."""
    from acarerank.pointwise import ScoreRequest

    rng = random.Random(spec.seed)
    words = vocab_words(tokenizer)
    question = _text(tokenizer, rng, words, spec.question_tokens)
    full = _trace(tokenizer, rng, words, spec.steps * spec.trace_step_tokens)
    steps = []
    for k in range(1, spec.steps + 1):
        trace = _cut_to_tokens(tokenizer, full, k * spec.trace_step_tokens)
        reqs = []
        for _ in range(spec.subqueries):
            query = _text(tokenizer, rng, words, spec.query_tokens)
            docs = [_text(tokenizer, rng, words, rng.randint(*spec.doc_tokens)) for _ in range(spec.docs)]
            reqs.append(ScoreRequest(query, docs, question=question, trace=trace))
        steps.append(reqs)
    return steps


#: agent.csv's columns, one row per (sub-queries, provider, step); ``error`` (``<type>: <message>``)
#: is set only in the row of the step where a provider raised, which has no figures (as bench.csv's)
COLUMNS = ("provider", "step", "tokens_computed", "flops", "latency_s", "trace_tokens", "subqueries", "error")


def run_agent_bench(model, tokenizer, spec: AgentSpec, backend=None, log: Callable[[str], None] = print,
                    providers=("acarerank+cache", "acarerank", "transformers+prefix-cache"),
                    partial_csv: Optional[str] = None, rows_before: Sequence[dict] = ()) -> dict:
    """Run the session once per provider (after one untimed warm-up call each); returns
    {"rows": [per provider per step], "totals": {provider: {...}}, "spec": spec}.

    partial_csv: rewritten (``COLUMNS``; ``rows_before`` — earlier sessions' rows — first) after
    every step, so a run cut short leaves the steps it measured. A provider that raises stops the
    run with ``harness.ProviderFailed``, after a last row for its failing step (the warm-up's
    failure is step 1's) is written there with ``error`` set."""
    from acarerank.pointwise import PointwiseReranker

    from .baselines import PrefixCacheTransformers
    from .harness import ProviderFailed, call_provider
    from .report import Shapes, write_csv

    shapes = Shapes.from_config(model.config)
    session = make_session(tokenizer, spec)
    rows, totals, scores = [], {}, {}

    def save(extra=()):
        if partial_csv is not None:
            write_csv(list(rows_before) + rows + list(extra), partial_csv, COLUMNS)

    for name in providers:
        padded_batch = None  # acarerank's packed runner (_call_flops)
        if name in ("acarerank+cache", "acarerank"):
            rr = PointwiseReranker(model=model, tokenizer=tokenizer, backend=backend,
                                   prefix_cache=name == "acarerank+cache")

            def warm_up(rr=rr):  # allocations, kernels; the timed steps get a fresh cache
                rr.score_batch(session[0][:1])

            rr = PointwiseReranker(model=model, tokenizer=tokenizer, backend=backend,
                                   prefix_cache=name == "acarerank+cache")

            def call(reqs, rr=rr):  # score_batch, also reading each request's cache hit
                return rr.score_encodings([rr.encode(r) for r in reqs])
        elif name == "transformers+prefix-cache":
            tr = PrefixCacheTransformers(model, tokenizer)
            padded_batch = tr.batch_size

            def warm_up(tr=tr, r0=session[0][0]):
                tr.score(r0.query, r0.documents[:2], question=r0.question, trace=r0.trace)

            def call(reqs, tr=tr):
                return [tr.score(r.query, r.documents, question=r.question, trace=r.trace) for r in reqs], None
        else:
            raise ValueError(f"unknown provider {name!r}")
        t_total, tok_total, flop_total, got = 0.0, 0, 0.0, []
        k = 1
        try:
            call_provider(name, warm_up)
            for k, reqs in enumerate(session, start=1):
                t0 = time.perf_counter()
                out, n_tok = call_provider(name, call, reqs)
                dt = time.perf_counter() - t0
                encs = [_enc(tokenizer, r) for r in reqs]  # untimed: token counts only
                hits = n_tok if n_tok is not None else [0] * len(reqs)  # transformers: nothing across calls
                n_tok = sum(len(e.shared_ids) - h + sum(map(len, e.segment_ids)) for e, h in zip(encs, hits))
                flops = sum(_call_flops(shapes, len(e.shared_ids), h, [len(x) for x in e.segment_ids], padded_batch)
                            for e, h in zip(encs, hits))
                rows.append(dict(provider=name, step=k, tokens_computed=n_tok, flops=flops, latency_s=dt,
                                 trace_tokens=k * spec.trace_step_tokens, subqueries=spec.subqueries))
                save()
                log(f"  {name:28s} step {k}: {n_tok:6d} tokens computed, {dt * 1e3:9.1f} ms")
                t_total += dt
                tok_total += n_tok
                flop_total += flops
                got.append(out)
        except ProviderFailed as e:
            log(f"  {name:28s} step {k}: FAILED {e}")
            save([dict(provider=name, step=k, trace_tokens=k * spec.trace_step_tokens, subqueries=spec.subqueries,
                       error=str(e).partition(": ")[2])])
            raise
        totals[name] = dict(latency_s=t_total, tokens_computed=tok_total, flops=flop_total)
        scores[name] = got
    return dict(rows=rows, totals=totals, scores=scores, spec=spec)


def _call_flops(sh, shared: int, hit: int, seg_lens, padded_batch: Optional[int] = None) -> float:
    """Linear + attention FLOPs of one request as its provider computes it.

    acarerank (cache on or off; ``padded_batch`` None): the shared tokens not served from the cache (after ``hit``
    cached ones), then every segment over the whole shared part, the runner's last-layer
    savings included (``report.packed_flop_parts``). transformers+prefix-cache: the whole
    shared part, then right-padded batches of ``padded_batch`` documents (its batch_size),
    every layer on every row (``report.plan_flop_parts``' "prefix_padded")."""
    from .report import packed_flop_parts, plan_flop_parts

    if padded_batch is not None:
        parts = plan_flop_parts("prefix_padded", sh, shared, seg_lens, padded_batch)
    else:
        parts = packed_flop_parts(sh, shared, seg_lens, cached=hit)
    return parts["linear"] + parts["attn"]


def _enc(tokenizer, r):
    from acarerank.prompts import encode_pointwise

    return encode_pointwise(tokenizer, r.query, r.documents, question=r.question, trace=r.trace)


def max_score_diff(a, b) -> float:
    """max |a − b| over every step, request and document of two providers' session scores; NaN
    when a score is NaN or the two hold different numbers of steps, requests or documents, so
    ``check`` fails (``max`` over a generator skips a NaN that is not first, and ``zip`` stops
    at the shorter list: both would read as agreement)."""
    from .harness import max_abs_diff

    if len(a) != len(b):
        return math.nan
    worst = 0.0
    for sa, sb in zip(a, b):
        if len(sa) != len(sb):
            return math.nan
        for ra, rb in zip(sa, sb):
            d = max_abs_diff(ra, rb)  # NaN for a NaN score or unequal lengths
            if d != d:
                return math.nan
            worst = max(worst, d)
    return worst


def format_report(res: dict) -> str:
    """Per-step table, totals, the token bound beside the measured speedup, and the score check."""
    rows, totals, spec = res["rows"], res["totals"], res["spec"]
    provs = list(totals)
    lines = [f"agent session: {spec.steps} steps, trace +{spec.trace_step_tokens} tokens/step, question "
             f"{spec.question_tokens}, {spec.subqueries} sub-quer{'y' if spec.subqueries == 1 else 'ies'} per step, "
             f"{spec.docs} documents of {spec.doc_tokens[0]}-{spec.doc_tokens[1]} tokens per call"]
    head = "step  trace | " + " | ".join(f"{p:>26s}" for p in provs)
    lines += [head, "           | " + " | ".join(f"{'tokens':>12s} {'ms':>13s}" for _ in provs)]
    for k in range(1, spec.steps + 1):
        cells = []
        for p in provs:
            r = next(x for x in rows if x["provider"] == p and x["step"] == k)
            cells.append(f"{r['tokens_computed']:12d} {r['latency_s'] * 1e3:13.1f}")
        lines.append(f"{k:4d} {k * spec.trace_step_tokens:6d} | " + " | ".join(cells))
    lines.append("total      | " + " | ".join(f"{totals[p]['tokens_computed']:12d} {totals[p]['latency_s'] * 1e3:13.1f}"
                                               for p in provs))
    if "acarerank+cache" in totals and "acarerank" in totals:
        on, off = totals["acarerank+cache"], totals["acarerank"]
        bound = off["tokens_computed"] / max(1, on["tokens_computed"])
        fbound = off["flops"] / max(1.0, on["flops"])
        measured = off["latency_s"] / max(1e-12, on["latency_s"])
        lines.append(f"cache speedup over cache off: measured {measured:.2f}x, token bound {bound:.2f}x "
                     f"({100 * measured / bound:.0f}% of the bound; target >= 90%), FLOP bound {fbound:.2f}x "
                     f"({100 * measured / fbound:.0f}%; documents attend to the whole context, so a saved "
                     f"context token is worth less than an average token)")
        d = max_score_diff(res["scores"]["acarerank+cache"], res["scores"]["acarerank"])
        lines.append(f"scores cache on vs off: max |diff| {d:.2e} (must be <= 1e-6)")
    if "transformers+prefix-cache" in totals and "acarerank+cache" in totals:
        t = totals["transformers+prefix-cache"]
        lines.append(f"acarerank+cache vs transformers+prefix-cache: "
                     f"{t['latency_s'] / max(1e-12, totals['acarerank+cache']['latency_s']):.2f}x faster, "
                     f"{t['tokens_computed'] / max(1, totals['acarerank+cache']['tokens_computed']):.2f}x fewer tokens")
        d = max_score_diff(res["scores"]["acarerank+cache"], res["scores"]["transformers+prefix-cache"])
        lines.append(f"scores acarerank+cache vs transformers+prefix-cache: max |diff| {d:.2e}")
    return "\n".join(lines)


#: largest |score(acarerank+cache) - score(cache off)| of a session: the same runner, the context
#: computed whole or in pieces
CACHE_TOLERANCE = 1e-6


def tolerance(dtype: str) -> float:
    """Largest |score(acarerank+cache) - score(transformers+prefix-cache)| in ``dtype``: fp32 1e-5
    (the runner's own bound); a 16-bit dtype rounds every layer, padded batches and packed
    segments differently: the depth workload's ``harness.SCORE_TOLERANCE`` of that dtype."""
    from .harness import SCORE_TOLERANCE

    return 1e-5 if dtype == "float32" else SCORE_TOLERANCE[dtype]


def cache_tolerance(dtype: str) -> float:
    """Largest |score(acarerank+cache) - score(acarerank)| in ``dtype``: fp32 ``CACHE_TOLERANCE``;
    a 16-bit dtype rounds the context computed in pieces differently from it computed whole
    (~1.5e-3 in bf16): the depth workload's ``harness.SCORE_TOLERANCE`` of that dtype."""
    from .harness import SCORE_TOLERANCE

    return CACHE_TOLERANCE if dtype == "float32" else SCORE_TOLERANCE[dtype]


def check_line(res: dict, tol_vs_transformers: float = 1e-5, tol_cache: float = CACHE_TOLERANCE) -> tuple:
    """(ok, line): the session's score check, ``PASS``/``FAIL`` with each comparison's worst
    |difference| and its tolerance (a NaN difference fails)."""
    s = res["scores"]
    parts, ok = [], True
    pairs = (("acarerank", tol_cache), ("transformers+prefix-cache", tol_vs_transformers))
    for other, tol in pairs:
        if "acarerank+cache" in s and other in s:
            d = max_score_diff(s["acarerank+cache"], s[other])
            ok &= d <= tol
            parts.append(f"acarerank+cache vs {other}: max |diff| {d:.2e} (tolerance {tol:g})")
    return bool(ok), f"score check: {'PASS' if ok else 'FAIL'}: " + ("; ".join(parts) or "nothing to compare")


def check(res: dict, tol_vs_transformers: float = 1e-5) -> bool:
    """Whether the session's scores agree (``check_line``)."""
    return check_line(res, tol_vs_transformers)[0]


__all__ = ["COLUMNS", "AgentSpec", "make_session", "run_agent_bench", "format_report", "check", "check_line",
           "tolerance", "cache_tolerance", "token_count"]
