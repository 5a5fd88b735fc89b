"""Benchmark: ``merge_attention_states`` (the cascade's merge of two partial attentions) per backend vs the reference.

Inputs: two partial results over disjoint key sets, o_a / o_b [T, H, d] and lse_a / lse_b
[T, H] fp32, with a few rows where one side saw no keys (lse = −inf), as the cascade hands
them over. Providers, on the same inputs:

  torch, cpp, cuda   ``merge_attention_states(backend=...)`` — those that run here
  ref                ``merge_attention_states_ref``: the formula in fp64 (the oracle)

The op reads 2·T·H·(d·b + 4) bytes and writes T·H·(d·b + 4) (b: bytes per element of o), so
it is memory-bound: GB/s = those bytes / time. ``x_torch`` = provider time / torch time
(> 1: torch is faster). Every provider's max |out − ref| and |lse − ref| is checked against a
per-dtype tolerance, that of tests/ops/test_op_merge_states.py (|Δ| <= atol + rtol·|ref|; fp32
1e-6 + 1e-6·|ref|, bf16 one rounding); a breach exits 1.

Default shapes: GPU — the cascade of Qwen3-4B at depth 100 (51,200 segment tokens, 32
heads, d 128, bf16); CPU — the embedded default model's pass (2,048 tokens, 6 heads, d 64,
fp32). ``--quick``: tiny shapes, seconds.

    python bench/bench_merge_states.py
    python bench/bench_merge_states.py --quick
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

QUICK = dict(tokens=33, heads=3, head_dim=16, dtype="float32", repeats=3)
GPU_FULL = dict(tokens=51200, heads=32, head_dim=128, dtype="bfloat16", repeats=0)
CPU_FULL = dict(tokens=2048, heads=6, head_dim=64, dtype="float32", repeats=20)
# as tests/ops/test_op_merge_states.py: |x − ref| <= atol + rtol · |ref|; lse is fp32 for every dtype
TOLERANCE = {"float32": (1e-6, 1e-6), "float16": (1e-5, 1e-3), "bfloat16": (1e-5, 1.6e-2)}
COLUMNS = ["provider", "median_ms", "p20_ms", "p80_ms", "gb_per_s", "x_torch", "max_abs_out_diff", "max_abs_lse_diff",
           "tokens", "heads", "head_dim", "dtype", "device", "device_name", "python", "torch", "triton", "acarerank"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    for name in ("tokens", "heads", "head_dim", "repeats"):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--csv", type=Path, default=None)
    return p.parse_args(argv)


def fill_defaults(args, on_gpu):
    from acarerank.benchmark.measure import fill_bench_args
    fill_bench_args(args, QUICK if args.quick else (GPU_FULL if on_gpu else CPU_FULL),
                    ('tokens', 'heads', 'head_dim'), "bench_merge_states")
    return args


def make_inputs(T, H, d, dtype, device, seed=0):
    """Two partial results; every 7th row of a has seen no keys (lse −inf), every 11th of b."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    o_a, o_b = (torch.randn(T, H, d, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    lse_a, lse_b = (3 * torch.randn(T, H, generator=g) for _ in range(2))
    lse_a[::7] = float("-inf")
    lse_b[::11] = float("-inf")
    return o_a, lse_a.to(device), o_b, lse_b.to(device)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from acarerank.benchmark.measure import kernel_bench_device, machine_info, time_ms
    from acarerank.benchmark.report import write_csv
    from acarerank.ops import available_backends, merge_attention_states, merge_attention_states_ref

    device = kernel_bench_device(args.quick, cpu_default_shape=True)
    fill_defaults(args, device == "cuda")
    T, H, d, dtype = args.tokens, args.heads, args.head_dim, getattr(torch, args.dtype)
    inputs = make_inputs(T, H, d, dtype, device)
    nbytes = 3 * T * H * (d * inputs[0].element_size() + 4)
    calls = {b: (lambda b: lambda: merge_attention_states(*inputs, backend=b))(b)
             for b in ["torch"] + [b for b in available_backends("merge_states", device) if b != "torch"]}
    calls["ref"] = lambda: merge_attention_states_ref(*inputs)
    info = machine_info(device)
    print(f"merge_attention_states: T={T} H={H} d={d} {args.dtype} on {info['device_name']}", flush=True)
    ref_out, ref_lse = (x.float() for x in merge_attention_states_ref(*inputs))
    (atol, rtol), rows, failed = TOLERANCE[args.dtype], [], []

    def breach(x, ref, rt):
        return bool(((x.float() - ref).abs() > atol + rt * ref.abs()).any())

    for name, fn in calls.items():
        t = time_ms(fn, device, repeats=max(args.repeats, 1))
        out, lse = t.result
        # rows where both parts are empty give lse −inf in both: compare finite entries, and the −inf pattern
        same_inf = torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        fin = torch.isfinite(ref_lse)
        row = dict(provider=name, median_ms=t.median, p20_ms=t.p(20), p80_ms=t.p(80), gb_per_s=nbytes / t.median / 1e6,
                   max_abs_out_diff=float((out.float() - ref_out).abs().max()),
                   max_abs_lse_diff=float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0)
        if not same_inf or breach(out, ref_out, rtol) or breach(lse[fin], ref_lse[fin], 1e-6):
            failed.append(name)
        rows.append(row)
    for r in rows:
        r["x_torch"] = r["median_ms"] / rows[0]["median_ms"]
    meta = dict(info, tokens=T, heads=H, head_dim=d, dtype=args.dtype, device=device)
    write_csv([{**r, **meta} for r in rows], args.csv, COLUMNS)
    print(f"{'provider':<9}{'ms':>10}{'p20':>10}{'p80':>10}{'GB/s':>9}{'x_torch':>9}{'|Δout|':>11}{'|Δlse|':>11}")
    for r in rows:
        print(f"{r['provider']:<9}{r['median_ms']:>10.4f}{r['p20_ms']:>10.4f}{r['p80_ms']:>10.4f}{r['gb_per_s']:>9.2f}"
              f"{r['x_torch']:>9.2f}{r['max_abs_out_diff']:>11.2e}{r['max_abs_lse_diff']:>11.2e}")
    print(f"CSV: {args.csv}")
    if failed:
        print(f"FAILED: {', '.join(failed)} differ from the reference by more than {atol:g} + {rtol:g}·|ref| "
              f"({args.dtype})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
