"""Benchmark: the streaming top-k merge (``topk_merge_update``) per backend vs the reference on materialised logits.

Inputs: fp32 logits [T, V] already in memory, merged chunk by chunk into one state (init,
``V / chunk`` updates, finalize) — the merge alone, without the GEMMs that produce the chunks
in ``topk_logprobs`` (``bench/bench_topk_logprobs.py`` times those cores whole). Providers:

  torch, cpp, cuda   ``topk_merge_update(backend=...)`` over the chunks — those that run here
  ref                ``topk_logprobs_ref(logits, None, ...)``: a stable sort of each row (the oracle)

The merge reads every logit once: GB/s = 4·T·V bytes / time. ``x_ref`` = provider time /
ref time (< 1: faster than sorting). Ids must equal the reference's exactly (tie rule: value
desc, id asc) and log-probs within 1e-5; a breach exits 1.

Default shapes: GPU — 8,192 rows (16 ATO queries), V 151,669, k 128, chunk 16,384; CPU — 512
rows, same vocabulary, chunk 2,048. ``--quick``: tiny shapes, seconds.

    python bench/bench_topk_merge.py
    python bench/bench_topk_merge.py --quick
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

QUICK = dict(rows=16, vocab=3001, k=16, chunk=500, repeats=2)
GPU_FULL = dict(rows=8192, vocab=151669, k=128, chunk=16384, repeats=0)
CPU_FULL = dict(rows=512, vocab=151669, k=128, chunk=2048, repeats=3)
LOGPROB_TOL = 1e-5
COLUMNS = ["provider", "median_ms", "p20_ms", "p80_ms", "gb_per_s", "x_ref", "ids_equal", "max_abs_logprob_diff",
           "rows", "vocab", "k", "chunk", "device", "device_name", "python", "torch", "triton", "acarerank"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    for name in ("rows", "vocab", "k", "chunk", "repeats"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--csv", type=Path, default=None)
    return p.parse_args(argv)


def fill_defaults(args, on_gpu):
    from acarerank.benchmark.measure import fill_bench_args
    fill_bench_args(args, QUICK if args.quick else (GPU_FULL if on_gpu else CPU_FULL),
                    ('rows', 'vocab', 'k', 'chunk'), "bench_topk_merge")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from acarerank.benchmark.measure import kernel_bench_device, machine_info, time_ms
    from acarerank.benchmark.report import write_csv
    from acarerank.ops import (available_backends, topk_logprobs_ref, topk_merge_finalize, topk_merge_init,
                               topk_merge_update)

    device = kernel_bench_device(args.quick, cpu_default_shape=True)
    fill_defaults(args, device == "cuda")
    T, V, k, C = args.rows, args.vocab, args.k, args.chunk
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (4 * torch.randn(T, V, generator=g)).to(device)
    targets = torch.randint(0, V, (T,), generator=g).to(device)

    def merge(backend):
        def run():
            state = topk_merge_init(T, k, device, targets=targets)
            for c0 in range(0, V, C):
                topk_merge_update(state, logits[:, c0:c0 + C], c0, backend=backend)
            return topk_merge_finalize(state)
        return run

    calls = {b: merge(b) for b in available_backends("topk_merge", device)}
    calls["ref"] = lambda: topk_logprobs_ref(logits, None, targets, k=k)
    info = machine_info(device)
    print(f"topk_merge_update: T={T} V={V} k={k} chunk={C} on {info['device_name']}", flush=True)
    ref = calls["ref"]()
    rows, failed = [], []
    for name, fn in calls.items():
        t = time_ms(fn, device, repeats=max(args.repeats, 1))
        res = t.result
        row = dict(provider=name, median_ms=t.median, p20_ms=t.p(20), p80_ms=t.p(80),
                   gb_per_s=4 * T * V / t.median / 1e6, ids_equal=bool(torch.equal(res.topk_ids, ref.topk_ids)),
                   max_abs_logprob_diff=float(torch.maximum((res.topk_logprobs - ref.topk_logprobs).abs().max(),
                                                            (res.target_logprob - ref.target_logprob).abs().max())))
        if not row["ids_equal"] or row["max_abs_logprob_diff"] > LOGPROB_TOL:
            failed.append(name)
        rows.append(row)
    ref_ms = rows[-1]["median_ms"]
    for r in rows:
        r["x_ref"] = r["median_ms"] / ref_ms
    meta = dict(info, rows=T, vocab=V, k=k, chunk=C, device=device)
    write_csv([{**r, **meta} for r in rows], args.csv, COLUMNS)
    print(f"{'provider':<9}{'ms':>11}{'p20':>11}{'p80':>11}{'GB/s':>9}{'x_ref':>8}{'ids':>6}{'|Δ logprob|':>13}")
    for r in rows:
        print(f"{r['provider']:<9}{r['median_ms']:>11.3f}{r['p20_ms']:>11.3f}{r['p80_ms']:>11.3f}{r['gb_per_s']:>9.2f}"
              f"{r['x_ref']:>8.2f}{'yes' if r['ids_equal'] else 'NO':>6}{r['max_abs_logprob_diff']:>13.2e}")
    print(f"CSV: {args.csv}")
    if failed:
        print(f"FAILED: {', '.join(failed)} differ from the reference (ids, or log-probs by more than "
              f"{LOGPROB_TOL:g})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
