"""Benchmark: fused policy log-probs with backward (``linear_logprob``) vs the materialised path.

Default shape (one query's ATO re-scoring): 512 rows (8 rollouts × 64 tokens), hidden 1,024, vocabulary 151,669, fp32 on
CPU; forward + backward to both hidden and weight (the lm_head is trained). Providers:

  materialised  ``linear_logprob_ref``: logits [T, V] fp32, log_softmax, gather, autograd
  fused         ``linear_logprob``: chunked forward, chunked recomputing backward
  gemm3         three bare GEMMs of the same shapes (logits, ∂h, ∂W) — the FLOP yardstick

Memory: as bench_topk_logprobs (torch allocation events and per-provider subprocess RSS).
Both paths must return ∂L/∂h [T, H] and ∂L/∂W [V, H] (621 MB at this shape): "extra" is the
peak minus those gradient bytes, i.e. the temporaries the method itself needs — the figure
the ≤ 10 % target is about; the totals are in the CSV too.

    python bench/bench_linear_logprob.py            # the default CPU shape
    python bench/bench_linear_logprob.py --quick    # tiny shapes, seconds
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from acarerank.benchmark.measure import (alloc_peak_extra, kernel_bench_device, machine_info, rss_in_subprocess,
                                         rss_peak_extra_mb, time_ms)
from acarerank.benchmark.projection import add_ratios, make_inputs
from acarerank.benchmark.report import write_csv

QUICK = dict(rows=32, hidden=64, vocab=4099, dtype="float32", repeats=2)
FULL = dict(rows=512, hidden=1024, vocab=151669, dtype="float32", repeats=2)
MEM_TARGET = 0.10
COLUMNS = ["provider", "rows", "hidden", "vocab", "dtype", "device", "threads", "median_ms", "p20_ms", "p80_ms", "cpu_ms",
           "time_vs_gemm3", "alloc_total_mb", "alloc_extra_mb", "rss_total_mb", "rss_extra_mb", "grad_mb",
           "alloc_extra_vs_materialised", "rss_extra_vs_materialised", "max_abs_grad_diff", "note", "device_name",
           "python", "torch", "triton", "transformers", "acarerank", "machine"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    for name in ("rows", "hidden", "vocab", "repeats"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-rss", action="store_true")
    p.add_argument("--csv", type=Path, default=None)
    p.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.csv is None:
        args.csv = Path("results") / "bench_linear_logprob" / ("linear_logprob_quick.csv" if args.quick else "linear_logprob.csv")
    return args


def providers():
    import torch

    from acarerank.ops import linear_logprob, linear_logprob_ref

    def autograd_run(fn):
        def run(h, w, tg):
            h = h.detach().requires_grad_()
            w = w.detach().requires_grad_()
            gh, gw = torch.autograd.grad(fn(h, w, tg).sum(), (h, w))
            return gh, gw
        return run

    def gemm3(h, w, tg):
        z = h @ w.T
        gh = z @ w
        gw = z.T @ h
        return gh, gw

    return {"materialised": autograd_run(linear_logprob_ref), "fused": autograd_run(linear_logprob), "gemm3": gemm3}


def child_main(args):
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    fn = providers()[args.rss_child]
    dtype = getattr(torch, args.dtype)
    fn(*make_inputs(8, args.hidden, 256, dtype, "cpu"))  # warm-up: one-time allocations
    h, w, tg = make_inputs(args.rows, args.hidden, args.vocab, dtype, "cpu")
    print(json.dumps({"rss_extra_mb": rss_peak_extra_mb(lambda: fn(h, w, tg))}))
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if args.rss_child:
        return child_main(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if kernel_bench_device(args.quick, cpu_default_shape=True) == "cuda":
        print("note: this benchmark measures the CPU path; GPU memory is measured by bench_topk_logprobs", file=sys.stderr)
    dtype = getattr(torch, args.dtype)
    h, w, tg = make_inputs(args.rows, args.hidden, args.vocab, dtype, "cpu")
    grad_mb = (h.numel() + w.numel()) * h.element_size() / 2 ** 20
    info = machine_info("cpu")
    print(f"linear_logprob fwd+bwd: T={args.rows} H={args.hidden} V={args.vocab} {args.dtype}, "
          f"threads={torch.get_num_threads()}, gradients {grad_mb:.0f} MB", flush=True)
    results, ref = {}, None
    for name, fn in providers().items():
        row = dict(provider=name, grad_mb=grad_mb, note="")
        out, peak = alloc_peak_extra(lambda: fn(h, w, tg))
        row["alloc_total_mb"] = peak / 2 ** 20
        row["alloc_extra_mb"] = row["alloc_total_mb"] - grad_mb
        t = time_ms(lambda: fn(h, w, tg), "cpu", repeats=args.repeats)
        med, cpu = t.median, t.cpu_median
        row.update(median_ms=med, p20_ms=t.p(20), p80_ms=t.p(80), cpu_ms=cpu)
        if not args.no_rss:
            child = ["--rss-child", name, "--rows", str(args.rows), "--hidden", str(args.hidden), "--vocab",
                     str(args.vocab), "--dtype", args.dtype] + (["--threads", str(args.threads)] if args.threads else [])
            row["rss_total_mb"] = rss_in_subprocess(os.path.abspath(__file__), child)
            row["rss_extra_mb"] = row["rss_total_mb"] - grad_mb
        if name == "materialised":
            ref = out
        elif name == "fused":
            row["max_abs_grad_diff"] = max(float((a - b).abs().max()) for a, b in zip(out, ref))
        results[name] = row
        print(f"  {name:12s} {med:10.1f} ms  cpu {cpu:10.1f} ms  alloc {row['alloc_total_mb']:8.1f} MB "
              f"(extra {row['alloc_extra_mb']:8.1f})  rss {row.get('rss_total_mb', float('nan')):8.1f} MB "
              f"(extra {row.get('rss_extra_mb', float('nan')):8.1f})", flush=True)
    add_ratios(results, "gemm3", "time_vs_gemm3", "{kind}_extra_vs_materialised")
    common = dict(rows=args.rows, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype, device="cpu",
                  threads=torch.get_num_threads(), **info)
    write_csv([{**row, **common} for row in results.values()], args.csv, COLUMNS)
    print(f"\n{'provider':12s} {'time/gemm3':>10s} {'alloc extra/mat':>16s} {'rss extra/mat':>14s}   target: ≤ {MEM_TARGET:.0%}")
    for name, row in results.items():
        a, r = row.get("alloc_extra_vs_materialised"), row.get("rss_extra_vs_materialised")
        print(f"{name:12s} {row['time_vs_gemm3']:10.2f} {'' if a is None else f'{a:.1%}':>16s} "
              f"{'' if r is None else f'{r:.1%}':>14s}")
    print(f"CSV: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
