"""Pointwise speed benchmark: acarerank vs the two transformers baselines at one depth.

Shape (the embedded default, ``tiny-cpu``): hidden 384, 6 layers, 6 query / 2 KV heads,
head_dim 64, the real Qwen3 vocabulary; an M3 agent context whose shared part is ~1,500
tokens; depth 32; two document sets, each in its own run:

  varying  uniform 60–380 tokens, as retrieval returns them   targets: ≥ 5× (a), ≥ 1.6× (b)
  equal    150 tokens each, (b)'s best case                   target:  ≥ 1.0× (b)

(a) = the model card's transformers path, (b) = transformers with a reused prefix KV cache
(``acarerank.benchmark.baselines``). Random weights: timings are real, scores are not.

    python bench/bench_pointwise.py [--quick] [--repeats 5] [--output results/bench_pointwise]

Prints one line per target and writes ``bench_pointwise.csv`` (both runs, the harness's
columns plus ``docs``). The harness checks that all providers' scores agree.
"""
from __future__ import annotations

import argparse
import os
import sys

from acarerank.benchmark import report
from acarerank.benchmark.baselines import split_prompt_ids
from acarerank.benchmark.harness import BenchConfig, run_bench
from acarerank.benchmark.workload import WorkloadSpec, make_workload
from acarerank.tokenizer import load_qwen3_tokenizer

TARGETS = {  # docs -> [(baseline provider, minimum speedup of acarerank over it)]
    "varying": [("transformers", 5.0), ("transformers+prefix-cache", 1.6)],
    "equal": [("transformers+prefix-cache", 1.0)],
}


def trace_for_context(tok, context_tokens: int, spec: WorkloadSpec) -> int:
    """The trace length that makes the M3 shared part ``context_tokens`` long (measured)."""
    probe = make_workload(tok, spec)
    base = len(split_prompt_ids(tok, documents=probe.docs(1), **probe.context("M3"))[0]) - spec.trace_tokens
    if context_tokens - base < 1:
        raise ValueError(f"--context-tokens {context_tokens} is below the {base} tokens the M3 prompt needs "
                         "without a trace")
    return context_tokens - base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context-tokens", type=int, default=1500, help="shared M3 context length (default 1500)")
    ap.add_argument("--depth", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-cell-seconds", type=float, default=60.0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--output", default=os.path.join("results", "bench_pointwise"))
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2-layer model, 300-token context, depth 8, short documents, 1 repeat")
    args = ap.parse_args(argv)

    tok = load_qwen3_tokenizer()
    overrides, depth, ctx_tokens = {}, args.depth, args.context_tokens
    docs = {"varying": (60, 380), "equal": (150, 150)}
    if args.quick:
        overrides, depth, ctx_tokens = {"num_hidden_layers": 2}, 8, 300
        docs = {"varying": (20, 100), "equal": (40, 40)}
    trace_tokens = trace_for_context(tok, ctx_tokens, WorkloadSpec(num_docs=depth))

    os.makedirs(args.output, exist_ok=True)
    all_rows, ok_all, lines = [], True, []
    for name, rng in docs.items():
        cfg = BenchConfig(depths=(depth,), modes=("M3",), preset="tiny-cpu", overrides=overrides,
                          repeats=1 if args.quick else args.repeats, warmup=0 if args.quick else 1,
                          max_cell_seconds=args.max_cell_seconds, dtype=args.dtype, device=args.device,
                          spec=WorkloadSpec(trace_tokens=trace_tokens, doc_tokens=rng, num_docs=depth))
        res = run_bench(cfg)
        for r in res.rows:
            r["docs"] = name
        all_rows += res.rows
        ok, check = report.score_check(res.rows, res.tolerance)
        ok_all &= ok
        med = {r["provider"]: r["median_ms"] for r in res.rows}
        lines.append(f"[{name} documents {rng[0]}-{rng[1]} tokens, shared context {res.rows[0]['shared_tokens']} "
                     f"tokens, depth {depth}] {check}")
        lines.append(report.format_table(res.rows))
        for prov in (p for p in med if p.startswith("acarerank-")):
            for base, target in TARGETS[name]:
                x = med[base] / med[prov]
                lines.append(f"  {prov} vs {base}: {x:.2f}x (target >= {target:g}x: {'met' if x >= target else 'NOT met'})")
    path = os.path.join(args.output, "bench_pointwise.csv")
    report.write_csv(all_rows, path, columns=["docs"] + report.COLUMNS)
    lines.append(f"machine: {all_rows[0]['device_name']}; torch {all_rows[0]['torch']}, transformers "
                 f"{all_rows[0]['transformers']}; random weights (timings only); wrote {path}")
    print("\n".join(lines))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
