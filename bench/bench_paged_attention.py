"""Benchmark: ``prefix_shared_attention_paged`` (prefix read from pages) vs the packed op and the reference.

The paged op is what the runner calls once the prefix cache holds the context's K/V in pages;
the packed op is the same computation with the prefix as one contiguous tensor. Same inputs
for every provider: S segments of L tokens sharing one G=1 prefix of P tokens whose pages are
scattered over the pool in a seeded random order (as after evictions), block size 16.

  paged    ``prefix_shared_attention_paged`` with its plan built once before timing (backend:
           the device default, or --backend)
  packed   ``prefix_shared_attention`` on the prefix gathered into one tensor beforehand, plan
           built once (same backend) — the cost of reading pages is paged / packed
  ref      ``prefix_shared_attention_paged_ref``: gathers the prefix row by row in Python and
           runs the per-segment plain-PyTorch oracle

Correctness first: max |paged − ref| and |paged − packed| per provider, against a per-dtype
tolerance (fp32 2e-5; fp16/bf16 2e-2, both rounding to the model dtype); a breach exits 1.
Throughput: TFLOP/s on the shared FLOPs 4·Hq·d·Σ_s(L·P + L(L+1)/2) and query tokens/s;
``x_paged`` = provider time / paged time (> 1: paged is faster).

Default shapes: GPU — Qwen3-4B attention (32 / 8 heads, d 128), P 4,096, 100 × 512, bf16;
CPU — the embedded default model's (6 / 2 heads, d 64), P 1,650, 50 × 40, fp32. ``--quick``:
tiny shapes (CPU: the Triton interpreter is switched on; numbers mean nothing).

    python bench/bench_paged_attention.py            # the device's default shape
    python bench/bench_paged_attention.py --quick    # seconds
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

QUICK = dict(num_heads=4, num_kv_heads=2, head_dim=32, prefix=70, segments=3, seg_len=9, dtype="float32", repeats=2)
GPU_FULL = dict(num_heads=32, num_kv_heads=8, head_dim=128, prefix=4096, segments=100, seg_len=512, dtype="bfloat16",
                repeats=0)
CPU_FULL = dict(num_heads=6, num_kv_heads=2, head_dim=64, prefix=1650, segments=50, seg_len=40, dtype="float32",
                repeats=5)
BLOCK_SIZE = 16
TOLERANCE = {"float32": 2e-5, "float16": 2e-2, "bfloat16": 2e-2}
COLUMNS = ["provider", "median_ms", "p20_ms", "p80_ms", "tflops", "tokens_per_s", "x_paged", "max_abs_diff_vs_ref",
           "max_abs_diff_vs_paged", "backend", "num_heads", "num_kv_heads", "head_dim", "prefix", "segments",
           "seg_len", "dtype", "device", "device_name", "python", "torch", "triton", "acarerank"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke run)")
    for name in ("num_heads", "num_kv_heads", "head_dim", "prefix", "segments", "seg_len", "repeats"):
        p.add_argument(f"--{name.replace('_', '-')}", dest=name, type=int)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--backend", default=None, help="backend of both ops (default: the device's)")
    p.add_argument("--csv", type=Path, default=None)
    return p.parse_args(argv)


def fill_defaults(args, on_gpu):
    from acarerank.benchmark.measure import fill_bench_args
    fill_bench_args(args, QUICK if args.quick else (GPU_FULL if on_gpu else CPU_FULL),
                    ('num_heads', 'num_kv_heads', 'head_dim', 'segments', 'seg_len'), "bench_paged_attention")
    if args.prefix < 0 or args.num_heads % args.num_kv_heads:
        raise SystemExit("--prefix must be >= 0 and --num-heads a multiple of --num-kv-heads")
    return args


def make_inputs(args, device, dtype, seed=0):
    """Packed segments, a page pool holding the prefix in shuffled pages, and its block table."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed)
    S, L, P, Hq, Hkv, d = args.segments, args.seg_len, args.prefix, args.num_heads, args.num_kv_heads, args.head_dim
    T = S * L

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    q, k, v = rand(T, Hq, d), rand(T, Hkv, d), rand(T, Hkv, d)
    nblk = -(-P // BLOCK_SIZE)
    pool = nblk + 3  # a few pages that belong to nobody
    k_cache, v_cache = rand(pool, BLOCK_SIZE, Hkv, d), rand(pool, BLOCK_SIZE, Hkv, d)
    table = torch.randperm(pool, generator=g)[:max(nblk, 1)].to(torch.int32)[None, :].to(device)
    i32 = dict(dtype=torch.int32, device=device)
    return dict(q=q, k=k, v=v, cu_seqlens=torch.arange(0, T + 1, L, **i32), k_cache=k_cache, v_cache=v_cache,
                block_table=table, prefix_lens=torch.tensor([P], **i32), segment_group=torch.zeros(S, **i32))


def shared_flops(args) -> float:
    L, P = args.seg_len, args.prefix
    return 4.0 * args.num_heads * args.head_dim * args.segments * (L * P + L * (L + 1) / 2)


def providers(x, args, backend):
    """{name: zero-argument call}; the plans (and the packed prefix) are built here, before timing."""
    import torch

    from acarerank.ops import (plan_prefix_shared_attention, plan_prefix_shared_attention_paged,
                               prefix_shared_attention, prefix_shared_attention_paged,
                               prefix_shared_attention_paged_ref)

    T, (Hq, Hkv, d) = x["q"].shape[0], (args.num_heads, args.num_kv_heads, args.head_dim)
    paged_plan = plan_prefix_shared_attention_paged(
        x["cu_seqlens"], x["block_table"], x["prefix_lens"], x["segment_group"], num_heads=Hq, num_kv_heads=Hkv,
        head_dim=d, block_size=BLOCK_SIZE, num_blocks=x["k_cache"].shape[0], dtype=x["q"].dtype, backend=backend,
        num_tokens=T)
    # the packed op's inputs: the same prefix rows, gathered once into contiguous tensors
    nblk = -(-args.prefix // BLOCK_SIZE)
    rows = x["block_table"][0, :nblk].long()
    pk = x["k_cache"][rows].reshape(-1, Hkv, d)[:args.prefix].contiguous()
    pv = x["v_cache"][rows].reshape(-1, Hkv, d)[:args.prefix].contiguous()
    cu_pre = torch.tensor([0, args.prefix], dtype=torch.int32, device=x["q"].device)
    packed_plan = plan_prefix_shared_attention(x["cu_seqlens"], cu_pre, x["segment_group"], num_tokens=T,
                                               num_q_heads=Hq, num_kv_heads=Hkv, head_dim=d, dtype=x["q"].dtype,
                                               backend=backend)
    seg = (x["q"], x["k"], x["v"])
    return {
        # as the runner calls it per layer: the plan's metadata, no re-validation
        "paged": lambda: prefix_shared_attention_paged(*seg, x["cu_seqlens"], x["k_cache"], x["v_cache"],
                                                       x["block_table"], x["prefix_lens"], x["segment_group"],
                                                       plan=paged_plan, validate=False),
        "packed": lambda: prefix_shared_attention(*seg, None, pk, pv, None, None, plan=packed_plan),
        "ref": lambda: prefix_shared_attention_paged_ref(*seg, x["cu_seqlens"], x["k_cache"], x["v_cache"],
                                                         x["block_table"], x["prefix_lens"], x["segment_group"]),
    }, paged_plan.backend


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from acarerank.benchmark.measure import kernel_bench_device

    device = kernel_bench_device(args.quick, cpu_default_shape=True)  # before acarerank.kernels is imported
    fill_defaults(args, device == "cuda")
    from acarerank.benchmark.measure import machine_info, time_ms
    from acarerank.benchmark.report import write_csv

    x = make_inputs(args, device, getattr(torch, args.dtype))
    calls, backend = providers(x, args, args.backend)
    flops, tokens = shared_flops(args), args.segments * args.seg_len
    info = machine_info(device)
    print(f"paged attention ({backend}): Hq={args.num_heads} Hkv={args.num_kv_heads} d={args.head_dim} "
          f"P={args.prefix} S={args.segments} L={args.seg_len} {args.dtype} on {info['device_name']}", flush=True)
    outs, rows = {}, []
    for name, fn in calls.items():
        t = time_ms(fn, device, repeats=max(args.repeats, 1) if name != "ref" else 1)
        outs[name] = t.result.float()
        rows.append(dict(provider=name, median_ms=t.median, p20_ms=t.p(20), p80_ms=t.p(80),
                         tflops=flops / t.median / 1e9, tokens_per_s=tokens / t.median * 1e3))
    tol, failed = TOLERANCE[args.dtype], []
    for r in rows:
        r["x_paged"] = r["median_ms"] / rows[0]["median_ms"]
        r["max_abs_diff_vs_ref"] = float((outs[r["provider"]] - outs["ref"]).abs().max())
        r["max_abs_diff_vs_paged"] = float((outs[r["provider"]] - outs["paged"]).abs().max())
        if max(r["max_abs_diff_vs_ref"], r["max_abs_diff_vs_paged"]) > tol:
            failed.append(r["provider"])
    meta = dict(info, backend=backend, dtype=args.dtype, device=device, **{k: getattr(args, k) for k in (
        "num_heads", "num_kv_heads", "head_dim", "prefix", "segments", "seg_len")})
    write_csv([{**r, **meta} for r in rows], args.csv, COLUMNS)
    print(f"{'provider':<8}{'ms':>11}{'p20':>11}{'p80':>11}{'TFLOP/s':>10}{'tok/s':>12}{'x_paged':>9}"
          f"{'|Δ| ref':>11}{'|Δ| paged':>11}")
    for r in rows:
        print(f"{r['provider']:<8}{r['median_ms']:>11.3f}{r['p20_ms']:>11.3f}{r['p80_ms']:>11.3f}{r['tflops']:>10.4f}"
              f"{r['tokens_per_s']:>12.0f}{r['x_paged']:>9.2f}{r['max_abs_diff_vs_ref']:>11.2e}"
              f"{r['max_abs_diff_vs_paged']:>11.2e}")
    print(f"CSV: {args.csv}")
    if failed:
        print(f"FAILED: {', '.join(failed)} differ by more than {tol:g} ({args.dtype})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
